"""splat-metal: a nerfstudio method for 3D Gaussian Splatting on Apple GPUs (Metal), NVIDIA (gsplat) and CPU."""

from . import legacy_paths
from .patches import checkpoints

checkpoints.allow_nerfstudio_checkpoints()
legacy_paths.install()  # runs saved by earlier layouts name modules that have moved

__version__ = "0.1.0"
