"""The emulator's MSL checks: every kernel library passes them, and every planted bug is caught.

- The MSL subset check (emulator/msl_subset.py) and the address-space check (emulator/address_spaces.py,
  clang with device/constant/threadgroup as distinct address spaces) over every library the backend
  builds, non-standard variants (other tile sizes and channel counts) and the test kernels included.
- Planted bugs that g++ alone accepts (shown by compiling them all with g++), each refused by
  compile_library with a message naming the construct and the .metal line.
- Races: the whole Metal pipeline, forward and backward, gives the same results under several schedule
  seeds; with one barrier removed from rasterize.metal it does not.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from scenes import random_scene

from splat_metal_method.ops import rasterization
from splat_metal_method.ops.metal import kernels, runtime
from splat_metal_method.ops.metal.emulator import EmulatorError, MetalCompileError, compile_library, library
from splat_metal_method.ops.metal.emulator.address_spaces import check_address_spaces, clang
from splat_metal_method.ops.metal.emulator.msl_subset import check_msl_subset
from splat_metal_method.ops.metal.emulator.parse import parse_kernels, strip_comments
from splat_metal_method.ops.metal.rasterize_bwd import bwd_batch

KERNELS = Path(__file__).parent / "kernels"
# (tile size, channels) of the rasterizer libraries built beyond the standard ones: the corners of
# what the public op accepts (tile 1..32, 1..64 channels) and a few in between.
RASTER_VARIANTS = [(1, 1), (2, 5), (4, 2), (8, 9), (16, 16), (32, 33), (32, 64), (16, 64)]


def every_library() -> dict[str, str]:
    sources = dict(kernels.all_sources())
    for ts, d in RASTER_VARIANTS:
        sources[f"rasterize_ts{ts}_d{d}"] = kernels.stage_source("rasterize.metal", ts, (("SPLAT_CHANNELS", d),))
        sources[f"rasterize_bwd_ts{ts}_d{d}"] = kernels.stage_source(
            "rasterize_bwd.metal", ts, (("SPLAT_CHANNELS", d), ("SPLAT_BWD_BATCH", bwd_batch(ts, d)))
        )
    sources["emulator_tests"] = runtime.load_source(KERNELS / "emulator_tests.metal")
    return sources


def test_every_kernel_library_passes_the_subset_and_address_space_checks():
    assert clang() is not None, "the address-space check needs clang++ (scripts/setup.sh installs it)"
    sources = every_library()
    assert len(sources) >= 12 + 2 * len(RASTER_VARIANTS)
    for name, src in sources.items():
        ks, tg = parse_kernels(src)
        assert ks, name
        check_msl_subset(src, strip_comments(src), ks, name)
        check_address_spaces(src, tg, name)


# --------------------------------------------------------------------------------------------------
# planted bugs
# --------------------------------------------------------------------------------------------------
PARAMS = (
    "device float* out [[buffer(0)]], device const float* x [[buffer(1)]], constant float* c [[buffer(2)]], "
    "constant long& n [[buffer(3)]], uint tid [[thread_index_in_threadgroup]]"
)
TEMPLATE = """#include <metal_stdlib>
using namespace metal;
{helpers}
{attr}kernel void planted_{i}({params}) {{
  threadgroup float sh[32];
  sh[tid] = x[tid] + c[0];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  {body}
  out[tid] = sh[(tid + 1) % 32] + float(n);
}}
"""
THREAD_HELPERS = (
    "inline float first(thread const float* p) { return p[0]; }\n"
    "inline void bump(thread float& v) { v += 1.0f; }\n"
    "inline float tg_first(threadgroup const float* p) { return p[0]; }\n"
    "inline float dev_first(device const float* p) { return p[0]; }\n"
)
MANY_BUFFERS = ", ".join(f"device float* b{i} [[buffer({i + 4})]]" for i in range(28))
# id -> (helpers, kernel attribute, params, body, message the check gives)
PLANTED = {
    # address spaces (clang)
    "device_ptr_to_thread_param": (
        THREAD_HELPERS,
        "",
        PARAMS,
        "sh[tid] += first(x);",
        r"no matching function for call to 'first'",
    ),
    "threadgroup_ref_to_thread_param": (
        THREAD_HELPERS,
        "",
        PARAMS,
        "bump(sh[tid]);",
        r"no matching function for call to 'bump'",
    ),
    "device_ref_to_thread_param": (
        THREAD_HELPERS,
        "",
        PARAMS,
        "bump(out[tid]);",
        r"no matching function for call to 'bump'",
    ),
    "device_ptr_to_threadgroup_param": (THREAD_HELPERS, "", PARAMS, "sh[tid] += tg_first(x);", r"call to 'tg_first'"),
    "constant_ptr_to_device_param": (THREAD_HELPERS, "", PARAMS, "sh[tid] += dev_first(c);", r"call to 'dev_first'"),
    "threadgroup_ptr_to_thread_param": (THREAD_HELPERS, "", PARAMS, "sh[tid] += first(sh);", r"call to 'first'"),
    "thread_address_in_device_ptr": (
        "",
        "",
        PARAMS,
        "float v = 1.0f; device float* p = &v; sh[tid] += *p;",
        r"cannot initialize a variable of type 'device float \*'",
    ),
    "device_ptr_in_thread_local": (
        "",
        "",
        PARAMS,
        "float* p = out; sh[tid] += *p;",
        r"of type 'float \*' with an lvalue of type 'device float \*'",
    ),
    "vla": ("", "", PARAMS, "float v[n]; v[0] = 1.0f; sh[tid] += v[0];", r"variable length array"),
    # the MSL subset
    "double": ("", "", PARAMS, "double d = x[tid]; sh[tid] = float(d);", r"`double`: Metal has no double"),
    "std": ("", "", PARAMS, "sh[tid] = std::sqrt(x[tid]);", r"`std::`"),
    "printf": ("", "", PARAMS, 'printf("%f", x[tid]);', r"C library call"),
    "throw": ("", "", PARAMS, "if (x[tid] < 0.0f) throw 1;", r"exceptions"),
    "try": ("", "", PARAMS, "try { sh[tid] = 1.0f; } catch (...) {}", r"exceptions"),
    "virtual": ("struct Base { virtual float get() const { return 1.0f; } };", "", PARAMS, "", r"`virtual`"),
    "function_pointer": (
        "inline float twice(float v) { return 2.0f * v; }",
        "",
        PARAMS,
        "float (*f)(float) = twice; sh[tid] = f(x[tid]);",
        r"function pointer",
    ),
    "recursion": (
        "inline float fact(float v) { return v <= 1.0f ? 1.0f : v * fact(v - 1.0f); }",
        "",
        PARAMS,
        "sh[tid] = fact(x[tid]);",
        r"recursion \(fact -> fact\)",
    ),
    "mutual_recursion": (
        "inline float ping(float v);\ninline float pong(float v) { return v <= 0.0f ? 0.0f : ping(v - 1.0f); }\n"
        "inline float ping(float v) { return pong(v); }",
        "",
        PARAMS,
        "sh[tid] = ping(x[tid]);",
        r"recursion \(p[io]ng -> p[io]ng -> p[io]ng\)",
    ),
    "non_ascii_comment": (
        "// caf\u00e9 au lait",
        "",
        PARAMS,
        "",
        r"non-ASCII character '\u00e9' \(U\+00E9\).*as ASCII",
    ),
    # kernel signatures
    "buffer_31": (
        "",
        "",
        PARAMS.replace(", uint tid", ", " + MANY_BUFFERS + ", uint tid"),
        "",
        r"\[\[buffer\(31\)\]\].*at most 31 buffers",
    ),
    "buffer_without_address_space": (
        "",
        "",
        PARAMS.replace("device float* out", "float* out"),
        "",
        r"buffer `float\* out` must be a device or constant",
    ),
    "helper_param_without_address_space": (
        "inline float first(const float* p) { return p[0]; }",
        "",
        PARAMS,
        "",
        r"parameter `const float\* p` of first\(\) .* without an address space",
    ),
    "float_thread_index": (
        "",
        "",
        PARAMS.replace("uint tid", "float tid"),
        "",
        r"\[\[thread_index_in_threadgroup\]\] `float tid` must be uint or ushort",
    ),
    "vector_thread_index": ("", "", PARAMS.replace("uint tid", "uint2 tid"), "", r"must be uint or ushort"),
    "int_position": ("", "", PARAMS + ", int3 pos [[thread_position_in_grid]]", "", r"`int3 pos` must be uint, uint2"),
    "mixed_position_ranks": (
        "",
        "",
        PARAMS + ", uint2 pos [[thread_position_in_grid]], uint3 grid [[threads_per_grid]]",
        "",
        r"same number of components",
    ),
    "unknown_kernel_attribute": ("", "[[reqd_work_group_size(32)]] ", PARAMS, "", r"unsupported kernel attribute"),
}


def planted_source(case: str, i: int = 0) -> str:
    helpers, attr, params, body, _ = PLANTED[case]
    return TEMPLATE.format(helpers=helpers, attr=attr, params=params, body=body, i=i)


def test_the_planted_template_is_valid_and_runs():
    lib = compile_library(
        TEMPLATE.format(
            helpers=THREAD_HELPERS,
            attr="[[max_total_threads_per_threadgroup(32)]] ",
            params=PARAMS,
            body="float v = 0.0f; bump(v); sh[tid] += first(&v) - 1.0f;",
            i="ok",
        )
    )
    out, x, c = torch.zeros(32), torch.arange(32.0), torch.ones(1)
    lib.planted_ok(out, x, c, 2, threads=32, group_size=32)
    assert out.tolist() == [(t + 1) % 32 + 1.0 + 2.0 for t in range(32)]


# g++ accepts VLAs too, but the emulator builds with -Werror=vla; a float/vector index does not compile
GPP_REFUSES = {"vla", "float_thread_index", "vector_thread_index"}


def test_gpp_alone_accepts_every_planted_bug():
    # Why the checks exist: the emulator's g++ compiles all of these (each in a namespace of its own).
    tu = "#include <metal_stdlib>\nusing namespace metal;\n" + "".join(
        f"namespace case_{i} {{\n{planted_source(c, i).split('using namespace metal;', 1)[1]}}}\n"
        for i, c in enumerate(PLANTED)
        if c not in GPP_REFUSES
    )
    res = subprocess.run(
        [library._CXX, "-std=c++17", "-fsyntax-only", "-Wno-attributes", "-I", str(library.SHIM_DIR), "-x", "c++", "-"],
        input=tu,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.parametrize("case", list(PLANTED))
def test_planted_bug_is_refused(case):
    with pytest.raises(MetalCompileError, match=PLANTED[case][4]) as e:
        compile_library(planted_source(case), f"planted_{case}")
    assert re.search(r"planted_\w+:\d+", str(e.value)), f"no file:line in {e.value}"


def test_non_ascii_install_path_is_refused_as_torch_would():
    src = '#line 1 "/Users/Jos\u00e9/splat/project.metal"\n' + planted_source("double").replace("double d", "float d")
    with pytest.raises(
        MetalCompileError,
        match=r"non_ascii_path:1: non-ASCII .* inside the directive `#line 1 \"/Users/Jos\u00e9/splat/project\.metal\"`",
    ):
        compile_library(src, "non_ascii_path")


def test_kernel_attribute_placement():
    between = planted_source("double").replace("kernel void", "kernel [[max_total_threads_per_threadgroup(32)]] void")
    with pytest.raises(EmulatorError, match=r"write kernel attributes before `kernel`"):
        compile_library(between, "between")
    after = planted_source("double").replace(
        "{\n  threadgroup", "[[max_total_threads_per_threadgroup(32)]] {\n  threadgroup", 1
    )
    with pytest.raises(EmulatorError, match=r"attribute after the parameter list"):
        compile_library(after, "after")
    hidden = planted_source("double").replace("kernel void", "kernel\nstatic void")
    with pytest.raises(EmulatorError, match=r"cannot parse the kernel declaration"):
        compile_library(hidden, "hidden")


# --------------------------------------------------------------------------------------------------
# races: identical results across schedule seeds, and a removed barrier that shows
# --------------------------------------------------------------------------------------------------
def run_pipeline(monkeypatch, seed: int, backward: bool = True):
    monkeypatch.setenv("SPLAT_METAL_EMU_SEED", str(seed))
    scene = random_scene(
        n=400,
        C=2,
        width=37,
        height=23,
        seed=5,
        sh_degree=1,
        backgrounds=True,
        scale_range=(0.1, 0.4),
        opacity_range=(0.05, 0.3),
    )
    ts = {k: v.clone().requires_grad_(backward) for k, v in scene.tensors().items() if k != "Ks"}
    # tile 8: 64-thread groups, so tiles take several batches and the between-batch barriers matter
    colors, alphas, meta = rasterization(**scene.kwargs(**ts), absgrad=backward, tile_size=8, backend="metal")
    out = {"colors": colors.detach(), "alphas": alphas.detach(), "radii": meta["radii"]}
    if backward:
        meta["means2d"].retain_grad()
        ((colors * torch.linspace(0.2, 1.0, colors.shape[-1])).sum() + 0.3 * alphas.sum()).backward()
        out.update({f"grad.{k}": t.grad for k, t in ts.items()})
        out["absgrad"] = meta["means2d"].absgrad
    return out


def test_pipeline_is_identical_across_schedule_seeds(monkeypatch):
    runs = [run_pipeline(monkeypatch, seed) for seed in (0, 1, 2)]  # seed 1: the other poison pattern too
    for other in runs[1:]:
        for k, v in runs[0].items():
            assert torch.isfinite(v.float()).all(), k
            if k.startswith("grad.") or k == "absgrad":  # float atomics: the summation order follows the
                # schedule, so entries that are sums of cancelling terms differ relative to the largest entry
                torch.testing.assert_close(other[k], v, rtol=1e-5, atol=1e-6 + 1e-5 * float(v.abs().max()), msg=k)
            else:
                assert torch.equal(other[k], v), k


@pytest.mark.parametrize("which", [0, 1])
def test_a_removed_barrier_in_rasterize_changes_the_result(monkeypatch, which):
    # rasterize.metal's batch loop: A. publish simd_all(done); barrier 0; B. load the batch into
    # threadgroup memory; barrier 1; C. composite it; barrier 2. Without barrier 0 threads read
    # unpublished (poisoned) stop flags and leave the loop at different batches (the emulator reports the
    # divergent barrier); without barrier 1 pixels composite gaussians not loaded yet (poison). Barrier 2
    # is not tested: the next batch's barrier 0 already orders its loads after every thread's compositing.
    good = run_pipeline(monkeypatch, 0, backward=False)
    barrier = "threadgroup_barrier(mem_flags::mem_threadgroup);"
    original = kernels.stage_source

    def without_barrier(stage_file, *a):
        src = original(stage_file, *a)
        if stage_file != "rasterize.metal":
            return src
        at = [m.start() for m in re.finditer(re.escape(barrier), src)]
        assert len(at) == 3, "rasterize.metal's barriers changed: update this test"
        return src[: at[which]] + "/* barrier removed */" + src[at[which] + len(barrier) :]

    monkeypatch.setattr(kernels, "stage_source", without_barrier)
    noticed = []
    for seed in (0, 1):
        try:
            noticed.append(
                not torch.allclose(run_pipeline(monkeypatch, seed, backward=False)["colors"], good["colors"], atol=1e-3)
            )
        except EmulatorError as e:
            noticed.append("divergent control flow" in str(e))
    assert any(noticed), "the race went unnoticed"
