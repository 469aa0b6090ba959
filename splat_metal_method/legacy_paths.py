"""Module paths of earlier layouts, so that runs saved by them still load.

A run's config.yml names the classes it was trained with by module path
(``!!python/object:splat_metal_method.config.SplatMetalTrainerConfig``,
``!!python/name:splat_metal_method.trainer.SplatMetalTrainer``, ...), and ns-export, ns-viewer,
ns-eval, ns-render, splat-metal-export and ``ns-train --load-config`` import them by that path.
``install()`` (run by the package's ``__init__``) answers each old path with a stand-in module whose
attributes are those of the module's new home, so the old names resolve to today's classes.
``python -m <package>.<old>`` (older docs and scripts: ``python -m splat_metal_method.doctor``) runs
the new module as ``__main__``: runpy asks the finder for the module's code, which is a two-line
stand-in that runs the new module with ``runpy.run_module(new, run_name="__main__")``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

_PACKAGE = __name__.rpartition(".")[0]

# old module (before the layout by role, commit 1f68a78) -> where it lives now: the modules whose classes a saved
# run's config.yml names (config, model, mcmc, trainer, reliability, datamanager, dataparser, ...) and those older
# docs run with ``python -m`` (doctor, demo_scene). The old bench, bench_scenes, step_ledger and step_model are not
# here: no run or config names them, and ``python -m splat_metal_method.bench`` finds today's bench package first.
MOVED = {
    "config": "method.configs",
    "model": "method.model",
    "mcmc": "method.mcmc",
    "trainer": "engine.trainer",
    "resume_state": "engine.resume_state",
    "reliability": "engine.reliability",
    "memory": "engine.memory",
    "distributed": "engine.distributed",
    "datamanager": "data.datamanager",
    "dataparser": "data.dataparser",
    "demo_scene": "data.demo_scene",
    "render_device": "viewer.render_device",
    "viewer_fixes": "patches.viewer",
    "startup_fix": "patches.startup",
    "checkpoints": "patches.checkpoints",
    "kernel_checks": "verify.kernel_checks",
    "self_check": "verify.self_check",
    "doctor": "verify.doctor",
    "ssim": "ops.ssim",
}

# names that moved to another module: (old module, name) -> new module. The Trainer lived in
# reliability.py before it had a module of its own; runs of that time name it there.
RENAMED = {
    ("reliability", "SplatMetalTrainer"): "engine.trainer",
}


def _stand_in(old: str) -> types.ModuleType:
    """A module named ``<package>.<old>`` whose attributes are looked up in the new module."""
    new = importlib.import_module(f"{_PACKAGE}.{MOVED[old]}")
    module = types.ModuleType(f"{_PACKAGE}.{old}", f"Moved to {new.__name__} (legacy_paths.py).")

    def __getattr__(name: str):
        home = RENAMED.get((old, name))
        return getattr(importlib.import_module(f"{_PACKAGE}.{home}") if home else new, name)

    module.__getattr__ = __getattr__
    return module


class _LegacyFinder:
    """Finds ``<package>.<old>`` for every old module in MOVED, and only those: a meta path finder and
    its loader, by the methods the import system and runpy call (not importlib.abc's classes, whose
    import brings importlib.resources and tempfile: ~6 ms of every command's start-up)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, old = fullname.rpartition(".")
        if package == _PACKAGE and old in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return _stand_in(spec.name.rpartition(".")[2])

    def exec_module(self, module):
        pass

    # runpy (python -m) asks the loader for code to run as __main__
    def is_package(self, fullname) -> bool:
        return False

    def get_source(self, fullname) -> str:
        new = f"{_PACKAGE}.{MOVED[fullname.rpartition('.')[2]]}"
        return f"import runpy\nrunpy.run_module({new!r}, run_name='__main__', alter_sys=True)\n"

    def get_code(self, fullname):
        return compile(self.get_source(fullname), f"<{fullname}, moved (legacy_paths.py)>", "exec")


def install() -> None:
    if not any(isinstance(f, _LegacyFinder) for f in sys.meta_path):
        sys.meta_path.append(_LegacyFinder())
