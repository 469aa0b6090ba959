"""SplatMetalModel: splatfacto with its rendering routed through ``splat_metal_method.ops``.

Only what must differ from SplatfactoModel is overridden:
  - populate_modules: splatfacto moves the SH init to ``.cuda()`` and builds LPIPS, which downloads
    AlexNet weights; here the SH init stays on the model's device and LPIPS is skipped (one warning)
    when its weights are not already on disk.
  - get_outputs: splatfacto calls gsplat directly and ``.cuda()`` on the intrinsics; here the
    device-aware op layer renders on whatever device the model lives on.
  - get_image_metrics_and_images: leaves LPIPS out of the metrics when it was skipped.
  - get_loss_dict: the L1 + SSIM main loss as one fused op (ops/loss.py), scale_reg's zero made on the device.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Literal, Optional, Tuple, Type, Union

import torch
import torch.nn.functional as F
from nerfstudio.cameras.cameras import Cameras
from nerfstudio.model_components.lib_bilagrid import total_variation_loss
from nerfstudio.models.splatfacto import RGB2SH, SplatfactoModel, SplatfactoModelConfig
from nerfstudio.utils.misc import step_check
from nerfstudio.utils.rich_utils import CONSOLE

from ..engine import distributed, memory, reliability
from ..export.ply_file import write_ply
from ..ops import IntersectionCapacities, rasterization, resolve_backend
from ..ops.composite import composite_background
from ..ops.constants import SH_MAX_DEGREE
from ..ops.loss import l1_ssim_loss
from ..ops.metal.fused import rasterization_metal
from ..ops.ssim import FusedSSIM
from ..verify import self_check
from ..viewer import opening_view, render_device


def viewmat_from_c2w(camera_to_world: torch.Tensor) -> torch.Tensor:  # [C, 3(4), 4] -> [C, 4, 4]
    """splatfacto's get_viewmat (same values and gradients), built from device ops only: splatfacto's
    flips the y and z axes with a ``torch.tensor`` made on the host (a host-to-device copy every step,
    which waits on MPS) and writes into a zeros matrix. Not compiled: splatfacto's torch.compile wrapper
    ran no faster (CPU: 601 vs 589 us forward+backward), compiled 2.7 s per new mode (also the first
    viewer render) and turned the viewer's render interrupt into an InternalTorchDynamoError."""
    R = camera_to_world[:, :3, :3]  # [C, 3, 3]
    T = camera_to_world[:, :3, 3:4]  # [C, 3, 1]
    R = torch.cat([R[..., :1], -R[..., 1:]], dim=-1)  # flip the y and z axes (gsplat's convention)
    R_inv = R.transpose(1, 2)  # analytic inverse of a rigid transform
    T_inv = -torch.bmm(R_inv, T)
    homogeneous = torch.zeros_like(camera_to_world[:, :1, :4])  # [C, 1, 4]: 0 0 0 1
    homogeneous[..., 3] = 1.0
    return torch.cat([torch.cat([R_inv, T_inv], dim=2), homogeneous], dim=1)


def intrinsics(camera: Cameras, scale: int = 1) -> torch.Tensor:  # [C, 3, 3] on the camera's device
    """``camera.get_intrinsics_matrices()`` of the camera rescaled by ``1 / scale`` (same values), built
    where the camera lives. nerfstudio's builds K on the host and copies fx, fy, cx, cy into it: four
    device-to-host reads, each waiting for the GPU, and then a copy back."""
    fx, fy, cx, cy = camera.fx, camera.fy, camera.cx, camera.cy  # [C, 1]
    if scale != 1:
        fx, fy, cx, cy = fx * (1 / scale), fy * (1 / scale), cx * (1 / scale), cy * (1 / scale)
    zero, one = torch.zeros_like(fx), torch.ones_like(fx)
    return torch.cat([fx, zero, cx, zero, fy, cy, zero, zero, one], dim=-1).view(-1, 3, 3)


class BilateralGridUnavailable(SystemExit):
    """--pipeline.model.use-bilateral-grid on a device whose torch lacks grid_sample on 5-D tensors. A
    SystemExit, so that ns-train prints only the message and exits with status 1."""


@functools.lru_cache(maxsize=None)
def _grid_sample_5d_missing(device: str) -> Optional[str]:
    """None where ``F.grid_sample`` runs on 5-D tensors (forward and backward) on ``device``, else torch's
    NotImplementedError. A probe as nerfstudio's BilateralGrid calls it, on a 2x2x2 grid; once per device."""
    try:
        grid = torch.zeros(1, 12, 2, 2, 2, device=device, requires_grad=True)  # [N, 12, L, H, W]
        xyz = torch.zeros(1, 1, 2, 3, 3, device=device)  # [N, m, h, w, 3]
        F.grid_sample(grid, xyz, mode="bilinear", align_corners=True, padding_mode="border").sum().backward()
    except NotImplementedError as e:
        first_sentence = str(e).strip().split(". ")[0].strip()
        return first_sentence.splitlines()[0] if first_sentence else type(e).__name__
    return None


def check_bilateral_grid(config: "SplatMetalModelConfig", device: Union[str, torch.device]) -> None:
    """Refuses (BilateralGridUnavailable, one line) the bilateral grid where torch cannot slice it: splatfacto's
    BilateralGrid runs grid_sample on 5-D tensors, which MPS got only in recent torch releases
    (pytorch#160541). Checked before ns-train writes anything (configs.py) and before the first step."""
    if not config.use_bilateral_grid:
        return
    device = str(torch.device(device))
    missing = _grid_sample_5d_missing(device)
    if missing is not None:
        raise BilateralGridUnavailable(
            f"splat-metal: --pipeline.model.use-bilateral-grid needs grid_sample on 5-D tensors, which torch "
            f"{torch.__version__} does not have on {device} ({missing}); train without it "
            "(--pipeline.model.use-bilateral-grid False) or with a newer torch (pytorch#160541)"
        )


# torchvision's AlexNet weights, which torchmetrics' LPIPS loads at construction.
ALEXNET_WEIGHTS = "alexnet-owt-7be5be79.pth"


def lpips_weights_available() -> bool:
    return (Path(torch.hub.get_dir()) / "checkpoints" / ALEXNET_WEIGHTS).is_file()


@contextlib.contextmanager
def _lpips_only_if_local():
    """While splatfacto builds its metrics, replace LPIPS by None unless its weights are on disk.

    Training must never touch the network, and LPIPS with a random backbone would be a lie."""
    import torchmetrics.image.lpip as lpip_module

    if lpips_weights_available():
        yield
        return
    warnings.warn(
        f"LPIPS skipped: torchvision AlexNet weights ({ALEXNET_WEIGHTS}) are not in {torch.hub.get_dir()}/checkpoints; "
        "psnr and ssim are still reported. Download them once to enable LPIPS.",
        stacklevel=3,
    )
    original = lpip_module.LearnedPerceptualImagePatchSimilarity
    lpip_module.LearnedPerceptualImagePatchSimilarity = lambda *args, **kwargs: None
    try:
        yield
    finally:
        lpip_module.LearnedPerceptualImagePatchSimilarity = original


@dataclass
class SplatMetalModelConfig(SplatfactoModelConfig):
    """Splatfacto rendered by splat-metal's device-aware op layer (Metal on Apple GPUs, gsplat on
    NVIDIA, PyTorch on CPU)."""

    _target: Type = field(default_factory=lambda: SplatMetalModel)
    backend: Literal["auto", "reference", "gsplat", "metal", "cpu"] = "auto"
    """Op-layer backend. "auto" picks by device (mps -> metal, cuda -> gsplat, cpu -> cpu, i.e. native
    rasterization, or reference where no C++ compiler can build it);
    the SPLAT_METAL_BACKEND environment variable overrides "auto"."""
    # Memory management (splat_metal_method/engine/memory.py); what is in effect is printed when training starts.
    max_gaussians: int = -1
    """Densification adds no gaussians beyond this count (pruning still runs). -1: derived from the
    device's memory; 0: no cap."""
    max_intersections: int = -1
    """Tile intersections one render may allocate; above it the view is rasterized in depth chunks with
    the same result (not for backend gsplat). -1: derived from the device's memory; 0: no budget."""
    empty_cache_after_refine: bool = True
    """Release cached device memory after every densify/prune and opacity-reset step."""
    empty_cache_after_eval: bool = True
    """Release cached device memory after eval passes."""
    empty_cache_every: int = 0
    """Also release cached device memory every this many steps (0: off)."""
    memory_log_every: int = 100
    """Write memory scalars (Memory/...) to tensorboard/wandb/comet every this many steps (0: off)."""
    metal_self_check: Union[bool, Literal["fallback", "strict"]] = True
    """Before training or rendering with the Metal kernels (on MPS, or CPU tensors under the emulator), check
    the stages this run uses against the PyTorch reference on this GPU; the verdict is cached per machine
    (splat_metal_method/verify/self_check.py). True ("fallback"): a stage that fails runs on the reference on the
    same device, the others on Metal, and the run says so in one line. "strict": stop on a mismatch.
    False skips the check."""
    nonfinite: Literal["recover", "stop"] = "recover"
    """When a gaussian parameter or gradient becomes NaN/Inf (checked after every step, reported with the
    step and parameter): "recover" drops the affected gaussians and continues; "stop" ends training
    before that step is saved, keeping the last good checkpoint (splat_metal_method/engine/reliability.py)."""
    visible_adam: bool = False
    """Adam over the gaussians visible in the step's render only (gsplat's simple_trainer option of this name, its
    SelectiveAdam): a gaussian culled in it (radius 0) keeps its parameters and both Adam moments, where torch's
    Adam would step it with a zero gradient (its moments decay and momentum still moves it). Off: torch's Adam.
    Measured quality: docs/training.md."""
    stats_after_refine_stop: bool = False
    """Keep computing the image-plane statistics of densification (means2d.absgrad in the rasterizer's backward,
    gsplat's retained means2d gradient) after the strategy stops reading them. Off (the default): gsplat's
    DefaultStrategy reads them only while step < refine_stop_iter (--pipeline.model.stop-split-at), so from that
    step on a training step computes neither (2 of the rasterizer backward's 11 atomics per gaussian and
    simdgroup, its [C, N, 2] buffer); the parameters are the same bits either way (benchmarks/step_model/README.md)."""
    bwd_tile_merge: bool = False
    """Metal backend: the rasterizer's backward sums a gaussian's gradients over its tile before its device atomics
    (fewer atomics, smaller batches); off until a Mac measures it (splat-metal-bench --vs tile-merge)."""
    min_train_size: int = 128
    """Training never renders an image smaller than this many pixels on its longer side: splatfacto's
    resolution schedule (num_downscales) is clamped for small images (said once at start); 0: no
    minimum. Why: gsplat's radii are at least 2 px and its screen-size rule splits every gaussian wider
    than split_screen_size (0.05) of the image, so at 24x16 every gaussian split at every refine."""


def check_sh_degree(degree: int) -> None:
    """--pipeline.model.sh-degree is gsplat's and every backend's 0..4; ns-train checks it before it writes
    anything (configs.py), the model again when it is built."""
    if not 0 <= degree <= SH_MAX_DEGREE:
        raise SystemExit(
            f"splat-metal: --pipeline.model.sh-degree must be 0..{SH_MAX_DEGREE} (gsplat's range: up to "
            f"{(SH_MAX_DEGREE + 1) ** 2} SH coefficients per colour channel), got {degree}"
        )


def max_downscale(width: int, height: int, min_size: int) -> int:
    """The largest power-of-two downscale keeping the image's longer side >= ``min_size`` pixels (1 for
    an image already smaller; no limit for 0). nerfstudio truncates a downscaled size like ``//``."""
    if min_size <= 0:
        return 1 << 30
    factor = 1
    while max(width, height) // (2 * factor) >= min_size:
        factor *= 2
    return factor


def _check_render_size(render: torch.Tensor, image: torch.Tensor) -> None:  # [H, W, 3] each
    """One clear line where a training render and its image differ in size (shapes are host metadata: no
    device read), instead of torch's broadcasting error deep in the loss."""
    if render.shape[:2] != image.shape[:2]:
        raise RuntimeError(
            f"splat-metal: the render is {render.shape[1]}x{render.shape[0]} but its training image is "
            f"{image.shape[1]}x{image.shape[0]}: the camera handed to the model does not have its image's size "
            "(a datamanager that undistorts, crops or resizes images must rewrite the cameras to match)"
        )


class SplatMetalModel(SplatfactoModel):
    config: SplatMetalModelConfig
    _downscale_limit: int = 1 << 30  # max_downscale of the current training camera (get_outputs)
    _train_sizes: Dict[int, tuple]  # cam_idx -> (camera.width, camera.height, (width, height)) (_train_camera_size)
    _camera_matrices: Dict[int, tuple]  # cam_idx -> viewmat and K of a training camera (_train_camera_matrices)
    gathered_params = None  # distributed runs, rank 0: every shard's gaussians, for the viewer and eval

    def populate_modules(self):
        check_sh_degree(self.config.sh_degree)
        seed_colors = None
        if self.seed_points is not None and not self.config.random_init and self.seed_points[1].shape[0] > 0:
            # Hide the colours from splatfacto (its colour init calls .cuda()) and apply them below.
            seed_colors = self.seed_points[1]
            self.seed_points = (self.seed_points[0], seed_colors[:0])
        with _lpips_only_if_local():
            super().populate_modules()
        if seed_colors is not None:
            self.seed_points = (self.seed_points[0], seed_colors)
            rgb = seed_colors.float() / 255
            with torch.no_grad():
                if self.config.sh_degree > 0:  # same init as splatfacto
                    self.features_dc.copy_(RGB2SH(rgb))
                else:
                    self.features_dc.copy_(torch.logit(rgb, eps=1e-10))
                self.features_rest.zero_()
        self.ssim = FusedSSIM(data_range=1.0, channel=3)  # splatfacto's SSIM in fewer device ops (ssim.py)
        self._train_sizes = {}
        self._camera_matrices = {}
        self.isect_capacities = IntersectionCapacities()  # of the training steps' padded lists (ops/metal/isect.py)
        self.memory = memory.setup_model_memory(self)  # caps self.strategy; hooks via get_training_callbacks
        reliability.install_atomic_ply_export(write_ply)  # in ns-export only: same bytes, fast, then renamed
        self.opening_view = opening_view.OpeningView()  # the viewer finds it: browsers open on a training camera

    def load_state_dict(self, dict, **kwargs):  # type: ignore[override]
        """Resizes the gaussians to the checkpoint's count IN PLACE, then loads.

        nerfstudio builds the optimizers before loading a checkpoint; splatfacto's load_state_dict
        replaces each parameter by a new object, so after `--load-dir` the optimizers would keep
        stepping the old tensors (and densification would crash: nerfstudio#3554)."""
        self.step = 30000  # as splatfacto: a loaded model renders with every SH degree
        if "means" in dict:  # old checkpoint names, as splatfacto accepts them
            for name in ["means", "scales", "quats", "features_dc", "features_rest", "opacities"]:
                dict[f"gauss_params.{name}"] = dict[name]
        n = dict["gauss_params.means"].shape[0]
        for param in self.gauss_params.values():
            param.data = torch.zeros((n, *param.shape[1:]), device=param.device, dtype=param.dtype)
        return torch.nn.Module.load_state_dict(self, dict, **kwargs)

    def _get_downscale_factor(self):
        """splatfacto's resolution schedule, never below min_train_size."""
        return min(super()._get_downscale_factor(), self._downscale_limit)

    def _note_min_train_size(self, cameras: Cameras) -> None:
        """Says once, at the first training step, when min_train_size clamps the resolution schedule."""
        W, H = int(cameras.width.max()), int(cameras.height.max())
        start, limit = 2**self.config.num_downscales, max_downscale(W, H, self.config.min_train_size)
        if start > limit:
            CONSOLE.print(
                f"splat-metal: training starts at {W // limit}x{H // limit}, not {W // start}x{H // start} "
                f"(num_downscales {self.config.num_downscales} of {W}x{H}): images are not downscaled below "
                f"{self.config.min_train_size} px (--pipeline.model.min-train-size; 0 allows it).",
                highlight=False,
                soft_wrap=True,
            )

    def get_training_callbacks(self, training_callback_attributes):
        pipeline = training_callback_attributes.pipeline
        cameras = getattr(getattr(getattr(pipeline, "datamanager", None), "train_dataset", None), "cameras", None)
        if cameras is not None and len(cameras.shape) == 1 and cameras.width.device.type == "cpu":
            # Kept, not read: the datamanager undistorts (and crops) the images and rewrites these cameras'
            # sizes only when it first hands out a batch (docs/design.md section 3.3); _train_camera_size reads them then.
            self.__dict__["_host_train_cameras"] = cameras
        check_bilateral_grid(self.config, self.device)
        self_check.ensure_verified(self, self.device, self.config.backend)  # before the first step
        # The NaN/Inf check goes last: after the strategy's densification and the memory hooks.
        trainer = getattr(training_callback_attributes, "trainer", None)
        if trainer is not None:  # the steps whose train metrics and loss dict nerfstudio writes out
            self.__dict__["_steps_per_log"] = trainer.config.logging.steps_per_log
        optimizers = training_callback_attributes.optimizers
        self.nonfinite_guard = reliability.NonFiniteGuard(
            self, optimizers.optimizers, self.config.nonfinite, fused_from=optimizers
        )
        return (
            super().get_training_callbacks(training_callback_attributes)
            + self.memory.training_callbacks(training_callback_attributes)
            + self.nonfinite_guard.training_callbacks()
        )

    def _train_camera_size(self, camera: Cameras) -> Tuple[int, int]:
        """(width, height) of a training camera at full resolution, as ints, without reading the device.

        Read from the training dataset's host cameras (kept by get_training_callbacks) when the camera of
        image "cam_idx" (which the datamanager sets) is first seen, or is a new object: by the time the
        datamanager hands out a camera it has undistorted that image and rewritten the dataset camera's
        size (nerfstudio crops an undistorted image to its valid area: 96 px wide may become 95), so the
        sizes are the undistorted ones whether the images were all cached up front or are loaded on
        demand. Cached per camera object (the datamanager hands out one per image), so steady steps read
        nothing. Without host cameras or an index, the camera's own size is read (a device read on a GPU)."""
        idx = (camera.metadata or {}).get("cam_idx")
        idx = idx if isinstance(idx, int) else None
        entry = self._train_sizes.get(idx) if idx is not None else None
        if entry is not None and entry[0] is camera.width and entry[1] is camera.height:
            return entry[2]
        host = self.__dict__.get("_host_train_cameras")
        if host is not None and idx is not None and idx < host.shape[0]:
            # The first training step: every image this datamanager undistorts up front is done.
            if not self._train_sizes:
                self._note_min_train_size(host)
            size = (int(host.width[idx, 0]), int(host.height[idx, 0]))
        else:
            size = (int(camera.width.max()), int(camera.height.max()))
        if idx is not None:
            self._train_sizes[idx] = (camera.width, camera.height, size)
        return size

    def _train_camera_matrices(self, camera: Cameras, camera_to_world: torch.Tensor, scale: int, device):
        """viewmat_from_c2w(camera_to_world) and intrinsics(camera, scale) on ``device``, made once per
        training camera and scale (16 + 4 aten ops a step otherwise) and reused while their inputs are
        the same tensors, unchanged (version counters), needing no gradient: SplatMetalDatamanager hands
        out one Cameras per image, and with the camera optimizer off apply_to_camera returns its
        camera_to_worlds. With the camera optimizer on (a new camera_to_world with a gradient every step),
        or a camera without "cam_idx", they are built every step."""
        inputs = (camera_to_world, camera.fx, camera.fy, camera.cx, camera.cy)
        idx = (camera.metadata or {}).get("cam_idx")
        cached = self._camera_matrices.get(idx) if isinstance(idx, int) else None
        if cached is not None and cached[0] == (scale, device):
            if all(t is c and t._version == v for t, (c, v) in zip(inputs, cached[1])):
                return cached[2], cached[3]
        viewmat, K = viewmat_from_c2w(camera_to_world), intrinsics(camera, scale).to(device)
        if isinstance(idx, int) and not camera_to_world.requires_grad:
            self._camera_matrices[idx] = ((scale, device), [(t, t._version) for t in inputs], viewmat, K)
        return viewmat, K

    def strategy_reads_stats(self, step: int) -> bool:
        """Whether the densification strategy reads training step ``step``'s image-plane statistics (means2d's
        absgrad or retained gradient, the radii it accumulates into grad2d / count / radii). gsplat 1.4's
        DefaultStrategy (our BudgetedStrategy) reads them in step_post_backward while ``step < refine_stop_iter``
        and returns at once from then on: get_outputs then asks for no absgrad and skips step_pre_backward (which
        retains means2d's gradient). Any other strategy (MCMC: absgrad off, no statistics) is asked as before;
        stats_after_refine_stop keeps them every step. ``step`` is the model's, set by step_cb before each
        training iteration (also the first one of a resumed run)."""
        from gsplat.strategy import DefaultStrategy

        if self.config.stats_after_refine_stop or not isinstance(self.strategy, DefaultStrategy):
            return True
        return step < self.strategy.refine_stop_iter

    def get_outputs(self, camera: Cameras) -> Dict[str, Union[torch.Tensor, List]]:
        if not isinstance(camera, Cameras):
            raise TypeError(f"SplatMetalModel.get_outputs needs a Cameras object, got {type(camera).__name__}")
        if self.training:
            assert camera.shape[0] == 1, "Only one camera at a time"
            camera_to_world = self.camera_optimizer.apply_to_camera(camera)
        else:
            camera_to_world = camera.camera_to_worlds

        # The model's own parameters and backend, or a device copy when get_outputs_for_camera renders
        # elsewhere (render_device.py: ns-viewer on a Mac keeps the model on cpu and renders with Metal).
        params, backend = render_device.render_source(self)
        device = params["means"].device
        self_check.ensure_verified(self, device, backend, "training" if self.training else "rendering")
        if self.crop_box is not None and not self.training:
            crop_ids = self.crop_box.within(params["means"].to(self.device)).squeeze().to(device)
            if crop_ids.sum() == 0:
                return self.get_empty_outputs(
                    int(camera.width.item()), int(camera.height.item()), self.background_color
                )
            params = {k: v[crop_ids] for k, v in params.items()}
        # Parameters as stored: activated below (inside the metal backend's kernels, about 15 aten ops a step fewer).
        colors, colors_rest = params["features_dc"], params["features_rest"]  # [N, 3], [N, K-1, 3]

        if self.training:
            # Sizes as Python ints, noted from the dataset's host cameras before training: a read of
            # camera.width (a device tensor) would wait for the GPU's queue to drain.
            width, height = self._train_camera_size(camera)
            self._downscale_limit = max_downscale(width, height, self.config.min_train_size)
            scale = self._get_downscale_factor()
            viewmat, K = self._train_camera_matrices(camera, camera_to_world, scale, device)  # [1, 4, 4], [1, 3, 3]
            W, H = width // scale, height // scale  # as rescale_output_resolution(1 / scale): scale is a power of 2
        else:
            viewmat = viewmat_from_c2w(camera_to_world)  # [1, 4, 4]
            scale = self._get_downscale_factor()
            camera.rescale_output_resolution(1 / scale)
            K = camera.get_intrinsics_matrices().to(device)  # [1, 3, 3]
            W, H = int(camera.width.item()), int(camera.height.item())
            camera.rescale_output_resolution(scale)
        self.last_size = (H, W)

        render_mode = "RGB+ED" if (self.config.output_depth_during_training or not self.training) else "RGB"
        raw = {"scales_are_log": True, "opacities_are_logits": True, "colors_rest": colors_rest}
        scales, opacities = params["scales"], params["opacities"]
        if self.config.sh_degree > 0:
            sh_degree = min(self.step // self.config.sh_degree_interval, self.config.sh_degree)
        else:
            colors = torch.cat((colors[:, None, :], colors_rest), dim=1)  # [N, K, 3]
            colors, sh_degree, raw["colors_rest"] = torch.sigmoid(colors).squeeze(1), None, None  # [N, 3]

        # clamp(color + (1 - alpha) * background, 0, 1), splatfacto's composite: inside the rasterizer's kernels
        # on the metal backend (rasterization_metal's composite_background), ops/composite.py's op otherwise.
        background = self._get_background_color().to(device)
        bilateral = self.config.use_bilateral_grid and self.training  # it takes rgb [1, H, W, 3]
        # The metal backend takes the parameters as stored (exp, sigmoid and the SH bands' concatenation in its
        # kernels), its padded intersection lists (no host read) and the composite (ops/metal/fused.py); the others
        # (and a distributed training step, which renders this rank's camera from every rank's shard:
        # ops/distributed.py) take them activated, as splatfacto passes them to gsplat.
        rasterize, options = rasterization, {"packed": False, "backend": backend}
        if self.training and distributed.active():
            from ..ops.distributed import distributed_rasterization as rasterize

            # gsplat's distributed path (CUDA) refuses absgrad: a run that reads it until refine stop stays on ours
            options["absgrad_in_run"] = self.strategy.absgrad
        elif resolve_backend(backend, device) == "metal":
            rasterize = rasterization_metal
            options = {**raw, "composite_background": background, "composite_squeeze": not bilateral,
                       "tile_merge": self.config.bwd_tile_merge}  # fmt: skip
            if self.training:
                options["isect_capacity"] = self.isect_capacities
        if rasterize is not rasterization_metal:
            if raw["colors_rest"] is not None:
                colors = torch.cat((colors[:, None, :], colors_rest), dim=1)  # [N, K, 3]
            scales, opacities = torch.exp(scales), torch.sigmoid(opacities).squeeze(-1)
        # absgrad only where a backward follows and the strategy reads it (not from refine_stop_iter on)
        stats = self.training and self.strategy_reads_stats(self.step)
        render, alpha, self.info = rasterize(
            means=params["means"],
            quats=params["quats"],
            scales=scales,
            opacities=opacities,
            colors=colors,
            viewmats=viewmat,
            Ks=K,
            width=W,
            height=H,
            near_plane=0.01,
            far_plane=1e10,
            render_mode=render_mode,
            sh_degree=sh_degree,
            absgrad=self.strategy.absgrad and stats,
            rasterize_mode=self.config.rasterize_mode,
            max_intersections=self.memory.render_budget(self.training),
            **options,
        )
        self.memory.note_render(self.training, self.info)
        if stats:  # DefaultStrategy's retains means2d's gradient for its statistics (without absgrad)
            self.strategy.step_pre_backward(
                self.gauss_params, self.optimizers, self.strategy_state, self.step, self.info
            )

        rgb = self.info.pop("rgb", None)  # [H, W, 3] unless bilateral
        if rgb is None:  # a render whose rasterizer did not composite (rasterization_metal's composite_background)
            rgb = composite_background(render, alpha, background, backend, squeeze=not bilateral)
        if bilateral:
            if camera.metadata is not None and "cam_idx" in camera.metadata:
                rgb = self._apply_bilateral_grid(rgb, camera.metadata["cam_idx"], H, W)
            rgb = rgb.squeeze(0)
        depth = None
        if render_mode == "RGB+ED":
            depth = render[..., 3:4]
            depth = torch.where(alpha > 0, depth, depth.detach().max()).squeeze(0)
        if background.shape[0] == 3 and not self.training:
            background = background.expand(H, W, 3)
        return {"rgb": rgb, "depth": depth, "accumulation": alpha.squeeze(0), "background": background}

    def get_gt_img(self, image: torch.Tensor):
        """splatfacto's, converted once per batch image (splatfacto converts the same uint8 image in
        get_metrics_dict and again in get_loss_dict) and in one division."""
        cached = getattr(self, "_gt_img_cache", None)
        if cached is not None and cached[0] is image and cached[1] == self._get_downscale_factor():
            return cached[2]
        # splatfacto's image.float() / 255.0 in one aten dispatch, not two (a copy, then a division): the same bits
        gt_img = super().get_gt_img(torch.div(image, 255.0) if image.dtype == torch.uint8 else image)
        self._gt_img_cache = (image, self._get_downscale_factor(), gt_img)
        return gt_img

    def _logged_now(self) -> bool:
        """Whether nerfstudio's trainer writes this training step's loss and metrics dicts out (its
        ``step_check(step, steps_per_log, run_at_zero=True)``); True where no trainer set it up (a caller of
        the pipeline reads the dicts itself)."""
        steps_per_log = self.__dict__.get("_steps_per_log")
        return steps_per_log is None or step_check(self.step, steps_per_log, run_at_zero=True)

    def get_metrics_dict(self, outputs, batch) -> Dict[str, torch.Tensor]:
        """splatfacto's; a training step's PSNR as -10 log10(MSE) (3 ops: mse_loss, log10, mul) instead of
        torchmetrics' stateful metric (about 25 ops and copies of its state every step), and only on the steps
        the trainer writes out (steps_per_log): nothing reads it on the others. Eval metrics are splatfacto's."""
        if self.training:
            _check_render_size(outputs["rgb"], self.get_gt_img(batch["image"]))
        if not self.training or self.config.color_corrected_metrics:
            return super().get_metrics_dict(outputs, batch)
        metrics = {}
        if self._logged_now():
            gt_rgb = self.composite_with_background(self.get_gt_img(batch["image"]), outputs["background"])
            with torch.no_grad():
                metrics["psnr"] = -10.0 * torch.log10(torch.nn.functional.mse_loss(outputs["rgb"], gt_rgb))
        metrics["gaussian_count"] = self.num_points
        self.camera_optimizer.get_metrics_dict(metrics)
        return metrics

    def render_only_groups(self) -> Tuple[str, ...]:
        """The gaussian parameter groups whose gradient, in this configuration, comes from the render alone
        (engine/optimizers.py then lets their Adam step happen inside the projection's backward): not the
        scales where scale regularisation adds a loss term on them."""
        groups = ("means", "quats", "scales", "opacities", "features_dc", "features_rest")
        return tuple(g for g in groups if not (g == "scales" and self.config.use_scale_regularization))

    def get_loss_dict(self, outputs, batch, metrics_dict=None) -> Dict[str, torch.Tensor]:
        """splatfacto's (same keys and values), with two differences: main_loss is ops/loss.py's l1_ssim_loss
        (on the metal backend one fused kernel pair instead of ~25 torch ops and their backward), and the
        zero scale_reg is made on the device (splatfacto copies a host zero there: a host sync on a Mac)."""
        gt_img = self.composite_with_background(self.get_gt_img(batch["image"]), outputs["background"])
        pred_img = outputs["rgb"]  # [H, W, 3]
        _check_render_size(pred_img, gt_img)
        if "mask" in batch:  # as splatfacto: masked pixels black in both images
            mask = self._downscale_if_required(batch["mask"]).to(self.device)  # [H, W, 1]
            assert mask.shape[:2] == gt_img.shape[:2] == pred_img.shape[:2]
            gt_img, pred_img = gt_img * mask, pred_img * mask
        main_loss, _, _ = l1_ssim_loss(pred_img, gt_img, self.config.ssim_lambda, self.config.backend, stats=False)
        if self.config.use_scale_regularization and self.step % 10 == 0:  # splatfacto's formula
            scale_exp = torch.exp(self.scales)
            ratio = scale_exp.amax(dim=-1) / scale_exp.amin(dim=-1)
            max_ratio = self.config.max_gauss_ratio
            scale_reg = 0.1 * (torch.maximum(ratio, torch.tensor(max_ratio)) - max_ratio).mean()
        else:  # one device zero, made once (not an aten op per step); the loss sum never writes into it
            scale_reg = self.__dict__.get("_zero_scale_reg")
            if scale_reg is None or scale_reg.device != torch.device(self.device):
                scale_reg = self.__dict__["_zero_scale_reg"] = torch.zeros((), device=self.device)
        loss_dict = {"main_loss": main_loss}
        if scale_reg.requires_grad or self._logged_now():  # the constant zero only where it is written out
            loss_dict["scale_reg"] = scale_reg  # (the trainer sums the dict: one add a step for a zero)
        if self.training:
            self.camera_optimizer.get_loss_dict(loss_dict)
            if self.config.use_bilateral_grid:
                loss_dict["tv_loss"] = 10 * total_variation_loss(self.bil_grids.grids)
        return loss_dict

    @torch.no_grad()
    def get_outputs_for_camera(self, camera: Cameras, obb_box=None) -> Dict[str, torch.Tensor]:
        """Viewer, ns-render, ns-eval: renders on the best device (render_device.py), outputs on self.device."""
        return render_device.render_for_camera(self, camera, obb_box, super().get_outputs_for_camera)

    def get_image_metrics_and_images(self, outputs, batch):
        if self.lpips is not None:
            return super().get_image_metrics_and_images(outputs, batch)
        self.lpips = lambda *args: torch.tensor(float("nan"))  # skipped: see _lpips_only_if_local
        try:
            metrics, images = super().get_image_metrics_and_images(outputs, batch)
        finally:
            self.lpips = None
        return {k: v for k, v in metrics.items() if "lpips" not in k}, images
