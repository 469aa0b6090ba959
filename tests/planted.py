"""Planted kernel bugs: a stage's Metal source with lines replaced, compiled for the emulator, for the tests that
show their comparison can fail."""

from __future__ import annotations

import torch

from splat_metal_method.ops.metal import runtime
from splat_metal_method.ops.metal.kernels import stage_source


def planted_library(stage_file: str, replacements, name: str, extra: tuple = ()):
    """``stage_file``'s library (kernels.stage_source with ``extra`` defines) with each (old, new) of
    ``replacements`` applied; each ``old`` must occur exactly once."""
    source = stage_source(stage_file, extra=extra)
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return runtime.library_for(torch.device("cpu"), source, name=name)
