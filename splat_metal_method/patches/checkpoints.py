"""nerfstudio checkpoints: loaded under torch's weights_only default, and found robustly.

* nerfstudio 1.1.5 saves optimizer/scheduler state holding numpy scalars and loads checkpoints with a
  plain ``torch.load`` (ns-export, ns-viewer, ns-render, ns-eval, --load-dir resume). Since torch 2.6
  that load is weights_only and rejects the numpy types. Importing this package (nerfstudio imports it
  when it reads a splat-metal config.yml or lists methods) allow-lists exactly those numpy types, which
  are plain data, instead of turning weights_only off.
* nerfstudio takes the step to load from every file name in ``nerfstudio_models/``
  (``int(x[x.find("-") + 1 : x.find(".")])``): any other file there (macOS Finder's ``.DS_Store``)
  breaks ns-export, ns-eval, ns-viewer, ns-render and ``--load-dir``, and a truncated checkpoint ends
  in a traceback from deep inside torch. ``install()`` (run when splat-metal's method config is
  imported, which every ns-* command does while listing methods) routes both of nerfstudio's loaders
  through ``find_checkpoint``: the newest ``step-NNNNNNNNN.ckpt`` whose zip archive is complete (every
  member's CRC checks), nothing else in the folder looked at. A broken newest checkpoint stops eval and
  export with one line naming it and the previous good one; a resume (``--load-dir``) uses the
  previous good one, with a warning.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

CHECKPOINT_NAME = re.compile(r"step-(\d+)\.ckpt")
_PATCHED = "_splat_metal_checkpoints"


class CheckpointError(SystemExit):
    """A checkpoint folder or file that cannot be used: one line, exit status 1, no traceback."""

    def __init__(self, message: str):
        super().__init__(message if message.startswith("splat-metal: ") else f"splat-metal: {message}")


def numpy_checkpoint_globals() -> list:
    """The numpy types that appear in nerfstudio checkpoints (scalars and their dtypes)."""
    try:
        from numpy.core.multiarray import scalar  # numpy < 2 pickles this name
    except ImportError:  # pragma: no cover - numpy >= 2
        from numpy._core.multiarray import scalar
    dtypes = [type(np.dtype(t)) for t in (np.float64, np.float32, np.int64, np.int32, np.bool_)]
    return [scalar, np.dtype, *dtypes]


def allow_nerfstudio_checkpoints() -> None:
    """Allow-lists the numpy types for torch.load: now if torch is imported, else as soon as it is (a
    command that never loads torch, ``splat-metal-export`` on its fast path, does not pay its 2-3 s import)."""
    if "torch" in sys.modules:
        _allow(sys.modules["torch"])
    elif not any(isinstance(f, _AfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())


def _allow(torch) -> None:
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals(numpy_checkpoint_globals())


class _AfterTorchImport:
    """A meta path finder that hands torch's own spec to the import system with its loader wrapped: once the
    loader has executed the module, ``_allow`` runs on it and this finder leaves ``sys.meta_path``. (A mere
    ``importlib.util.find_spec("torch")`` gets the wrapped spec too and executes nothing.)"""

    def __init__(self):
        self._busy = False

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self._busy:
            return None
        import importlib.util

        self._busy = True  # the search below asks every finder, this one included
        try:
            spec = importlib.util.find_spec("torch")
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _allow(module)

        spec.loader.exec_module = exec_module  # this spec's own loader object
        return spec


# --------------------------------------------------------------------------------------------------
# Finding the checkpoint to load
# --------------------------------------------------------------------------------------------------
def step_checkpoints(folder: Path) -> List[Tuple[int, Path]]:
    """(step, path) of every ``step-N.ckpt`` file in ``folder``, oldest first; other names ignored."""
    found = []
    for p in Path(folder).iterdir():
        m = CHECKPOINT_NAME.fullmatch(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def unreadable(path: Path) -> Optional[str]:
    """Why ``path`` is not a complete checkpoint (None when it is). torch.save writes a zip archive
    with a CRC per member: a truncated or damaged file fails to open or fails a CRC."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, EOFError) as e:
        return f"truncated or not a checkpoint: {e}"
    except OSError as e:
        return e.strerror or str(e)
    return f"damaged: {bad} fails its CRC check" if bad else None


def find_checkpoint(folder: Path, step: Optional[int] = None, resume: bool = False) -> Tuple[Path, Optional[str]]:
    """The checkpoint to load from ``folder`` and a warning to print (or None): ``step``'s, or else the
    newest readable one. Raises CheckpointError with one actionable line when there is none to use.
    ``resume`` (ns-train --load-dir): a broken newest checkpoint is skipped for the previous good one,
    with a warning; otherwise (eval, export) it is an error that names both."""
    folder = Path(folder)
    option = "--load-dir " if resume else ""
    if not folder.exists():
        raise CheckpointError(f"{option}{folder} does not exist; give the nerfstudio_models folder of a run.")
    if not folder.is_dir():
        raise CheckpointError(f"{option}{folder} is a file; give the nerfstudio_models folder that holds it.")
    found = step_checkpoints(folder)
    if not found:
        inner = folder / "nerfstudio_models"
        if inner.is_dir() and step_checkpoints(inner):
            raise CheckpointError(
                f"{option}{folder} is a run's folder; its checkpoints are in {inner}: use {option}{inner}."
            )
        raise CheckpointError(
            f"{option}{folder} holds no checkpoint (step-NNNNNNNNN.ckpt); give the nerfstudio_models folder of a "
            "run that saved one."
        )
    if step is not None:
        by_step = dict(found)
        if step not in by_step:
            raise CheckpointError(
                f"--load-step {step}: no step-{step:09d}.ckpt in {folder}; it holds steps "
                f"{', '.join(str(s) for s, _ in found)}."
            )
        why = unreadable(by_step[step])
        if why:
            raise CheckpointError(f"{by_step[step]} cannot be read ({why}); choose another --load-step.")
        return by_step[step], None
    broken, path = [], None
    for _, candidate in reversed(found):
        why = unreadable(candidate)
        if why is None:
            path = candidate
            break
        broken.append((candidate, why))
    if not broken:
        return path, None
    newest, why = broken[0]
    if path is None:
        raise CheckpointError(f"{newest} cannot be read ({why}), and there is no earlier good checkpoint in {folder}.")
    if resume:
        return path, f"splat-metal: {newest} cannot be read ({why}); resuming from the previous good one, {path}."
    raise CheckpointError(
        f"{newest} cannot be read ({why}); the previous good checkpoint is {path}: move the broken "
        f"file{'s' * (len(broken) > 1)} out of {folder} to use it."
    )


def eval_checkpoint(folder: Path, step: Optional[int]) -> Path:
    """The checkpoint eval_setup loads (ns-export, ns-eval, ...) for a run whose checkpoint folder is
    ``folder`` (TrainerConfig.get_checkpoint_dir()) and config.yml's load_step ``step``: that step's
    where this run's folder has it, else the newest readable one (find_checkpoint).
    splat-metal-export reads the same one without eval_setup (export/checkpoint.py)."""
    # config.yml's load_step is the --load-step of training (a step of the run it resumed):
    # used only where this run's folder has it
    if step is not None and not (Path(folder) / f"step-{step:09d}.ckpt").is_file():
        step = None
    return find_checkpoint(folder, step)[0]


def checkpoint_file(path: Path) -> Path:
    """``--load-checkpoint PATH``: an existing, readable checkpoint file, or one actionable line."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"--load-checkpoint {path} is not a file; give a step-NNNNNNNNN.ckpt file.")
    why = unreadable(path)
    if why:
        raise CheckpointError(f"--load-checkpoint {path} cannot be read ({why}).")
    return path


# --------------------------------------------------------------------------------------------------
# nerfstudio's loaders
# --------------------------------------------------------------------------------------------------
def _print(message: str) -> None:
    from nerfstudio.utils.rich_utils import CONSOLE

    CONSOLE.print(message, highlight=False, soft_wrap=True)


def install() -> None:
    """Routes nerfstudio's two checkpoint loaders through find_checkpoint (once):

    * eval_setup (ns-eval, ns-export, ns-viewer, ns-render, splat-metal-export) sets
      ``config.load_dir = config.get_checkpoint_dir()`` and then lists that folder unless
      ``config.load_step`` is set: get_checkpoint_dir, when eval_utils asks for it, also sets
      load_step to the step find_checkpoint chose (before the pipeline is built: errors come fast);
    * Trainer._load_checkpoint (``--load-dir`` resume) is given the chosen step the same way, for the
      call only (config.yml keeps what the user typed).
    """
    from nerfstudio.configs.experiment_config import ExperimentConfig
    from nerfstudio.engine.trainer import Trainer

    get_dir = ExperimentConfig.get_checkpoint_dir
    if not getattr(get_dir, _PATCHED, False):

        def get_checkpoint_dir(self) -> Path:
            folder = get_dir(self)
            if sys._getframe(1).f_globals.get("__name__") == "nerfstudio.utils.eval_utils":
                path = eval_checkpoint(folder, self.load_step)
                self.load_step = int(CHECKPOINT_NAME.fullmatch(path.name).group(1))  # type: ignore[union-attr]
            return folder

        setattr(get_checkpoint_dir, _PATCHED, True)
        ExperimentConfig.get_checkpoint_dir = get_checkpoint_dir  # type: ignore[method-assign]

    load = Trainer._load_checkpoint
    if not getattr(load, _PATCHED, False):

        def _load_checkpoint(self) -> None:
            config = self.config
            if config.load_dir is None:
                if config.load_checkpoint is not None:
                    checkpoint_file(config.load_checkpoint)
                return load(self)
            path, warning = find_checkpoint(config.load_dir, config.load_step, resume=True)
            if warning:
                _print(warning)
            given = config.load_step
            config.load_step = int(CHECKPOINT_NAME.fullmatch(path.name).group(1))  # type: ignore[union-attr]
            try:
                return load(self)
            finally:
                config.load_step = given

        setattr(_load_checkpoint, _PATCHED, True)
        Trainer._load_checkpoint = _load_checkpoint  # type: ignore[method-assign]
