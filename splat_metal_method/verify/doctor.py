"""splat-metal-doctor: checks this machine's splat-metal kernels against the reference renderer.

    splat-metal-doctor            # MPS on a Mac, the MSL emulator elsewhere, gsplat on CUDA
    splat-metal-doctor --device cpu --size 64x40
    splat-metal-doctor --all-variants   # every library the compile checks build, not only the standard ones

Prints torch, OS and device facts and the backend "auto" would choose, compiles every kernel,
runs each stage forward and backward on a random non-square scene against the pure-PyTorch
reference on the same device, and prints max errors and timings. Exits 1 on any mismatch.
Paste its output into bug reports.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Callable, Dict, Sequence, Tuple

import torch

from ..ops.constants import SH_MAX_DEGREE
from .kernel_checks import (
    Check,
    _timed,
    adam_checks,
    covariance_checks,
    full_op_checks,
    loss_checks,
    prepare_checks,
    stage_checks,
)


def _native_cpu_fact() -> str:
    from ..ops.cpu import build

    if build.load() is None:
        return f"unavailable ({build.unavailable_reason().splitlines()[0]}); CPU tensors use the reference"
    return f"built with {build.describe()}"


def facts(device: torch.device) -> Dict[str, str]:
    from ..ops import resolve_backend

    info = {
        "splat-metal": __import__("splat_metal_method").__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "os": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "mac": platform.mac_ver()[0] or "-",
        "mps available": str(torch.backends.mps.is_available()),
        "cuda available": str(torch.cuda.is_available()),
        "checking on": str(device),
        "auto backend here": resolve_backend("auto", device),
        "native cpu backend": _native_cpu_fact(),
    }
    info["PYTORCH_MPS_FAST_MATH"] = fast_math_fact()
    if device.type in ("mps", "cpu"):
        info["safe math in the kernels"] = safe_math_fact(device)
    if device.type == "mps":
        from .self_check import gpu_name

        info["gpu"] = gpu_name(device)
    if device.type == "mps" and hasattr(torch.mps, "recommended_max_memory"):
        info["mps recommended max memory"] = f"{torch.mps.recommended_max_memory() / 2**30:.1f} GiB"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def fast_math_fact() -> str:
    """PYTORCH_MPS_FAST_MATH as torch reads it when it compiles our kernels (once per process)."""
    from .self_check import FAST_MATH_ENV, fast_math_enabled

    value = os.environ.get(FAST_MATH_ENV)
    if value is None:
        return "unset (safe math, as the kernels are verified)"
    return f"{value!r}: " + ("FAST MATH ON (the checks above ran with it)" if fast_math_enabled() else "off")


def safe_math_fact(device: torch.device) -> str:
    """Whether the kernels declare safe math (common.h's `#pragma METAL fp math_mode(safe)`) at the MSL version
    they are built at for `device` (the MSL emulator on cpu), i.e. whether PYTORCH_MPS_FAST_MATH can change them."""
    from ..ops.metal.kernels import SAFE_MATH_MSL, msl_version

    try:
        version = msl_version(device.type)
    except Exception as e:  # the probe kernel did not build or run: the doctor still reports the rest
        return f"unknown (the MSL version probe failed: {type(e).__name__}: {e})"
    name = f"MSL {version // 100}.{version % 100 // 10}"
    if version >= SAFE_MATH_MSL:
        return f"declared ({name}: PYTORCH_MPS_FAST_MATH cannot change them)"
    return (
        f"not declarable ({name} < 3.2): PYTORCH_MPS_FAST_MATH would compile them with fast math; the "
        "self-check then runs the stages it breaks on the reference"
    )


def _print_pipelines(device: torch.device) -> None:
    """Each compiled kernel's pipeline limits as this GPU reports them, next to what we dispatch."""
    from rich.console import Console
    from rich.table import Table

    from ..ops.metal import kernels

    title = "Metal pipelines on this GPU" if device.type == "mps" else "Metal pipelines (as the emulator enforces them)"
    table = Table(title=title)
    for col in ("library", "kernel", "max threads", "dispatched", "SIMD width", "tg bytes"):
        table.add_column(col, no_wrap=True)
    for name, (stage_file, extra) in kernels.standard_variants().items():
        lib = kernels.library(device, stage_file, extra=extra)
        for kernel in sorted(dir(lib)):
            lim = {k: "-" if v is None else str(v) for k, v in lib.limits(kernel).items()}
            ours, limit = kernels.group_threads(kernel), lib.limits(kernel)["max_threads_per_threadgroup"]
            fits = limit is None or ours <= limit
            # Over the limit, only the radix sort stops; the others run in smaller groups (kernels.py).
            shown = str(ours)
            if not fits:
                shown = f"[red]{ours}[/red]" if kernel.startswith("radix_") else f"[yellow]{ours} (shrinks)[/yellow]"
            table.add_row(name, kernel, lim["max_threads_per_threadgroup"], shown,
                          lim["thread_execution_width"], lim["static_thread_group_memory_length"])  # fmt: skip
    Console().print(table)


def _print_table(checks: Sequence[Check]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kernels vs reference")
    for col in ("stage", "pass", "max abs err", "rel err", "ms", "result"):
        table.add_column(col, no_wrap=col != "stage")  # numbers stay whole in a narrow terminal; names wrap
    for c in checks:
        table.add_row(c.stage, c.direction, f"{c.max_abs:.2e}", f"{c.rel:.2e}", f"{c.ms:.1f}",
                      "[green]ok[/green]" if c.ok else "[red]MISMATCH[/red]")  # fmt: skip
    Console().print(table)


def compile_on_mps(variant) -> None:
    """Compiles one library with torch.mps.compile_shader as the backend does (kernels.library) and builds each of
    its kernels' pipelines (what a first launch would build)."""
    from ..ops.metal import kernels

    lib = kernels.library(torch.device("mps"), *variant)
    for kernel in dir(lib):
        lib.limits(kernel)


def check_on_linux(variant) -> None:
    """The Linux compile checks of one library, as the emulator runs them before it builds one (at its MSL 3.2):
    the MSL-subset parser and clang's address-space check."""
    from ..ops.metal import kernels, variants
    from ..ops.metal.emulator.address_spaces import check_address_spaces
    from ..ops.metal.emulator.msl_subset import check_msl_subset
    from ..ops.metal.emulator.parse import parse_kernels, strip_comments

    name, source = variants.variant_name(variant), kernels.stage_source(*variant)
    found, tg_decls = parse_kernels(source)
    check_msl_subset(source, strip_comments(source), found, name)
    check_address_spaces(source, tg_decls, name)


def check_every_variant(check: Callable) -> Tuple[int, Dict[str, str], float]:
    """Runs `check` on every library of variants.checked_variants (what the Linux checks and the macOS workflow
    compile). Returns (libraries, failures as library name -> the compiler's message, seconds)."""
    from ..ops.metal import variants

    start, count, failures = time.perf_counter(), 0, {}
    for variant in variants.checked_variants():
        count += 1
        try:
            check(variant)
        except Exception as e:  # a compile error: reported by name, the rest still compiled
            failures[variants.variant_name(variant)] = f"{type(e).__name__}: {e}"
    return count, failures, time.perf_counter() - start


def all_variants(device: torch.device) -> int:
    """--all-variants: every checked library compiled with Apple's compiler on MPS; elsewhere the Linux checks."""
    from ..ops.metal.emulator.address_spaces import clang

    if device.type == "mps":
        how, check = "compiled with torch.mps.compile_shader", compile_on_mps
    elif clang() is not None:
        print("--all-variants: compiling with Apple's compiler needs a Mac with MPS; running the Linux checks "
              "instead (the MSL-subset parser and clang's address-space check) on the same libraries")  # fmt: skip
        how, check = "checked (MSL subset, address spaces)", check_on_linux
    else:
        print("--all-variants: compiling with Apple's compiler needs a Mac with MPS, and the Linux checks need "
              "clang++ (scripts/setup.sh installs it); nothing checked", file=sys.stderr)  # fmt: skip
        return 2
    count, failures, seconds = check_every_variant(check)
    for name, message in failures.items():
        print(f"FAILED {name}: {message}")
    print(f"{count - len(failures)}/{count} libraries of checked_variants {how} in {seconds:.1f} s"
          + (f": {len(failures)} FAILED, please report" if failures else ""))  # fmt: skip
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="splat-metal-doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["auto", "mps", "cuda", "cpu"], default="auto")
    parser.add_argument("--size", default="61x37", help="image WIDTHxHEIGHT of the test scene (keep it non-square)")
    parser.add_argument(
        "--emit-metal",
        metavar="DIR",
        help="write each assembled kernel library the compile checks build to DIR/*.metal, and the -std level of "
        "each MSL version torch compiles at to DIR/std_levels.txt, and exit (for compile checks with `xcrun metal`)",
    )
    parser.add_argument(
        "--all-variants",
        action="store_true",
        help="compile every library of the compile checks (ops/metal/variants.py checked_variants: every stage, tile "
        "size, strip, channel count and option on its axis) instead of checking the standard ones against the "
        "reference; on a Mac with torch.mps.compile_shader, elsewhere with the Linux checks; exits 1 on a failure",
    )
    args = parser.parse_args(argv)
    if args.emit_metal:
        from pathlib import Path

        from ..ops.metal import kernels, variants

        out = Path(args.emit_metal)
        out.mkdir(parents=True, exist_ok=True)
        for name, source in kernels.all_sources().items():
            (out / f"{name}.metal").write_text(source)
            print(out / f"{name}.metal")
        (out / "std_levels.txt").write_text("".join(f"{variants.MSL_STD[v]}\n" for v in variants.MSL_VERSIONS))
        return 0
    width, height = (int(v) for v in args.size.lower().split("x"))
    if args.device == "auto":
        from ..ops import best_device

        args.device = best_device().type
    device = torch.device(args.device)
    if device.type == "mps" and not torch.backends.mps.is_available():
        print("--device mps: this machine has no usable MPS device (torch sees no Apple GPU); leave the option "
              "out to check the best device here, or use --device cpu", file=sys.stderr)  # fmt: skip
        return 2
    for key, value in facts(device).items():
        print(f"{key:>28}: {value}")
    if args.all_variants:
        return all_variants(device)

    from rich.progress import Progress

    from ..ops import reference

    with Progress(transient=True) as progress:
        task = progress.add_task("checking kernels", total=None)
        if device.type == "cuda":
            checks = full_op_checks(device, "gsplat", width, height)
        else:
            from ..ops import metal
            from ..ops.metal import kernels

            progress.update(task, description="compiling every Metal kernel")
            compiled, ms = _timed(lambda: sum(1 for _ in kernels.compile_all(device)), device)
            checks = [Check(f"compile {compiled} kernels", "-", 0.0, 0.0, ms, compiled > 0)]
            progress.update(task, description="running stages forward and backward")
            # Every standard rasterizer variant (depth only, RGB, RGB+depth), with absgrad as training uses it.
            checks += stage_checks(device, metal, reference, width, height, channels=(1, 3, 4), absgrad=True)
            # The fused preparation training renders SH colours with (ops/metal/prepare.py), at the highest degree.
            checks += [c for mode in ("classic", "antialiased") for c in prepare_checks(device, SH_MAX_DEGREE, mode)]
            checks += covariance_checks(device, "metal")
            checks += loss_checks(device)
            checks += adam_checks(device)  # the gaussians' fused Adam (engine/optimizers.py)
        from ..ops.cpu import available

        if available():  # the native CPU backend (what "auto" uses for CPU tensors)
            progress.update(task, description="checking the native cpu backend")
            checks += full_op_checks(torch.device("cpu"), "cpu", width, height)
            checks += covariance_checks(torch.device("cpu"), "cpu")
    _print_table(checks)
    if device.type != "cuda":  # the Metal kernels ran: on MPS as this GPU compiled them, else the emulator's limits
        _print_pipelines(device)
    bad = [c for c in checks if not c.ok]
    print(f"{len(checks) - len(bad)}/{len(checks)} checks passed" + (": MISMATCH, please report" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
