"""The gaussians an export writes: what ``ns-export gaussian-splat`` (nerfstudio 1.1.5,
scripts/exporter.py ExportGaussianSplat.main) writes, taken once from the model for every format.

Same values: splatfacto's stored (pre-activation) parameters, DC colour as ``model.shs_0`` (for SH
degree 0 models that is RGB2SH(sigmoid(features_dc)), as the exporter writes it). Same selection:
the optional oriented-box crop, then gaussians with a non-finite value or an opacity below 1/255
(logit -5.5373, which the rasterizers skip) are dropped. One deliberate difference: nerfstudio's
finite check on its 1-D columns (x, y, z) reduces over the whole column, so a single NaN position
drops every gaussian and ns-export then fails; here only the offending rows go.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

LOW_OPACITY_LOGIT = -5.5373  # logit(1/255): ns-export's cut
SH_C0 = 0.28209479177387814  # Y_0^0: rgb = 0.5 + SH_C0 * dc
# The render mode of a scene trained with rasterize_mode "antialiased" (the mip filter), as
# splat-transform and Brush spell it: a .ply / .compressed.ply header comment and SOG's meta.json
# "model"; a classic scene carries neither (.spz has its own flag: spz_file.FLAG_ANTIALIASED).
ANTIALIASED_PLY_COMMENT = "SplatRenderMode: mip"
ANTIALIASED_SOG_MODEL = "antialiased"


@dataclass
class ExportGaussians:
    """Float32 arrays, one row per exported gaussian, in the model's order."""

    means: np.ndarray  # [N, 3]
    log_scales: np.ndarray  # [N, 3]
    quats: np.ndarray  # [N, 4] wxyz, as stored (not normalised)
    opacity_logits: np.ndarray  # [N]
    sh_dc: np.ndarray  # [N, 3] DC SH coefficient per channel
    sh_rest: np.ndarray  # [N, K-1, 3] higher bands, coefficient-major (K = (sh_degree+1)^2)
    sh_degree: int
    antialiased: bool  # trained with rasterize_mode "antialiased" (every format but .splat records it)
    n_model: int  # gaussians in the model, before the crop and the cuts
    n_cropped: int  # outside the oriented box
    n_nonfinite: int
    n_low_opacity: int

    def ply_comments(self) -> List[str]:
        """The header comments a .ply or .compressed.ply adds for the render mode."""
        return [ANTIALIASED_PLY_COMMENT] if self.antialiased else []

    @property
    def count(self) -> int:
        return int(self.means.shape[0])

    def ply_columns(self) -> "OrderedDict[str, np.ndarray]":
        """nerfstudio's ``map_to_tensors`` for ``ExportGaussianSplat.write_ply``, in its order:
        positions, zero normals, f_dc_*, f_rest_* (Inria order: channel-major, i.e. [N, 3, K-1]
        flattened), opacity, scale_*, rot_*."""
        n = self.count
        cols: "OrderedDict[str, np.ndarray]" = OrderedDict()
        for i, name in enumerate("xyz"):
            cols[name] = self.means[:, i]
        for name in ("nx", "ny", "nz"):
            cols[name] = np.zeros(n, dtype=np.float32)
        for i in range(3):
            cols[f"f_dc_{i}"] = self.sh_dc[:, i]
        if self.sh_degree > 0:
            rest = self.sh_rest.transpose(0, 2, 1).reshape(n, -1)  # [N, 3*(K-1)]
            for i in range(rest.shape[1]):
                cols[f"f_rest_{i}"] = rest[:, i]
        cols["opacity"] = self.opacity_logits
        for i in range(3):
            cols[f"scale_{i}"] = self.log_scales[:, i]
        for i in range(4):
            cols[f"rot_{i}"] = self.quats[:, i]
        return cols


def export_gaussians(
    model,  # a SplatfactoModel (SplatMetalModel included)
    obb: Optional[Tuple[Tuple[float, float, float], Tuple[float, float, float], Tuple[float, float, float]]] = None,
) -> ExportGaussians:
    """The model's exportable gaussians. ``obb`` = (center, rotation as RPY radians, scale), the
    crop of ``ns-export gaussian-splat --obb-center/--obb-rotation/--obb-scale``."""

    def arr(t) -> np.ndarray:  # a model's tensor, or a checkpoint's numpy array (export/checkpoint.py)
        if isinstance(t, np.ndarray):
            return np.asarray(t, dtype=np.float32)
        return t.detach().float().cpu().numpy()

    means = arr(model.means)  # [N, 3]
    sh_dc = arr(model.shs_0)  # [N, 3]
    n_model = means.shape[0]
    if model.config.sh_degree > 0:
        sh_rest = arr(model.shs_rest)  # [N, K-1, 3]
    else:
        sh_rest = np.zeros((n_model, 0, 3), np.float32)
    opacity = arr(model.opacities).reshape(n_model)  # [N]
    log_scales = arr(model.scales)  # [N, 3]
    quats = arr(model.quats)  # [N, 4]

    keep = np.ones(n_model, dtype=bool)
    if obb is not None:
        import torch
        from nerfstudio.data.scene_box import OrientedBox

        box = OrientedBox.from_params(*obb)
        keep = box.within(torch.from_numpy(means)).numpy().reshape(n_model)
    n_cropped = int((~keep).sum())
    rows = [means, sh_dc, sh_rest.reshape(n_model, -1), opacity[:, None], log_scales, quats]
    finite = np.all(np.concatenate([np.isfinite(r) for r in rows], axis=1), axis=1)
    n_nonfinite = int((keep & ~finite).sum())
    keep &= finite
    low = opacity < LOW_OPACITY_LOGIT
    n_low = int((keep & low).sum())
    keep &= ~low
    return ExportGaussians(
        means=means[keep], log_scales=log_scales[keep], quats=quats[keep], opacity_logits=opacity[keep],
        sh_dc=sh_dc[keep], sh_rest=sh_rest[keep], sh_degree=int(model.config.sh_degree),
        antialiased=getattr(model.config, "rasterize_mode", "classic") == "antialiased",
        n_model=n_model, n_cropped=n_cropped, n_nonfinite=n_nonfinite, n_low_opacity=n_low,
    )  # fmt: skip
