"""Two facts about installed distributions, read from their ``.dist-info`` folder without importing
``importlib.metadata`` (its import, the email parser with it, and a scan of every distribution's entry
points took ~20 ms of CPU of a 0.16 s ``.ply`` export): nerfstudio's version (the .ply header's
comment, as ``ns-export`` writes it) and the names of splat-metal's method entry points (run_config.py).

``dist_info`` finds the folder as ``importlib.metadata.distribution`` does (the first entry of
``sys.path`` that holds a ``<name>-*.dist-info`` of the normalised name); wherever it cannot be
sure of giving the same answer (another metadata finder installed, a zip or an egg on the path, two
candidates, no METADATA), the functions ask ``importlib.metadata`` itself.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import List, Optional


def _normalize(name: str) -> str:  # importlib.metadata's Prepared.normalize
    return re.sub(r"[-_.]+", "-", name).lower().replace("-", "_")


def dist_info(name: str) -> Optional[Path]:
    """The ``.dist-info`` folder of ``name`` that importlib.metadata reads, or None where this cannot tell."""
    from importlib.machinery import PathFinder

    if any(hasattr(f, "find_distributions") and f is not PathFinder for f in sys.meta_path):
        return None  # another finder of distributions: importlib.metadata asks it too
    wanted = _normalize(name)
    for entry in sys.path:
        root = entry or "."
        try:
            children = os.listdir(root)
        except OSError:
            if os.path.exists(root):  # a zip file: importlib.metadata looks inside
                return None
            continue
        found = []
        for child in children:
            low = child.lower()
            if low.endswith(".egg") or (low.endswith(".egg-info") and _normalize(low.partition("-")[0]) == wanted):
                return None  # eggs: importlib.metadata's legacy lookups
            if low.endswith(".dist-info") and _normalize(low.rpartition(".")[0].partition("-")[0]) == wanted:
                found.append(child)
        if found:
            return Path(root, found[0]) if len(found) == 1 and (Path(root, found[0]) / "METADATA").is_file() else None
    return None


def version(name: str) -> str:
    """``importlib.metadata.version(name)``."""
    info = dist_info(name)
    if info is not None:
        for line in (info / "METADATA").read_text(encoding="utf-8").splitlines():
            if not line.strip():
                break  # end of the headers
            key, sep, value = line.partition(":")
            if sep and key == "Version":
                return value.strip()
    from importlib.metadata import version as metadata_version

    return metadata_version(name)


def entry_point_names(name: str, group: str) -> List[str]:
    """The names of distribution ``name``'s entry points in ``group`` (importlib.metadata's)."""
    info = dist_info(name)
    if info is None:
        from importlib import metadata

        return [ep.name for ep in metadata.distribution(name).entry_points if ep.group == group]
    path = info / "entry_points.txt"
    names, section = [], None
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
        elif section == group and "=" in line:
            names.append(line.partition("=")[0].strip())
    return names
