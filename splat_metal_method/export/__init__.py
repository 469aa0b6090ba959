"""Export a trained run as the files splat viewers and apps load (``splat-metal-export``).

- ``gaussians``: the gaussians ``ns-export gaussian-splat`` writes (same selection, same values),
  taken once from the loaded model and shared by every format.
- ``splat_file``: antimatter15's ``.splat`` (32 bytes per gaussian, no view-dependent colour).
- ``spz_file``: Niantic's ``.spz`` version 3 (gzip, quantised, keeps SH).
- ``cli``: the tyro command; ``.ply`` bytes come from nerfstudio's own writer.
"""
