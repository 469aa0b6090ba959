"""What every kernel asks of a Metal pipeline at every library variants.library_variants enumerates, counted from
its source: bound argument slots (each buffer, each scalar and each packed list a setBytes slot, against Metal's 31,
and HEADROOM_SLOTS) and
threadgroup memory (its declared threadgroup arrays at the variant's defines, against Apple's 32 KiB with room to
spare). Each check rejects a planted kernel over its limit."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pytest

from splat_metal_method.ops.metal import kernels, params, variants
from splat_metal_method.ops.metal.emulator.parse import parse_kernels, strip_comments

METAL_SLOTS = 31  # buffer argument table entries of a compute kernel (setBuffer and setBytes share them)
HEADROOM_SLOTS = 24  # what a kernel may bind, so that the next argument does not break it on a Mac
# The kernels over HEADROOM_SLOTS before their scalars were packed into lists and their Adam moments and gradients
# into arenas (main at 50 part 1), for the table test_every_kernel_binds_at_most_its_slots prints (docs/metal.md,
# "Argument slots").
BEFORE_PACKING = {"project_bwd": 31, "rasterize_bwd": 31, "adam_step": 30, "project_fwd": 29, "rasterize_fwd": 28,
                  "nonfinite_flag": 25}  # fmt: skip
THREADGROUP_LIMIT = 32 * 1024  # Apple GPUs' threadgroup memory per group
# ours: 2.5 KiB to spare. The largest: rasterize_fwd at 32x32 tiles (29,184 B: 1,024 gaussians' id, mean, conic and
# opacity), rasterize_bwd (28,676 B at 12x12 tiles, 49 channels), bin_count (15,360 B: 30,720 before its rounds).
THREADGROUP_BUDGET = 29 * 1024 + 512
SIZES = {"float": 4, "int": 4, "uint": 4, "long": 8, "ulong": 8, "short": 2, "ushort": 2, "char": 1, "uchar": 1,
         "half": 2, "bool": 1, "float2": 8, "float4": 16, "int2": 8, "uint2": 8}  # fmt: skip


def slots(source: str) -> dict:
    """kernel -> bound argument slots (buffers and scalars) of an assembled library."""
    ks, _ = parse_kernels(source)
    return {k.name: len(k.buffers) for k in ks.values()}


def check_slots(source: str, name: str) -> dict:
    counted = slots(source)
    for kernel, n in counted.items():
        assert n <= METAL_SLOTS, f"{name}: {kernel} binds {n} argument slots, Metal allows {METAL_SLOTS}"
        assert n <= HEADROOM_SLOTS, (
            f"{name}: {kernel} binds {n} argument slots (scalars included), more than {HEADROOM_SLOTS}"
        )
    return counted


def test_every_kernel_binds_at_most_its_slots():
    counted = {}
    # The variants of a stage differ only in their defines, and no parameter list holds a directive (checked here):
    # the same signatures in every variant the host can request, so one variant a stage counts them all.
    for v in {v.stage_file: v for v in variants.checked_variants()}.values():
        source = kernels.stage_source(*v)
        clean = strip_comments(source)
        for k in parse_kernels(source)[0].values():
            assert "#" not in clean[k.offset : clean.index("{", k.offset)], f"{k.name}: a directive in its parameters"
        counted.update(check_slots(source, variants.variant_name(v)))
    assert len(counted) == 30 and max(counted.values()) == 23
    print(f"\n{'kernel':<29} before  now")
    for kernel, n in sorted(counted.items(), key=lambda kn: (-BEFORE_PACKING.get(kn[0], kn[1]), -kn[1], kn[0])):
        print(f"{kernel:<29} {BEFORE_PACKING.get(kernel, n):>6}  {n:>3}")


def planted_kernel(buffers: int = 0, scalars: int = 0, tg: str = "") -> str:
    params = [f"device float* b{i} [[buffer({i})]]" for i in range(buffers)]
    params += [f"constant long& s{i} [[buffer({buffers + i})]]" for i in range(scalars)]
    return ("#include <metal_stdlib>\nusing namespace metal;\n[[max_total_threads_per_threadgroup(32)]]\n"
            f"kernel void planted({', '.join(params + ['uint i [[thread_position_in_grid]]'])}) {{\n{tg}\n"
            "  b0[i] = 1.0f;\n}\n")  # fmt: skip


@pytest.mark.parametrize("buffers, scalars", [(32, 0), (20, 12), (20, 5)])
def test_a_planted_kernel_over_the_slots_is_rejected(buffers, scalars):
    """32 slots (all buffers, or 20 buffers and 12 scalars) break Metal's 31; 25 break the headroom."""
    with pytest.raises(AssertionError, match="argument slots"):
        check_slots(planted_kernel(buffers, scalars), "planted")
    check_slots(planted_kernel(buffers=20, scalars=4), "planted (24)")


def test_the_packed_layouts_are_common_h_s():
    """Each layout of params.py (the host's order of a packed list) is the indices common.h names for the kernel:
    `<LAYOUT>_<FIELD>` its position, `<LAYOUT>_COUNT` its length; and pack() takes exactly its fields."""
    header = (Path(kernels.__file__).parent / "common.h").read_text()
    defined = dict(re.findall(r"^#define ([A-Z][A-Z0-9_]*)[ \t]+(\d+)\b", header, re.M))
    for layout, fields in params.LAYOUTS.items():
        want = {f"{layout}_{f.upper()}": str(i) for i, f in enumerate(fields)} | {f"{layout}_COUNT": str(len(fields))}
        assert {k: v for k, v in defined.items() if k.startswith(f"{layout}_")} == want, layout
        values = {f: i for i, f in enumerate(fields)}
        assert params.pack(fields, **values) == list(range(len(fields)))
        with pytest.raises(TypeError, match="not the layout's fields"):
            params.pack(fields, **{**values, "extra": 1})
        with pytest.raises(TypeError, match="not the layout's fields"):
            params.pack(fields, **{f: i for i, f in enumerate(fields[1:])})


# --------------------------------------------------------------------------------------------------
# threadgroup memory
# --------------------------------------------------------------------------------------------------
_DIRECTIVE = re.compile(r"^[ \t]*#[ \t]*(define|undef|ifndef|ifdef|if|elif|else|endif)\b(.*)$", re.M)


def _source(stage_file: str) -> str:
    """The assembled source of one enumerated library of `stage_file` (they differ only in their injected defines)."""
    return kernels.stage_source(*next(v for v in variants.checked_variants() if v.stage_file == stage_file))


@lru_cache(maxsize=None)
def _directives(stage_file: str) -> tuple:
    """The preprocessor directives of a stage's assembled source without its injected defines, in order."""
    source = strip_comments(_source(stage_file))
    start = source.index("#include <metal_stdlib>")
    return tuple((m[1], m[2].strip()) for m in _DIRECTIVE.finditer(source, start))


def _evaluate(expr: str, macros: dict) -> int:
    """A preprocessor integer expression over object-like macros (C's / and % truncate towards zero)."""
    expr = re.sub(r"defined\s*\(\s*(\w+)\s*\)", lambda m: "1" if m[1] in macros else "0", expr)
    for _ in range(32):  # expand macros until none is left
        expanded = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: f"({macros[m[0]]})" if m[0] in macros else m[0], expr)
        if expanded == expr:
            break
        expr = expanded
    expr = re.sub(r"\b[A-Za-z_]\w*\b", "0", expr)  # an unknown identifier is 0, as in #if
    expr = re.sub(r"(\d+(?:\.\d*)?)[fFuUlL]+\b", r"\1", expr)
    expr = expr.replace("&&", " and ").replace("||", " or ").replace("/", "//")
    expr = re.sub(r"!(?!=)", " not ", expr)
    return int(eval(expr, {"__builtins__": {}}))  # noqa: S307 (our own kernel sources' directives)


def macros_of(variant: variants.Variant) -> dict:
    """The object-like macros defined after preprocessing `variant`'s library (its injected defines first)."""
    macros = {k: str(v) for k, v in kernels._base_defines(variant.tile_size).items()}
    macros.update({k: str(v) for k, v in variant.defines})
    macros["__METAL_VERSION__"] = "320"
    live = [True]  # one entry per open conditional: whether its current branch is taken (and its parents')
    taken = [True]  # whether some branch of the open conditional was taken
    for kind, rest in _directives(variant.stage_file):
        if kind in ("if", "ifdef", "ifndef"):
            cond = (rest.split()[0] in macros) if kind == "ifdef" else (rest.split()[0] not in macros) \
                if kind == "ifndef" else bool(_evaluate(rest, macros)) if live[-1] else False  # fmt: skip
            live.append(live[-1] and cond)
            taken.append(cond)
        elif kind == "elif":
            cond = not taken[-1] and live[-2] and bool(_evaluate(rest, macros))
            live[-1], taken[-1] = cond, taken[-1] or cond
        elif kind == "else":
            live[-1], taken[-1] = live[-2] and not taken[-1], True
        elif kind == "endif":
            live.pop(), taken.pop()
        elif live[-1] and kind == "define":
            name, _, value = rest.partition(" ")
            if "(" not in name:
                macros[name] = value.strip() or "1"
        elif live[-1] and kind == "undef":
            macros.pop(rest, None)
    return macros


@lru_cache(maxsize=None)
def _arrays(stage_file: str) -> dict:
    """kernel -> its threadgroup arrays (element type, dimension expression)."""
    ks, _ = parse_kernels(_source(stage_file))
    return {k.name: [(t.replace("threadgroup", "").strip(), dims.strip().removeprefix("[").removesuffix("]"))
                   for t, _, dims in k.tg_arrays] for k in ks.values()}  # fmt: skip


def threadgroup_bytes(variant: variants.Variant) -> dict:
    """kernel -> bytes of threadgroup memory it declares in `variant`'s library."""
    macros = macros_of(variant)
    return {kernel: sum(SIZES[t] * _evaluate(dims, macros) for t, dims in arrays)
            for kernel, arrays in _arrays(variant.stage_file).items()}  # fmt: skip


def check_threadgroup_memory(variant: variants.Variant, budget: int = THREADGROUP_BUDGET) -> dict:
    counted = threadgroup_bytes(variant)
    for kernel, n in counted.items():
        assert n <= budget, (
            f"{variants.variant_name(variant)}: {kernel} declares {n} B of threadgroup memory > {budget}"
        )
    return counted


def test_the_count_is_what_the_emulator_allocates():
    """The count from declarations and defines equals what the emulator's compiled kernels declare."""
    import torch

    seen = 0
    for name, (stage_file, extra) in kernels.standard_variants().items():
        lib = kernels.library(torch.device("cpu"), stage_file, extra=extra)
        for kernel, n in threadgroup_bytes(variants.Variant(stage_file, kernels.constants.TILE_SIZE, extra)).items():
            assert lib.limits(kernel)["static_thread_group_memory_length"] == n, (name, kernel)
            seen += n > 0
    assert seen >= 12


def test_every_kernel_of_every_variant_has_threadgroup_memory_to_spare():
    """Every library the host can request (22,866), each kernel within THREADGROUP_BUDGET."""
    worst = {}
    for v in variants.library_variants():
        for kernel, n in check_threadgroup_memory(v).items():
            worst[kernel] = max(worst.get(kernel, 0), n)
    assert len(worst) == 30 and 0 < max(worst.values()) <= THREADGROUP_BUDGET < THREADGROUP_LIMIT
    print(worst)


def test_a_planted_variant_over_the_budget_is_rejected():
    """bin_count holding its whole window of 7,680 tiles at once (its layout before the rounds: 30,720 B) and a
    rasterizer backward batch of 1,024 at 64 channels."""
    with pytest.raises(AssertionError, match="bin_count declares 30720 B"):
        check_threadgroup_memory(variants.Variant("isect.metal", 16, (("SPLAT_BIN_ROUND", 7680),)))
    big = variants.Variant("rasterize_bwd.metal", 32, (("SPLAT_CHANNELS", 64), ("SPLAT_BWD_BATCH", 1024)))
    with pytest.raises(AssertionError, match="threadgroup memory"):
        check_threadgroup_memory(big)
