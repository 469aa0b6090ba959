"""splat-metal: a nerfstudio method for 3D Gaussian Splatting on Apple GPUs (Metal), NVIDIA (gsplat) and CPU."""

from . import checkpoints

checkpoints.allow_nerfstudio_checkpoints()

__version__ = "0.1.0"
