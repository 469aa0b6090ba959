"""nerfstudio checkpoints under torch's weights_only default.

nerfstudio 1.1.5 saves optimizer/scheduler state holding numpy scalars and loads checkpoints with a
plain ``torch.load`` (ns-export, ns-viewer, ns-render, ns-eval, --load-dir resume). Since torch 2.6
that load is weights_only and rejects the numpy types. Importing this package (nerfstudio imports it
when it reads a splat-metal config.yml or lists methods) allow-lists exactly those numpy types, which
are plain data, instead of turning weights_only off.
"""

from __future__ import annotations

import numpy as np
import torch


def numpy_checkpoint_globals() -> list:
    """The numpy types that appear in nerfstudio checkpoints (scalars and their dtypes)."""
    try:
        from numpy.core.multiarray import scalar  # numpy < 2 pickles this name
    except ImportError:  # pragma: no cover - numpy >= 2
        from numpy._core.multiarray import scalar
    dtypes = [type(np.dtype(t)) for t in (np.float64, np.float32, np.int64, np.int32, np.bool_)]
    return [scalar, np.dtype, *dtypes]


def allow_nerfstudio_checkpoints() -> None:
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals(numpy_checkpoint_globals())
