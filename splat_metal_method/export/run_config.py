"""What an export needs of a run's config.yml, read without importing the run's classes.

A config.yml names its classes by module path (``!!python/object:...TrainerConfig``), and loading it
with yaml's full loader imports them: nerfstudio's trainer, viewer, torchvision, ... (4-6 s of the
command's start-up, more on a loaded machine). ``quick_run`` reads it with a SafeLoader whose
constructors build nothing: ``!!python/object:C`` becomes a ``Tagged`` mapping that keeps ``C``,
``!!python/object/apply:pathlib.PosixPath`` a Path, ``!!python/tuple`` a tuple,
``!!python/name:X`` the string ``X``, any other ``!!python/...`` an inert ``Tagged``.

It answers only for the runs it recognises: a trainer config of nerfstudio's or splat-metal's class
whose model is one of the splatfacto-family classes below, of an installed method, every named
module present, the fields it reads of the types they have. For anything else (another method, a
plugin's class, an old layout, a field of an unexpected type, not YAML) it returns None and the
command takes nerfstudio's full load, whose checks and error lines are the ones users see.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path, PosixPath
from typing import Any, Dict, Optional

import yaml

TRAINER_CLASSES = {
    "nerfstudio.engine.trainer.TrainerConfig",
    "splat_metal_method.method.configs.SplatMetalTrainerConfig",
}
SPLAT_MODEL_CLASSES = {  # SplatfactoModelConfig and its subclasses in this package
    "nerfstudio.models.splatfacto.SplatfactoModelConfig",
    "splat_metal_method.method.model.SplatMetalModelConfig",
    "splat_metal_method.method.mcmc.SplatMetalMCMCModelConfig",
}
NERFSTUDIO_SPLAT_METHODS = {"splatfacto", "splatfacto-big"}  # nerfstudio's own method_configs
DISTRIBUTION = "splat-metal-method"  # pyproject.toml's name: the splat-metal methods' entry points


@dataclass
class Tagged:
    """A ``!!python/object:<tag>`` (or other python tag) of the file, as plain data."""

    tag: str
    fields: Any


@dataclass
class ModelSettings:
    """The model config fields export_gaussians reads (SplatfactoModelConfig's names)."""

    sh_degree: int
    rasterize_mode: str


@dataclass
class RunSettings:
    """What the export reads of a run's config."""

    method_name: str
    checkpoint_dir: Path  # TrainerConfig.get_checkpoint_dir()
    load_step: Optional[int]
    model: Any  # ModelSettings, or the run's SplatfactoModelConfig (full load)


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser where PyYAML has it
    """SafeLoader's parsing (libyaml's C parser when PyYAML was built with it: ~5x faster than the
    Python one, ~30 ms of a 0.4 s export for a run's config.yml) with the constructors below."""

    modules: set  # modules the file names (checked to exist)


def _object(loader: _Loader, suffix: str, node: yaml.Node) -> Tagged:
    loader.modules.add(suffix.rpartition(".")[0])
    fields = loader.construct_mapping(node, deep=True) if isinstance(node, yaml.MappingNode) else None
    return Tagged(suffix, fields)


def _apply(loader: _Loader, suffix: str, node: yaml.Node) -> Any:
    loader.modules.add(suffix.rpartition(".")[0])
    if suffix == "pathlib.PosixPath" and isinstance(node, yaml.SequenceNode):
        parts = loader.construct_sequence(node, deep=True)
        if all(isinstance(p, str) for p in parts):
            return PosixPath(*parts)
    return Tagged(suffix, None)


def _name(loader: _Loader, suffix: str, node: yaml.Node) -> str:
    loader.modules.add(suffix.rpartition(".")[0])
    return suffix


def _other(loader: _Loader, suffix: str, node: yaml.Node) -> Tagged:
    return Tagged(suffix, None)


_Loader.add_constructor(
    "tag:yaml.org,2002:python/tuple", lambda loader, node: tuple(loader.construct_sequence(node, deep=True))
)
_Loader.add_multi_constructor("tag:yaml.org,2002:python/object:", _object)
_Loader.add_multi_constructor("tag:yaml.org,2002:python/object/apply:", _apply)
_Loader.add_multi_constructor("tag:yaml.org,2002:python/name:", _name)
_Loader.add_multi_constructor("tag:yaml.org,2002:python/", _other)


def _installed(method_name: str) -> bool:
    """In nerfstudio's all_methods (without importing them): its own splatfacto methods, or an
    entry point of that name (splat-metal's), unless NERFSTUDIO_METHOD_CONFIGS changes the list."""
    if "NERFSTUDIO_METHOD_CONFIGS" in os.environ:
        return False
    if method_name in NERFSTUDIO_SPLAT_METHODS:
        return True
    from .installed import entry_point_names

    group = "nerfstudio.method_configs"
    try:  # splat-metal's own methods: its entry points only (importlib.metadata reads every distribution's)
        if method_name in entry_point_names(DISTRIBUTION, group):
            return True
    except Exception:  # noqa: BLE001 - not installed as a distribution: importlib.metadata says
        pass
    from importlib.metadata import entry_points

    return method_name in entry_points(group=group).names


def _module_exists(name: str) -> bool:
    """Whether ``name`` can be imported, found on disk without importing anything (importlib's find_spec
    of a dotted name imports its parent packages: torch and nerfstudio's, seconds for a fast export)."""
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    locations = list(spec.submodule_search_locations or [])
    for i, part in enumerate(rest):
        last = i == len(rest) - 1
        package = next((Path(loc) / part for loc in locations if (Path(loc) / part / "__init__.py").is_file()), None)
        if package is None:
            return last and any(
                (Path(loc) / f"{part}{suffix}").is_file()
                for loc in locations
                for suffix in importlib.machinery.all_suffixes()
            )
        locations = [str(package)]
    return True


def quick_run(config_path: Path) -> Optional[RunSettings]:
    """The run's settings when config.yml is a gaussian-splatting run this reads with certainty;
    None (take nerfstudio's full load) otherwise."""
    try:
        loader = _Loader(config_path.read_text())
        loader.modules = set()
        try:
            config = loader.get_single_data()
        finally:
            loader.dispose()
    except Exception:  # noqa: BLE001 - unreadable, not YAML, a tag this loader does not know: the full load says
        return None
    if not isinstance(config, Tagged) or config.tag not in TRAINER_CLASSES or not isinstance(config.fields, dict):
        return None
    c: Dict[str, Any] = config.fields
    pipeline = c.get("pipeline")
    model = pipeline.fields.get("model") if isinstance(pipeline, Tagged) and isinstance(pipeline.fields, dict) else None
    if not isinstance(model, Tagged) or model.tag not in SPLAT_MODEL_CLASSES or not isinstance(model.fields, dict):
        return None
    sh_degree, mode = model.fields.get("sh_degree"), model.fields.get("rasterize_mode")
    names = [c.get(k) for k in ("experiment_name", "method_name", "timestamp")]
    load_step = c.get("load_step")
    if not (
        type(sh_degree) is int
        and isinstance(mode, str)
        and all(isinstance(n, str) for n in names)
        and isinstance(c.get("output_dir"), Path)
        and isinstance(c.get("relative_model_dir"), Path)
        and (load_step is None or type(load_step) is int)
        and _installed(names[1])
        and all(_module_exists(m) for m in loader.modules)
    ):
        return None
    experiment_name, method_name, timestamp = names
    base = Path(f"{c['output_dir']}/{experiment_name}/{method_name}/{timestamp}")  # get_base_dir's
    return RunSettings(method_name, Path(base / c["relative_model_dir"]), load_step, ModelSettings(sh_degree, mode))
