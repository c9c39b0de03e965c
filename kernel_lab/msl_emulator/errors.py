"""The emulator's exceptions (re-exported by the package)."""


class EmulatorError(Exception):
    """The emulator cannot run this: a bad launch, an unsupported construct,
    or a kernel that faulted (out-of-bounds access, ...) or never finished."""


class MetalCompileError(EmulatorError):
    """clang rejected the kernel source; the message holds its diagnostics."""


class DeadlockError(EmulatorError):
    """Threads wait at a barrier or simd function that others never reach,
    or the kernel did not finish within the dispatch's time limit."""
