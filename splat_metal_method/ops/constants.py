"""Constants shared by every backend (and injected into the Metal kernels' common header).

They are gsplat 1.4 / 3DGS values; changing one changes what every backend renders.
"""

TILE_SIZE = 16  # pixels per tile side; one Metal threadgroup renders one tile
ALPHA_MAX = 0.999  # per-gaussian alpha clamp
ALPHA_MIN = 1.0 / 255.0  # gaussians below this alpha at a pixel are skipped
TRANSMITTANCE_MIN = 1e-4  # a pixel stops compositing once T would fall to this (exclusive)
EPS2D = 0.3  # screen-space blur added to every 2D covariance
SH_MAX_DEGREE = 4  # highest spherical-harmonics degree (25 coefficients per channel), as gsplat; ops/metal/sh.h's
# SPLAT_SH_MAX_DEGREE sizes the kernels' basis arrays for it (tests/ops/test_sh_degrees.py checks they agree)
