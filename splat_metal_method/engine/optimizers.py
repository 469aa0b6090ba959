"""The optimizer step of a Metal run: Adam over every gaussian parameter tensor in one kernel pass.

nerfstudio keeps one torch Adam per parameter group and steps them one by one (``Optimizers``); torch's
fused Adam then issues two dispatches per group (the step counter's ``_foreach_add_`` and
``_fused_adam_``), and the NaN guard reads every parameter and gradient once more. ``GaussianOptimizers``
steps the gaussians' groups (means, scales, quats, opacities, features_dc, features_rest) together with
ops/metal/adam.py's kernels where the model renders with the metal backend: the same math on torch's own
state (``exp_avg``, ``exp_avg_sq``, a float32 device ``step`` per parameter, as torch's fused Adam keeps
them), learning rates, betas and eps read from each optimizer's ``param_groups`` every step (so the
schedulers work), the optimizers' step post-hooks run. The gaussians' moments are views of two allocations,
the moment arenas the kernels bind (ops/metal/adam.py ``pack_moments``), re-packed at a fused step where a
densification, a prune, a load or a first step left them apart (``_pack_moments``: metadata only, so a steady
step copies nothing). Checkpoints, resumes, gsplat's densification
(which slices that state), the viewer and ns-export see what torch's Adam leaves.

torch's optimizer steps a group instead (the rest of the step is the same) where the fused pass would
not do what it does:
  * the camera optimizer, the bilateral grid and any group that is not a gaussian parameter: not rows of
    the gaussians (and the camera optimizer's gradient is what its own Adam reads);
  * gradient clipping (``max_norm``) or an enabled GradScaler: they read and rescale ``.grad`` first;
  * a distributed run: its sharded step is verified against torch's optimizer (engine/distributed.py);
  * the fused Adam failed this GPU's Metal self-check (verify/self_check.py, stage "adam");
  * anything torch's Adam would compute differently from the kernel: amsgrad, weight decay, maximize, a
    non-fused state (a CPU step counter), a tensor learning rate, step pre-hooks, betas that differ
    between the groups, or tensors the kernel cannot take (adam.check).

The SH coefficients (features_dc, features_rest) take their Adam step earlier still, inside the projection's
backward (ops/metal/prepare.py, project_bwd.metal PROJECT_SH_ADAM): their gradients never go to memory.
``zero_grad_some`` arms that step (ops/metal/adam.ShStep) for the backward that follows; the backward takes it
where it renders one camera with splatfacto's bands apart and the armed tensors are the ones it differentiates;
the optimizer step then skips the groups it took (their ``.grad`` stays None) and steps them as above where it
was not taken (no double step, no missed step). It is armed only where it cannot differ from the step after
the backward: the previous step was fused with no GradScaler (the scaler is known only at a step), both groups
were zeroed and stepped in it and are zeroed now (nerfstudio's gradient accumulation zeroes and steps a group
in different iterations: never armed), and _why_not_fused accepts them (so no clipping, distributed run or
pre-hooks: what needs ``.grad`` keeps it). ``log_gradients`` then has no gradient norm for those groups.

Under the same rules means, quats, scales and opacities take theirs in that kernel too (project_bwd.metal
PROJECT_ADAM_*: no gradient tensor is allocated for them, the means' from the projection's and the SH
directions' gradients in registers), where the model's ``render_only_groups()`` names them (the groups only the
render differentiates: splatfacto's scale regularisation keeps the scales out, MCMC's regularisers the opacities
and scales, which then step after the backward as above) and the last step stepped them fused; ``fuse_params``
False keeps them after the backward (the twin tests compare with).

The model's ``visible_adam`` (off by default) makes every path a masked Adam step, gsplat's SelectiveAdam: a gaussian
culled in this step's render (radius 0 in every camera, ``model.info["radii"]``) keeps its parameters and both
moments, a visible one steps as above (step counters and bias corrections per tensor, as torch's). Inside the
backward project_bwd.metal PROJECT_ADAM_VISIBLE skips the culled ones' update; after it adam_step reads the radii;
torch's optimizers step and the culled rows get back what they held (``_keep_culled``).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from nerfstudio.engine.optimizers import Optimizers
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from ..ops import stage_fallback
from . import distributed


def renders_with_metal(model, device: torch.device) -> bool:
    """Whether ``model`` renders with the metal backend's kernels for tensors on ``device`` (then they run
    where its tensors are: on MPS, or under the emulator on CPU)."""
    backend = getattr(getattr(model, "config", None), "backend", None)
    if backend is None or torch.device(device).type not in ("mps", "cpu"):
        return False
    from ..ops import BackendUnavailable, resolve_backend

    try:
        return resolve_backend(backend, torch.device(device)) == "metal"
    except BackendUnavailable:  # an unusable backend fails the render itself, with its message
        return False


@dataclass
class FusedStep:
    """What the last fused step checked for the NaN guard: its flag (0, or NaN where a gradient or an
    updated parameter was not finite) and, per tensor, the version it had right after the step."""

    flag: torch.Tensor  # [1] float32, reused by the next step
    # id -> (weak reference, _version after the step) of each parameter and gradient it stepped; weak, so a
    # densification's replaced tensors are freed at once
    checked: Dict[int, Tuple[weakref.ref, int]]

    def covers(self, tensors: Sequence[torch.Tensor]) -> List[bool]:
        """Per tensor: whether the flag already judged it as it is now (same object, not changed since)."""
        out = []
        for t in tensors:
            ref, version = self.checked.get(id(t), (None, None))
            out.append(ref is not None and ref() is t and t._version == version)
        return out


class GaussianOptimizers(Optimizers):
    """nerfstudio's Optimizers; the gaussians' Adam steps as one kernel pass on the metal backend."""

    def __init__(self, config: Dict, param_groups: Dict[str, List[torch.nn.Parameter]], model=None) -> None:
        super().__init__(config, param_groups)
        self.model = model
        self.gaussian_groups = tuple(getattr(model, "gauss_params", {}).keys())
        self.last_fused: Optional[FusedStep] = None  # the last step's, when it was fused
        self.why_not_fused = ""  # why the last step was not (tests, debugging)
        self._metal: Dict[torch.device, bool] = {}
        self.sh_groups = ("features_dc", "features_rest")  # stepped inside the backward where armed
        self.fuse_sh = True  # False: never armed (the unfused twin the tests compare with)
        self._sh_armed = None  # the ShStep armed for this iteration's backward
        self._sh_next_ok = False  # the last step allows arming the next (see the module's doc)
        self._zeroed: set = set()  # the groups zeroed this iteration
        self.sh_taken = 0  # SH steps taken inside the backward (tests, debugging)
        self.fuse_params = True  # False: means, quats, scales, opacities never stepped in the backward (twin)
        self.params_taken = 0  # steps in which one of those took its step inside the backward (tests, debugging)
        self._next_ok: set = set()  # the groups the last step stepped fused with no GradScaler
        # the model's visible_adam: a gaussian culled in this step's render (radius 0 in every camera) takes no Adam
        # step at all (parameters and both moments untouched; see the module's doc), on every path
        self.visible_adam = bool(getattr(getattr(model, "config", None), "visible_adam", False))

    def zero_grad_all(self) -> None:
        self.zero_grad_some(list(self.optimizers))

    def zero_grad_some(self, param_groups: List[str]) -> None:
        """nerfstudio's; then arms the SH coefficients' step for the backward that follows, where it may."""
        super().zero_grad_some(param_groups)
        from ..ops.metal import adam

        self._zeroed = set(param_groups)
        self._sh_armed = None
        adam.arm_sh_step(None)
        if not (self.fuse_sh and self._sh_next_ok and set(self.sh_groups) <= self._zeroed):
            return
        if self._why_not_fused(None, list(self.sh_groups), need_grad=False):
            return
        others = {}
        if self.fuse_params:  # the ones only the render differentiates, zeroed now and fused in the last step
            allowed = getattr(self.model, "render_only_groups", lambda: ())()
            for name in adam.PARAMS_IN_BACKWARD:
                if name in allowed and name in self._zeroed and name in self._next_ok and name in self.optimizers:
                    others[name] = self.optimizers[name]
            if others and self._why_not_fused(None, list(self.sh_groups) + list(others), need_grad=False):
                others = {}  # (their betas differ from the SH groups', ...): after the backward, as before
        self._sh_armed = adam.ShStep(
            tuple(self.optimizers[n] for n in self.sh_groups), others, visible_only=self.visible_adam
        )
        adam.arm_sh_step(self._sh_armed)

    def optimizer_scaler_step_all(self, grad_scaler) -> None:
        self.optimizer_scaler_step_some(grad_scaler, list(self.optimizers))

    def optimizer_scaler_step_some(self, grad_scaler, param_groups: List[str]) -> None:
        rest = self._step_gaussians(grad_scaler, param_groups)
        with self._keep_culled(rest):
            super().optimizer_scaler_step_some(grad_scaler, rest)

    def optimizer_step_all(self) -> None:
        """nerfstudio's (no grad scaler: what tests and scripts call), the gaussians fused as above."""
        rest = self._step_gaussians(None, list(self.optimizers))
        with self._keep_culled(rest):
            for name in rest:
                max_norm = self.config[name]["optimizer"].max_norm
                if max_norm is not None:
                    torch.nn.utils.clip_grad_norm_(self.parameters[name], max_norm)
                self.optimizers[name].step()

    def _radii(self, n: int) -> torch.Tensor:
        """visible_adam: this step's render's radii as [C, n] int32 (what adam_step reads; gsplat 1.5's [C, n, 2]
        folded), from the model's ``info``; a clear error where there is none for these ``n`` gaussians."""
        radii = (getattr(self.model, "info", None) or {}).get("radii")
        if radii is not None and radii.dim() == 3:
            radii = radii.amax(dim=-1)
        if radii is None or radii.dim() != 2 or radii.shape[1] != n:
            got = "none" if radii is None else list(radii.shape)
            raise RuntimeError(
                f"visible_adam: the Adam step needs this step's render's radii [C, {n}] (model.info['radii']), got "
                f"{got}: a render between the backward and the optimizer step, or a densification before it?"
            )
        return radii.to(torch.int32).contiguous()

    @contextlib.contextmanager
    def _keep_culled(self, names: List[str]):
        """visible_adam on torch's optimizers (cpu, cuda, or where the fused step is not taken): torch's Adam steps the
        gaussians' groups among ``names`` and the rows of the gaussians culled in this step's render get back their
        parameters and both moments (zeros where the state is new), so a culled gaussian takes no step at all while
        a visible one's is torch's exactly (the step counter and bias correction per tensor, as gsplat's
        SelectiveAdam). Else nothing."""
        names = [n for n in names if n in self.gaussian_groups] if self.visible_adam else []
        kept = []
        with torch.no_grad():
            for name in names:
                p = self.optimizers[name].param_groups[0]["params"][0]
                if p.grad is None:  # torch's Adam skips it
                    continue
                culled = ((self._radii(p.shape[0]) > 0).sum(dim=0) == 0).nonzero().squeeze(1)
                state = self.optimizers[name].state[p]
                moments = {k: state[k][culled].clone() for k in ("exp_avg", "exp_avg_sq") if k in state}
                kept.append((name, p, culled, p[culled].clone(), moments))
        yield
        with torch.no_grad():
            for name, p, culled, old, moments in kept:
                p.index_copy_(0, culled, old)
                state = self.optimizers[name].state[p]
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in state:
                        state[k].index_copy_(0, culled, moments.get(k, torch.zeros_like(state[k][culled])))

    def _step_gaussians(self, grad_scaler, param_groups: List[str]) -> List[str]:
        """Steps the gaussians' groups among ``param_groups`` in one fused pass where it can (else nothing);
        returns the groups left for torch's optimizers."""
        from ..ops.metal import adam

        names = [n for n in param_groups if n in self.gaussian_groups]
        self.last_fused = None
        sh, self._sh_armed = self._sh_armed, None
        adam.arm_sh_step(None)  # not taken by now: not this iteration's
        taken = []
        if sh is not None and sh.flag is not None:  # the backward stepped the SH coefficients (and maybe more)
            taken = list(sh.taken)
            for name in taken:
                p = self.optimizers[name].param_groups[0]["params"][0]
                if name not in names or p.grad is not None:
                    raise RuntimeError(
                        f"{name} took its Adam step inside the backward, but "
                        + ("this step does not step it" if name not in names else "another gradient reached it")
                        + " (a second backward or another use of it in the loss: the model's render_only_groups"
                        " must leave it out): unsupported with the Adam step in the backward"
                    )  # fmt: skip
            self.sh_taken += 1
            self.params_taken += len(taken) > len(self.sh_groups)
            names = [n for n in names if n not in taken]
        self.why_not_fused = self._why_not_fused(grad_scaler, names)
        fused = [] if self.why_not_fused else names
        if fused or taken:
            self._fused_step(fused, taken, sh.flag if taken else None)
        scaler_off = grad_scaler is None or not grad_scaler.is_enabled()
        stepped = set(fused) | set(taken)
        self._sh_next_ok = scaler_off and set(self.sh_groups) <= stepped & self._zeroed
        self._next_ok = stepped & self._zeroed if scaler_off else set()
        return [n for n in param_groups if n not in stepped]

    def _why_not_fused(self, grad_scaler, names: List[str], need_grad: bool = True) -> str:
        """'' when the groups ``names`` can take the fused step, else why not (one line). ``need_grad``
        False: whether they could once their gradients are there (arming the SH step before the backward)."""
        from ..ops.metal import adam

        if not names:
            return "no gaussian parameter group steps"
        if distributed.active() is not None:
            return "a distributed run"
        if grad_scaler is not None and grad_scaler.is_enabled():
            return "the GradScaler is enabled"
        if _global_optimizer_pre_hooks:
            return "global optimizer step pre-hooks"
        device = self.optimizers[names[0]].param_groups[0]["params"][0].device
        if self._metal.get(device) is None:  # resolved once per device (the backend does not change)
            self._metal[device] = renders_with_metal(self.model, device)
        if not self._metal[device]:
            return "the model does not render with the metal backend"
        if "adam" in stage_fallback.failed():
            return "the fused Adam failed this GPU's Metal self-check"
        params, grads, avgs, avg_sqs, steps, betas = [], [], [], [], [], set()
        for name in names:
            opt = self.optimizers[name]
            if (
                type(opt) is not torch.optim.Adam
                or len(opt.param_groups) != 1
                or len(opt.param_groups[0]["params"]) != 1
            ):
                return f"{name}: not one torch.optim.Adam over one tensor"
            group, p = opt.param_groups[0], opt.param_groups[0]["params"][0]
            if self.config[name]["optimizer"].max_norm is not None:
                return f"{name}: gradient clipping (max_norm)"
            if group["amsgrad"] or group["weight_decay"] or group["maximize"] or group.get("differentiable"):
                return f"{name}: amsgrad, weight decay, maximize or differentiable"
            if group.get("decoupled_weight_decay") or not group.get("fused"):
                return f"{name}: not torch's fused Adam (its state and step counter differ)"
            if not all(isinstance(x, (float, int)) for x in (group["lr"], group["eps"], *group["betas"])):
                return f"{name}: a tensor learning rate, eps or beta"
            if opt._optimizer_step_pre_hooks:
                return f"{name}: optimizer step pre-hooks"
            if need_grad and p.grad is None:
                return f"{name}: no gradient (torch's Adam skips it)"
            state = opt.state[p]
            if not state:  # as torch's Adam makes it at its first step with fused=True (Adam._init_group)
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if not all(k in state for k in ("step", "exp_avg", "exp_avg_sq")):
                return f"{name}: optimizer state without step/exp_avg/exp_avg_sq"
            params.append(p)
            grads.append(p.grad if need_grad else p)
            avgs.append(state["exp_avg"])
            avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
            betas.add(tuple(float(b) for b in group["betas"]))
        if len(betas) != 1:
            return f"the groups' betas differ: {sorted(betas)}"
        why = adam.check(params, grads, avgs, avg_sqs, steps)
        return f"adam: {why}" if why else self._pack_moments(params, grads if need_grad else [])

    def _pack_moments(self, params: List[torch.Tensor], grads: List[torch.Tensor]) -> str:
        """'' once the moments of every gaussian group with a state (those of ``params`` among them) are views of the
        two moment arenas the kernels bind (ops/metal/adam.py pack_moments), re-packed (one copy each) where a
        densification, a checkpoint load or a first step left them apart: metadata is compared, no device read, so a
        steady step copies nothing. Else why not: moments that share memory with each other, a parameter or a
        gradient (torch's Adam steps those one after another)."""
        from ..ops.metal import adam

        states = []
        for name in self.gaussian_groups:
            opt = self.optimizers.get(name)
            groups = getattr(opt, "param_groups", [])
            p = groups[0]["params"][0] if len(groups) == 1 and len(groups[0]["params"]) == 1 else None
            state = opt.state.get(p, {}) if p is not None else {}
            moments = [state.get(k) for k in ("exp_avg", "exp_avg_sq")]
            if all(isinstance(m, torch.Tensor) and m.dtype == torch.float32 and m.is_contiguous()
                   and m.shape == p.shape and m.device == params[0].device for m in moments):  # fmt: skip
                states.append(state)
        others = [p for name in self.gaussian_groups if name in self.optimizers
                  for p in self.optimizers[name].param_groups[0]["params"]]  # fmt: skip
        avgs, avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        if adam.overlapping([*{id(p): p for p in [*params, *others]}.values(), *grads, *avgs, *avg_sqs]):
            return "adam: moments that share memory with each other, a parameter or a gradient"
        if adam.arena(avgs) is None or adam.arena(avg_sqs) is None:
            adam.pack_moments(states)
        return ""

    @torch.no_grad()
    def _fused_step(self, names: List[str], taken: Sequence[str] = (), flag: Optional[torch.Tensor] = None) -> None:
        """Steps ``names`` in one fused pass (none: nothing) and finishes the steps of ``taken``, the groups the
        backward already stepped into ``flag``, as torch's step would (hooks, versions, the guard's flag)."""
        from ..ops.metal.adam import fused_adam

        opts = [self.optimizers[n] for n in names]
        groups = [opt.param_groups[0] for opt in opts]
        params = [g["params"][0] for g in groups]
        states = [opt.state[p] for opt, p in zip(opts, params)]  # made by _why_not_fused where new
        if names:
            beta1, beta2 = groups[0]["betas"]
            flag = fused_adam(
                params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [s["step"] for s in states], [g["lr"] for g in groups], [g["eps"] for g in groups], beta1, beta2,
                flag=flag, radii=self._radii(params[0].shape[0]) if self.visible_adam else None,
            )  # fmt: skip
        opts += [self.optimizers[n] for n in taken]
        params += [self.optimizers[n].param_groups[0]["params"][0] for n in taken]
        for opt in opts:  # what torch's Optimizer.step wrapper does after the step
            opt._opt_called = True  # the LR scheduler's "step before optimizer.step()" check
            for hook in (*opt._optimizer_step_post_hooks.values(), *_global_optimizer_post_hooks.values()):
                hook(opt, (opt,), {})
        for p in params:  # the kernel wrote them: what watches _version must see it (the viewer's copy)
            torch.autograd.graph.increment_version(p)
        checked = {id(t): (weakref.ref(t), t._version) for p in params for t in (p, p.grad) if t is not None}
        # the flag judged what the kernels stepped (the SH step's, taken alone, too: its kernel folds the same verdict)
        self.last_fused = FusedStep(flag, checked) if names or taken else None
