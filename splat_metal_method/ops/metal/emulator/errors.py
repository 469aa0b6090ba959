"""Errors of the MSL emulator."""


class EmulatorError(RuntimeError):
    """A kernel was launched wrongly, or misbehaved in a way Metal leaves undefined."""


class MetalCompileError(EmulatorError):
    """The kernel source is not valid MSL: g++, the MSL subset check or the address-space check refused it.

    The message names the .metal file and line (the assembled source's #line directives)."""
