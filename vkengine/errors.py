"""The one exception type for errors a user can cause or fix."""


class VkEngineError(Exception):
    """A problem the user can act on (bad model file, no Vulkan device, prompt too
    long, ...). The message says what is wrong and what to do; the CLI prints it
    without a traceback."""


class DeviceFault(VkEngineError):
    """The GPU failed under a running program (VK_ERROR_DEVICE_LOST, an
    allocation or kernel error surfacing at its fence): nothing on the device
    can be trusted after it. A server ends every request and exits non-zero for
    its supervisor to restart it (server/worker.py)."""
