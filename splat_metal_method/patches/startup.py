"""A faster start for every ``ns-*`` command that loads splat-metal (ns-train, ns-export, ns-eval, ...).

nerfstudio 1.1.5's ``nerfstudio.configs.method_configs`` builds a stand-in config for each of its 26
installable external methods, and each stand-in's ``__post_init__`` asks ``inspect.stack()[2].function``
whether it was made by ``get_external_methods`` (quiet) or by the user picking it on the command line
(an offer to install it). ``inspect.stack()`` reads the source file of every frame on the stack and
scans ``sys.modules`` for each one: 3-5 s of CPU per command on a 2-core machine, about a third of a
short ``ns-train``'s start-up (measured: importing method_configs took 13.2 s of CPU, 8.5 s with this).

``apply()`` puts a wrapper in front of that ``__post_init__`` that answers the same question from the
frame itself (``sys._getframe(2)``: the same frame, without reading any source) and calls nerfstudio's
own method otherwise, so a user who picks an external method still gets its install offer. It runs
when splat-metal's config is imported: nerfstudio loads the method plugins (``discover_methods``)
before it builds the stand-ins (``get_external_methods``). A no-op where nerfstudio has no such class
or its ``__post_init__`` does not ask ``inspect.stack()``.
"""

from __future__ import annotations

import inspect
import sys

_WRAPPED = "_splat_metal_fast_post_init"


def _asks_the_stack(post_init) -> bool:
    try:
        source = inspect.getsource(post_init)
    except (OSError, TypeError):
        return False
    return "inspect.stack()[2].function" in source and '"get_external_methods"' in source


def apply() -> None:
    """Installs the wrapper (once)."""
    try:
        from nerfstudio.configs.external_methods import ExternalMethodDummyTrainerConfig
    except ImportError:
        return
    original = ExternalMethodDummyTrainerConfig.__dict__.get("__post_init__")
    if original is None or getattr(original, _WRAPPED, False) or not _asks_the_stack(original):
        return

    def __post_init__(self) -> None:
        # Frames: 0 this wrapper, 1 the dataclass __init__, 2 whoever made the stand-in.
        if sys._getframe(2).f_code.co_name == "get_external_methods":
            return
        original(self)  # its own inspect.stack()[2] is then __init__: the install offer, as before

    setattr(__post_init__, _WRAPPED, True)
    ExternalMethodDummyTrainerConfig.__post_init__ = __post_init__  # type: ignore[method-assign]
