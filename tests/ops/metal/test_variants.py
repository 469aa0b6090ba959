"""variants.library_variants: every kernel library the host can request, the one enumeration that the dispatch
code's define builders, the compile checks (here on Linux: the MSL-subset parser and the address-space check;
Apple's compiler in the macOS workflow, from `splat-metal-doctor --emit-metal`) and the doctor share. The kernel
tests' own requests are checked against it after each test (conftest.py); here, a planted request is caught."""

from __future__ import annotations

import hashlib
import re

import pytest

from splat_metal_method.ops import constants, contract
from splat_metal_method.ops.metal import kernels, rasterize, runtime, variants
from splat_metal_method.ops.metal.emulator import library as emulator_library
from splat_metal_method.ops.metal.emulator.address_spaces import check_address_spaces, clang, standin_text
from splat_metal_method.ops.metal.emulator.msl_subset import check_msl_subset
from splat_metal_method.ops.metal.emulator.parse import parse_kernels, strip_comments

TS = constants.TILE_SIZE


def test_the_enumeration_spans_every_axis_the_op_accepts():
    """Each stage, every tile size 1..32 with every strip of rows that divides it, every channel count 1..64, the
    tile merge on and off, project_bwd at every group size it can shrink to; no library twice."""
    every = list(variants.library_variants())
    assert len(every) == len(set(every))
    assert variants.MAX_TILE_SIZE == contract.MAX_TILE_SIZE and rasterize.MAX_CHANNELS == variants.MAX_CHANNELS
    files = {v.stage_file for v in every}
    assert files == {p.name for p in runtime.KERNEL_DIR.glob("*.metal")}
    raster = {(v.tile_size, dict(v.defines).get("SPLAT_GROUP_ROWS", v.tile_size), dict(v.defines)["SPLAT_CHANNELS"],
               v.stage_file, "SPLAT_BWD_MERGE" in dict(v.defines)) for v in every if v.stage_file.startswith("raster")}  # fmt: skip
    want = {(ts, rows, d, f, merge) for ts in range(1, 33) for rows in range(1, ts + 1) if ts % rows == 0
            for d in range(1, 65) for f, merge in (("rasterize.metal", False), ("rasterize_bwd.metal", False),
                                                   ("rasterize_bwd.metal", True))}  # fmt: skip
    assert raster == want
    groups = {dict(v.defines)["SPLAT_PROJECT_BWD_GROUP"] for v in every if v.stage_file == "project_bwd.metal"}
    assert groups == {32 * k for k in range(1, 9)}
    assert all(v.tile_size == TS for v in every if not v.stage_file.startswith("raster"))
    assert len(every) == 22_866  # 9 fixed stages + 8 project_bwd groups + the loss + 119 geometries x 64 x 3


def test_the_standard_and_checked_libraries_are_enumerated_and_cover_every_axis():
    every = set(variants.library_variants())
    checked = list(variants.checked_variants())
    assert set(checked) <= every and len(checked) == len(set(checked)) == 405
    assert {v.stage_file for v in checked} == {v.stage_file for v in every}
    assert {v for v in every if not v.stage_file.startswith("raster")} <= set(checked)
    for axis in (lambda v: (v.stage_file, v.tile_size), lambda v: (v.stage_file, dict(v.defines).get("SPLAT_CHANNELS")),
                 lambda v: (v.stage_file, "SPLAT_BWD_MERGE" in dict(v.defines)),
                 lambda v: (v.stage_file, dict(v.defines).get("SPLAT_GROUP_ROWS") is None)):  # fmt: skip
        assert {axis(v) for v in checked} == {axis(v) for v in every}
    strips = {dict(v.defines).get("SPLAT_GROUP_ROWS", TS) for v in checked if v.tile_size == TS}
    assert strips == set(variants.strip_rows(TS))  # the 16x16 tile in strips of 1, 2, 4 and 8 rows and whole
    for stage_file, extra in kernels.standard_variants().values():
        assert variants.Variant(stage_file, TS, extra) in every


@pytest.mark.planted_variants
def test_a_request_outside_the_enumeration_is_caught():
    """What conftest.py checks after each kernel test: a library assembled with a define no builder makes (a
    planted 65th channel, a stray define) is reported; the dispatch's own are not."""
    before = kernels.requested_variants()
    kernels.stage_source("rasterize.metal", TS, variants.raster_defines(3))
    kernels.stage_source(
        "rasterize_bwd.metal", 8, variants.bwd_defines(8, 9, 2, merge=True) + (("SPLAT_GROUP_ROWS", 2),)
    )
    assert variants.unlisted(kernels.requested_variants() - before) == []
    planted = [variants.Variant("rasterize.metal", TS, variants.raster_defines(65)),
               variants.Variant("rasterize.metal", TS, variants.raster_defines(3) + (("SPLAT_GROUP_ROWS", 3),)),
               variants.Variant("isect.metal", TS, (("SPLAT_BIN_WINDOW", 37),))]  # fmt: skip
    # values no other test builds: a library already assembled in this process (test_bin_histograms.py plants a
    # window of 40) is in `before`, so it would not show as newly requested
    for v in planted:
        kernels.stage_source(*v)
    assert variants.unlisted(kernels.requested_variants() - before) == sorted(planted)


def at_msl_version(source: str, version: int) -> str:
    """`source` as Apple's compiler sees it at -std of MSL `version` (its __METAL_VERSION__; the emulator's
    stand-in header says 320)."""
    include = "#include <metal_stdlib>\n"
    assert include in source
    return source.replace(include, f"{include}#undef __METAL_VERSION__\n#define __METAL_VERSION__ {version}\n", 1)


def test_the_msl_version_changes_only_the_math_mode_pragmas():
    """What each MSL version changes in our sources: common.h's `#if __METAL_VERSION__ >= 320` block of two
    pragmas (and sh.h's test of being compiled as Metal at all): so the version axis is the pragmas' presence."""
    uses = []
    for path in sorted([*runtime.KERNEL_DIR.glob("*.h"), *runtime.KERNEL_DIR.glob("*.metal")]):
        uses += [(path.name, line.strip()) for line in path.read_text().splitlines() if "__METAL_VERSION__" in line]
    assert uses == [("common.h", "#if __METAL_VERSION__ >= 320"), ("sh.h", "#ifdef __METAL_VERSION__")]


_CHECKED_DIR = emulator_library.cache_dir() / "variant_checks"


def check_library(name: str, source: str) -> None:
    """The MSL-subset parser and the address-space check (clang) on one library at every MSL version; a pass is
    remembered by the hash of the source, the checks' stand-in header and clang's version."""
    key = hashlib.sha256("\0".join([source, standin_text(), clang() or ""]).encode()).hexdigest()[:24]
    if (_CHECKED_DIR / key).exists():
        return
    ks, tg = parse_kernels(source)
    assert ks, name
    check_msl_subset(source, strip_comments(source), ks, name)
    for version in variants.MSL_VERSIONS:
        versioned = at_msl_version(source, version)  # the subset parser reads the text unpreprocessed: once is enough
        check_address_spaces(versioned, parse_kernels(versioned)[1], f"{name}@{version}")
    _CHECKED_DIR.mkdir(parents=True, exist_ok=True)
    (_CHECKED_DIR / key).touch()


def test_every_standard_library_passes_the_checks_at_every_msl_version():
    assert clang() is not None, "the address-space check needs clang++ (scripts/setup.sh installs it)"
    for name, (stage_file, extra) in kernels.standard_variants().items():
        check_library(name, kernels.stage_source(stage_file, TS, extra))


def test_every_checked_library_passes_the_checks_at_every_msl_version():
    """The 405 libraries of variants.checked_variants (what the macOS workflow compiles) x 4 MSL versions."""
    assert clang() is not None, "the address-space check needs clang++ (scripts/setup.sh installs it)"
    sources = kernels.all_sources()
    assert len(sources) == 405 and all(re.fullmatch(r"[a-z0-9_]+", name) for name in sources)
    for name, source in sources.items():
        check_library(name, source)


def plant(source: str, condition: str) -> str:
    """`source` with a device pointer passed as a thread pointer (Apple's compiler refuses it) where `condition`."""
    include = "#include <metal_stdlib>\n"
    return source.replace(include, f"{include}#if {condition}\n"
                          "inline float first(thread const float* p) { return p[0]; }\n"
                          "inline float planted(device const float* d) { return first(d); }\n#endif\n", 1)  # fmt: skip


@pytest.mark.planted_variants
def test_a_library_broken_in_one_strip_only_is_caught_in_that_strip():
    whole = kernels.stage_source("rasterize.metal", TS, variants.raster_defines(3))
    strip = kernels.stage_source("rasterize.metal", TS, variants.raster_defines(3) + variants.strip_defines(TS, 4))
    check_library("planted (whole tile)", plant(whole, "SPLAT_GROUP_ROWS == 4"))  # the whole tile is right
    with pytest.raises(Exception, match="address spaces"):
        check_library("planted (4-row strip)", plant(strip, "SPLAT_GROUP_ROWS == 4"))


@pytest.mark.planted_variants
def test_a_library_broken_at_msl_3_0_only_is_caught():
    bad = plant(kernels.stage_source("rasterize.metal", TS, variants.raster_defines(3)), "__METAL_VERSION__ < 310")
    check_address_spaces(bad, parse_kernels(bad)[1], "planted")  # at the emulator's 3.2 it type-checks
    with pytest.raises(Exception, match="address spaces"):
        check_library("planted (MSL 3.0)", bad)
