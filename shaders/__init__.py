"""GLSL compute shaders of vkengine (sources only; vkengine.spirv compiles them)."""
