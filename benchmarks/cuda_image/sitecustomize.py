"""Makes a Python see only what the GPU machines' image has (benchmarks/cuda_image_packages.txt) and what
travels there as wheels (benchmarks/cuda_carry.txt, and splat-metal itself): every other installed
distribution's modules and metadata are hidden, as if it were not installed. Python imports sitecustomize
at start, so this folder first on PYTHONPATH puts a process and every Python it starts there:

    PYTHONPATH=benchmarks/cuda_image python benchmarks/cuda_device_run.py --cpu-dry-run --stages commands --with-commands

An import that would fail on the GPU machine then fails here, before device time is spent on it
(tests/bench/test_cuda_device_run.py runs the commands stage so). The standard library and modules of no
distribution (this checkout, the tests' helpers) stay visible; versions stay this machine's: only which
distributions exist is emulated.
"""

import importlib.machinery
import importlib.metadata
import re
import sys
from pathlib import Path

_LISTS = Path(__file__).resolve().parent.parent  # benchmarks/


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _listed(path: Path) -> set:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(_normalized(re.split(r"[=<>!~ ;\[]", line, maxsplit=1)[0]))
    return names


ALLOWED = _listed(_LISTS / "cuda_image_packages.txt") | _listed(_LISTS / "cuda_carry.txt") | {"splat-metal-method"}
HIDDEN = {  # top-level modules every providing distribution of which is absent there
    module
    for module, dists in importlib.metadata.packages_distributions().items()
    if not any(_normalized(d) in ALLOWED for d in dists)
}


class _ImageOnly(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is None and name in HIDDEN:
            return None
        return super().find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        for dist in super().find_distributions(*args, **kwargs):
            if _normalized(dist.metadata["Name"] or "") in ALLOWED:
                yield dist


sys.meta_path[:] = [_ImageOnly if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
