"""Export a trained run as the files splat viewers and apps load (``splat-metal-export``).

- ``run_config``: what the export needs of a run's config.yml, read without importing the run's
  classes (splatfacto-family runs; anything else takes nerfstudio's full load).
- ``checkpoint``: the run's gaussians read from the checkpoint ``ns-export`` loads, without
  building its pipeline.
- ``gaussians``: the gaussians ``ns-export gaussian-splat`` writes (same selection, same values),
  taken once from the loaded model and shared by every format.
- ``splat_file``: antimatter15's ``.splat`` (32 bytes per gaussian, no view-dependent colour).
- ``spz_file``: Niantic's ``.spz`` version 3 (gzip, quantised, keeps SH).
- ``sog_file``: PlayCanvas's ``.sog`` (SuperSplat's format: WebP images, codebooks, SH palette).
- ``compressed_ply_file``: PlayCanvas's ``.compressed.ply`` (chunks of 256, packed fields, 8-bit SH).
- ``gltf_file``: binary glTF 2.0 ``.glb`` with ``KHR_gaussian_splatting`` (float32, in glTF's y-up axes).
- ``ply_file``: the .ply bytes of nerfstudio's ``write_ply``, a block of rows at a time (also what
  ``ns-export gaussian-splat`` writes with, through engine/reliability.py's patch).
- ``quantize``: Morton order, 256-entry 1-D codebooks and the k-means SH palette they share (exact,
  or a two-level codebook beyond 2^29 distances per iteration).
- ``progress``: the rich progress bars of the command (shown once the writes take a while).
- ``installed``: nerfstudio's version and splat-metal's entry points, read from their .dist-info.
- ``playcanvas``: writes either PlayCanvas format for the command.
- ``cli``: the tyro command.
"""
