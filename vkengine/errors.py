"""The one exception type for errors a user can cause or fix."""


class VkEngineError(Exception):
    """A problem the user can act on (bad model file, no Vulkan device, prompt too
    long, ...). The message says what is wrong and what to do; the CLI prints it
    without a traceback."""
