"""Faults planted for the tests: the product reads no variable for any of them, each patches one of its functions.

In-process tests call them with ``monkeypatch.setattr``; the subprocess tests run a real console command through
this file, which plants the fault and then runs the command's entry point (importlib.metadata) in the same process:
the real CLI and real training, only the fault planted::

    python tests/inject.py nan-at-step STEP[:PARAM[:ROWS]] -- ns-train splat-metal ...
    python tests/inject.py save-error STEP[:ERRNO] -- ns-train splat-metal ...
    python tests/inject.py write-pause SECONDS -- ns-export gaussian-splat ...

- nan-at-step: the gradient of PARAM (default scales; any optimizer group, e.g. camera_opt) is NaN at STEP in its
  first ROWS gaussians (default 3; all of it for a group that is not the gaussians'), right before the optimizer
  step, as a numerical blow-up makes it (the NaN guard, engine/reliability.py, must find it);
- save-error: every checkpoint write from STEP on fails half-way with that OSError (default ENOSPC, "No space left
  on device"), as a full disk makes it (reliability.checkpoint_write);
- write-pause: the .ply block writer waits SECONDS after each block (export/ply_file.py block_written), so that a
  signal lands mid-write.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path
from typing import Callable, List

INJECT = Path(__file__).resolve()


def plant_nan(patch: Callable, at_step: int, name: str = "scales", rows: int = 3) -> None:
    """Every NonFiniteGuard built from now on has its model's gradient of ``name`` set to NaN at ``at_step``.
    ``patch``: ``monkeypatch.setattr``, or ``setattr`` in a process of its own."""
    from splat_metal_method.engine import reliability

    build = reliability.NonFiniteGuard.__init__

    def planted(guard, model, optimizers, *args, **kwargs):
        build(guard, model, optimizers, *args, **kwargs)
        if name not in optimizers:
            raise SystemExit(f"inject: no optimizer group {name!r}; groups: {sorted(optimizers)}")
        gaussian = name in model.gauss_params

        def hook(optimizer, args, kwargs):
            if getattr(model, "step", None) != at_step:
                return
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        if gaussian:
                            p.grad[:rows] = float("nan")
                        else:
                            p.grad.fill_(float("nan"))
            print(f"inject: NaN in the gradient of {name} at step {at_step}", flush=True)

        optimizers[name].register_step_pre_hook(hook)

    patch(reliability.NonFiniteGuard, "__init__", planted)


def plant_save_error(patch: Callable, at_step: int, code: int = errno.ENOSPC) -> None:
    """Checkpoint writes of step ``at_step`` and later fail half-way with OSError(``code``), as a full disk does."""
    from splat_metal_method.engine import reliability

    write = reliability.checkpoint_write

    def failing(state: dict, f, step: int) -> None:
        if step < at_step:
            return write(state, f, step)
        f.write(b"\0" * 4096)  # part of a checkpoint, as a disk that fills up mid-write leaves
        raise OSError(code, os.strerror(code))

    patch(reliability, "checkpoint_write", failing)


def plant_write_pause(patch: Callable, seconds: float) -> None:
    """The .ply block writer waits ``seconds`` after each block it wrote."""
    from splat_metal_method.export import ply_file

    patch(ply_file, "block_written", lambda rows: time.sleep(seconds))


def command(fault: str, spec, console: str, *args) -> List[str]:
    """The argv that runs ``console *args`` with ``fault`` planted (``run_cli(command(...))``'s prefix)."""
    return [sys.executable, str(INJECT), fault, str(spec), "--", console, *[str(a) for a in args]]


def _plant(fault: str, spec: str) -> None:
    bits = spec.split(":")
    try:
        if fault == "nan-at-step":
            plant_nan(setattr, int(bits[0]), bits[1] if len(bits) > 1 and bits[1] else "scales",
                      int(bits[2]) if len(bits) > 2 else 3)  # fmt: skip
        elif fault == "save-error":
            code = getattr(errno, bits[1] if len(bits) > 1 else "ENOSPC")
            plant_save_error(setattr, int(bits[0]), code)
        elif fault == "write-pause":
            plant_write_pause(setattr, float(spec))
        else:
            raise SystemExit(f"inject: unknown fault {fault!r}: nan-at-step, save-error or write-pause")
    except (ValueError, AttributeError):
        raise SystemExit(f"inject: {fault} {spec!r}: see `python {INJECT.name} --help`") from None


def main(argv: List[str]) -> int:
    if len(argv) < 4 or argv[2] != "--" or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    fault, spec, console, args = argv[0], argv[1], argv[3], argv[4:]
    from importlib.metadata import entry_points

    found = list(entry_points(group="console_scripts", name=console))
    if not found:
        raise SystemExit(f"inject: no console script {console!r} installed")
    _plant(fault, spec)
    sys.argv = [console, *args]
    return found[0].load()()


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == INJECT.parent:
        del sys.path[0]  # tests/'s helper modules are not the command's to import
    sys.exit(main(sys.argv[1:]))
