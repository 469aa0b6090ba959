"""Packed scalar arguments. A kernel with many scalars takes them as ONE list argument: torch.mps.compile_shader
packs a Python list of ints as int64 (of floats as float32) into a single setBytes slot, which the kernel reads as
`constant long* params` (`constant float*`) at the indices common.h names (docs/design.md, 3.1). Each layout here is
those names in order, common.h's `#define <LAYOUT>_<FIELD> <index>` and `<LAYOUT>_COUNT` its mirror
(tests/ops/metal/test_kernel_limits.py checks that they agree)."""

from __future__ import annotations

from typing import Dict, Tuple

RASTER_FWD = ("width", "height", "tile_width", "tile_height", "total_tiles", "n_isects", "has_background",
              "pass_index", "chunk", "has_resume", "row0", "has_composite")  # fmt: skip
RASTER_BWD = ("width", "height", "tile_width", "tile_height", "total_tiles", "n_isects", "flags", "pass_index",
              "chunk", "row0")  # fmt: skip
PROJECT_FWD_INTS = ("C", "N", "width", "height", "calc_comp", "flags", "degree", "dc_stride", "rest_stride",
                    "rest_offset")  # fmt: skip
PROJECT_FWD_FLOATS = ("eps2d", "near_plane", "far_plane", "radius_clip")
# adam_step: then each slot's exp_avg offset in the exp_avg arena, and its exp_avg_sq offset in the other (adam.py)
ADAM_STEP = ("N", "widths", "cams", "avg0", "avg1", "avg2", "avg3", "avg4", "avg5", "avg_sq0", "avg_sq1", "avg_sq2",
             "avg_sq3", "avg_sq4", "avg_sq5")  # fmt: skip
# project_bwd: then each output's element offset (in its gradient buffer, or stepped there its exp_avg's in the
# exp_avg arena) and each moment's in the exp_avg_sq arena (prepare.py)
PROJECT_BWD = ("N", "width", "height", "n_groups", "eps2d", "flags", "v_means", "v_quats", "v_scales", "v_opacities",
               "v_sh_dc", "v_sh_rest", "avg_sq_means", "avg_sq_quats", "avg_sq_scales", "avg_sq_opacities",
               "avg_sq_dc", "avg_sq_rest")  # fmt: skip

LAYOUTS: Dict[str, Tuple[str, ...]] = {"RASTER_FWD": RASTER_FWD, "RASTER_BWD": RASTER_BWD,
                                       "PROJECT_FWD_INTS": PROJECT_FWD_INTS, "PROJECT_FWD_FLOATS": PROJECT_FWD_FLOATS,
                                       "ADAM_STEP": ADAM_STEP, "PROJECT_BWD": PROJECT_BWD}  # fmt: skip


def pack(layout: Tuple[str, ...], **values) -> list:
    """The list argument of `layout`: every field's value, in its order (each one exactly once)."""
    if len(values) != len(layout) or any(name not in values for name in layout):
        raise TypeError(f"packed arguments {sorted(values)} are not the layout's fields {list(layout)}")
    return [values[name] for name in layout]
