"""The fast tier (`bash scripts/test.sh -m "not slow"`: tests/conftest.py's SLOW_FILES and SLOW_TESTS left out)
keeps what it is for:

- every test file has at least one fast test, or is in SLOW_FILES saying what its module fixture runs;
- every entry of SLOW_TESTS names a test that exists outside SLOW_FILES, and every LONG_FILES and SLOW_FILES entry
  a file (a renamed test would otherwise drop silently into the fast tier, or a stale line hide that its test is
  gone);
- every Metal stage the host can build (variants.library_variants) and every native CPU source has a fast test
  that compares it against the reference (STAGE_TESTS);
- every console script and ns-train method of pyproject.toml, every nerfstudio tool the plugin hooks and every
  splat-metal-export format has a fast test that runs it (COMMAND_TESTS).

Checked from names (the test files' source, no collection): a test counts as fast unless its file is in SLOW_FILES
or SLOW_TESTS lists its bare id; a parametrized test listed by ids is taken to keep a fast one (parametrizations
are not expanded), so a test named here is listed by none of its ids where all of them could be slow."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set

from splat_metal_method.export import cli
from splat_metal_method.ops.metal import variants

REPO = Path(__file__).resolve().parents[1]
CONFTEST = (REPO / "tests" / "conftest.py").read_text()


def literal(name: str):
    """The literal assigned to ``name`` at the top of tests/conftest.py (read from its source: no second import)."""
    for node in ast.parse(CONFTEST).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"tests/conftest.py assigns no {name}")


SLOW_FILES = literal("SLOW_FILES")
SLOW_TESTS = literal("SLOW_TESTS")
TEST_FILES = sorted([*REPO.glob("tests/**/test_*.py"), *REPO.glob("benchmarks/tests/**/test_*.py")])

# Each Metal stage (.metal file) and native CPU source: fast tests comparing its kernels with the reference.
STAGE_TESTS = {
    "project.metal": ["tests/ops/metal/test_forward_kernels.py::test_project_matches_reference"],
    "project_bwd.metal": ["tests/ops/metal/test_backward_kernels.py::test_project_bwd_matches_reference"],
    "sh.metal": ["tests/ops/metal/test_forward_kernels.py::test_spherical_harmonics_matches_reference",
                 "tests/ops/metal/test_forward_kernels.py::test_spherical_harmonics_activate_matches_reference"],
    "sh_bwd.metal": ["tests/ops/metal/test_backward_kernels.py::test_sh_bwd_matches_reference",
                     "tests/ops/metal/test_backward_kernels.py::test_sh_activate_bwd_matches_reference"],
    "covar.metal": ["tests/ops/test_mcmc_ops.py::test_native_covariance_matches_the_reference",
                    "tests/ops/test_mcmc_ops.py::test_native_covariance_backward_matches_the_reference"],
    "isect.metal": ["tests/ops/metal/test_forward_kernels.py::test_isect_matches_reference",
                    "tests/ops/metal/test_bins.py::test_two_cameras_share_one_bin_sort"],
    "sort.metal": ["tests/ops/metal/test_forward_kernels.py::test_radix_sort_is_a_stable_unsigned_sort"],
    "scan.metal": ["tests/ops/metal/test_scan.py::test_prefix_sum_matches_torch_cumsum"],
    "rasterize.metal": ["tests/ops/metal/test_forward_kernels.py::test_rasterize_matches_reference"],
    "rasterize_bwd.metal": ["tests/ops/metal/test_backward_kernels.py::test_rasterize_bwd_matches_reference",
                            "tests/ops/metal/test_bwd_tile_merge.py::test_tile_merge_matches_the_reference"],
    "loss.metal": ["tests/ops/metal/test_loss_kernel.py::test_metal_loss_equals_reference"],
    "train.metal": ["tests/ops/metal/test_fused_composite.py::test_fused_composite_matches_its_twin_and_the_reference",
                    "tests/ops/metal/test_metal_training.py::test_one_training_step_matches_reference"],
    "adam.metal": ["tests/ops/metal/test_adam.py::test_nan_gradient_sets_the_flag_and_propagates_as_torch_adam",
                   "tests/ops/metal/test_visible_adam.py::test_a_culled_gaussian_keeps_everything_and_a_visible_one_takes_torch_adams_step"],
    "cpu/project.cpp": ["tests/ops/test_cpu_backend.py::test_matches_reference_on_random_scenes"],
    "cpu/sh.cpp": ["tests/ops/test_cpu_backend.py::test_matches_reference_at_every_sh_degree"],
    "cpu/covar.cpp": ["tests/ops/test_mcmc_ops.py::test_native_covariance_matches_the_reference",
                      "tests/ops/test_mcmc_ops.py::test_native_covariance_backward_matches_the_reference"],
    "cpu/isect.cpp": ["tests/ops/test_cpu_backend.py::test_isect_tiles_equals_reference_exactly"],
    "cpu/rasterize.cpp": ["tests/ops/test_cpu_backend.py::test_matches_reference_per_mode_with_sh"],
}  # fmt: skip

# Each command (the name the test file's source must contain) and export format: fast tests that run it.
COMMAND_TESTS = {
    "splat-metal-doctor": ["tests/verify/test_doctor.py::test_doctor_passes_on_cpu"],
    "splat-metal-bench": ["tests/bench/test_bench_cli.py::test_quick_bench_summary_line"],
    "splat-metal-export": ["tests/export/test_export_formats.py::test_cli_ply_is_byte_identical_to_ns_export_and_prints_sizes"],
    "splat-metal": ["tests/method/test_cli_e2e.py::test_training_saves_checkpoint_and_densifies"],
    "splat-metal-mcmc": ["tests/method/test_mcmc_cli.py::test_trains_within_cap_max_and_prints_it"],
    "ns-export": ["tests/method/test_cli_e2e.py::test_export_gaussian_splat_ply"],
    "ns-eval": ["tests/method/test_nerfstudio_tools.py::test_ns_eval_writes_psnr"],
    "ns-render": ["tests/method/test_nerfstudio_tools.py::test_ns_render_camera_path_images_rgb_depth_accumulation"],
    "ns-viewer": ["tests/test_previous_layout.py::test_ns_viewer_serves_an_old_run"],
}  # fmt: skip
FORMAT_TESTS = {
    "ply": ["tests/export/test_export_formats.py::test_cli_ply_is_byte_identical_to_ns_export_and_prints_sizes"],
    "splat": ["tests/export/test_export_formats.py::test_splat_fields_order_and_size"],
    "spz": ["tests/export/test_export_formats.py::test_spz_header_and_fields"],
    "sog": ["tests/export/test_export_playcanvas.py::test_splat_transform_decodes_sog"],
    "compressed-ply": ["tests/export/test_export_playcanvas.py::test_splat_transform_decodes_compressed_ply"],
    "glb": ["tests/export/test_export_glb.py::test_cli_writes_it_and_the_validator_finds_no_other_error"],
    "lod": ["tests/export/test_export_lod.py::test_cli_writes_the_folder"],
}  # fmt: skip


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def functions_in(path: Path) -> List[str]:
    """The names of the test functions defined at the top of a test file."""
    tree = ast.parse(path.read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


def defined_tests() -> Set[str]:
    return {f"{rel(path)}::{name}" for path in TEST_FILES for name in functions_in(path)}


def is_fast(test: str) -> bool:
    return test not in SLOW_TESTS and test.split("::")[0] not in SLOW_FILES


def problems_of(mapping: Dict[str, List[str]], defined: Set[str]) -> List[str]:
    problems = []
    for what, tests in mapping.items():
        for test in tests:
            if test not in defined:
                problems.append(f"{what}: {test} is not a test function")
            elif not is_fast(test):
                problems.append(f"{what}: {test} is slow (SLOW_TESTS or SLOW_FILES)")
    return problems


def test_every_test_file_has_a_fast_test_or_says_why_not():
    all_slow = [rel(p) for p in TEST_FILES if not any(is_fast(f"{rel(p)}::{n}") for n in functions_in(p))]
    unexplained = [path for path in all_slow if path not in SLOW_FILES]
    assert not unexplained, f"every test of these files is in SLOW_TESTS (keep one fast test each): {unexplained}"
    assert all(why.strip() for why in SLOW_FILES.values()), "each SLOW_FILES entry says what its fixture runs"


def test_every_slow_entry_names_a_test_that_exists():
    defined = defined_tests()
    stale = sorted(t for t in SLOW_TESTS if t.split("[")[0] not in defined)
    assert not stale, f"SLOW_TESTS names tests that no file defines (renamed or removed?): {stale}"
    long_files = literal("LONG_FILES")
    missing = [path for path in [*long_files, *SLOW_FILES] if not (REPO / path).is_file()]
    assert not missing, f"LONG_FILES or SLOW_FILES name files that do not exist: {missing}"
    twice = sorted(t for t in SLOW_TESTS if t.split("::")[0] in SLOW_FILES)
    assert not twice, f"SLOW_TESTS names tests of SLOW_FILES (already slow): {twice}"
    assert not set(long_files) & set(SLOW_FILES), "a LONG_FILES entry is all slow: the fast tier never runs it"


def test_every_metal_stage_and_cpu_source_has_a_fast_reference_comparison():
    stages = {v.stage_file for v in variants.library_variants()}
    cpu_sources = {f"cpu/{p.name}" for p in (REPO / "splat_metal_method" / "ops" / "cpu").glob("*.cpp")}
    assert stages | cpu_sources == set(STAGE_TESTS), "STAGE_TESTS must list exactly the stages and CPU sources"
    problems = problems_of(STAGE_TESTS, defined_tests())
    assert not problems, problems


def test_every_command_and_export_format_has_a_fast_test_that_runs_it():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover (Python 3.10)
        import tomli as tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = set(project["scripts"]) | set(project["entry-points"]["nerfstudio.method_configs"])
    assert declared <= set(COMMAND_TESTS), f"no fast test listed for {sorted(declared - set(COMMAND_TESTS))}"
    assert set(cli.FORMATS) == set(FORMAT_TESTS), "FORMAT_TESTS must list exactly splat-metal-export's formats"
    defined = defined_tests()
    problems = problems_of({**COMMAND_TESTS, **FORMAT_TESTS}, defined)
    assert not problems, problems
    for command, tests in COMMAND_TESTS.items():
        for test in tests:
            source = (REPO / test.split("::")[0]).read_text()
            assert command in source, f"{test} is listed as running {command}, which its file never names"


def test_the_checks_name_a_missing_and_a_slow_test():
    defined = defined_tests()
    missing = COMMAND_TESTS["splat-metal-doctor"][0] + "_renamed"
    slow = min(t for t in SLOW_TESTS if "[" not in t)
    in_slow_file = min(t for t in defined if t.split("::")[0] in SLOW_FILES)
    assert problems_of({"x": [missing, slow, in_slow_file]}, defined) == [
        f"x: {missing} is not a test function",
        f"x: {slow} is slow (SLOW_TESTS or SLOW_FILES)",
        f"x: {in_slow_file} is slow (SLOW_TESTS or SLOW_FILES)",
    ]
