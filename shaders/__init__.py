"""GLSL compute shaders of vkengine (sources only; vkengine.shaders compiles them)."""
