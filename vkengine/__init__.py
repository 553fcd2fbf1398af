"""vkengine: LLM inference on Vulkan through Kompute."""
__version__ = "0.1.0"
