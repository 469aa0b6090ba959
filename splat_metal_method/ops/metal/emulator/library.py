"""Compile .metal source with g++ against msl_shim.h and launch its kernels on CPU tensors.

See the package docstring for the supported MSL subset.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import operator
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from . import address_spaces
from .errors import EmulatorError, MetalCompileError
from .msl_subset import check_msl_subset
from .parse import DTYPES, POSITION_FIELDS, SCALAR_FIELDS, Kernel, TgDecl, parse_kernels, strip_comments, uses_fibers

SHIM_DIR = Path(__file__).resolve().parent
MAX_THREADS_PER_GROUP = 1024
MAX_THREADGROUP_MEMORY = 32 * 1024
MAX_THREADGROUP_ARRAYS = 256  # msl_shim.h kMaxTgArrays

_CXX = os.environ.get("CXX", "g++")
_FLAGS = [
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-shared",
    "-pthread",
    "-Wno-attributes",  # [[buffer(0)]] and friends are unknown to g++ and ignored
    "-ffp-contract=off",  # no silent fma contraction: torch.mps.compile_shader has fast-math off
    "-U_FORTIFY_SOURCE",  # fortified longjmp refuses to jump between fiber stacks
    "-Werror=vla",  # variable-length arrays are not MSL
    "-Wno-unknown-pragmas",  # `#pragma METAL fp ...` (common.h): msl_subset.py checks every pragma instead
]
_ASAN_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer", "-O1"]
# Undefined behaviour x86 hides and a GPU may not: float-to-int of NaN/inf/out-of-range values (x86
# gives INT_MIN, an Apple GPU may saturate), signed overflow, oversized shifts, constant-size array
# indices out of range. No recovery: the first report ends the process (exit code 1).
_UBSAN_FLAGS = ["-fsanitize=float-cast-overflow,signed-integer-overflow,shift,bounds", "-fno-sanitize-recover=all"]
# The threadgroup-switch build (tg_switch_enabled): every memory access calls a hook of msl_shim.h, which
# switches threads at each threadgroup-memory access. Compiled with these, linked without them (the shim
# defines the hooks; no ThreadSanitizer runtime). g++ only.
_TG_SWITCH_FLAGS = ["-DMSL_EMU_TG_SWITCH", "-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0"]
# The fp-contraction build (fp_contract_enabled): multiply-adds fused wherever the compiler likes, as Apple's
# compiler may below MSL 3.2 (where common.h's `#pragma METAL fp contract(off)` does not exist: the shim then
# says __METAL_VERSION__ 310). -mfma: x86-64's baseline has no fused multiply-add to contract into.
_FP_CONTRACT_FLAGS = ["-ffp-contract=fast", "-mfma", "-DMSL_EMU_METAL_VERSION=310"]
_GCC_ONLY_FLAGS = ["-fsingle-precision-constant"]  # `0.5` is a float literal in MSL, not a double


def _wrapper(k: Kernel) -> str:
    args = []
    for p in k.params:
        if p.attr == "buffer" and p.type.endswith("*"):
            args.append(f"({p.type})a[{p.index}]")
        elif p.attr == "buffer":
            args.append(f"*(std::remove_reference_t<{p.type}>*)a[{p.index}]")
        elif p.attr in POSITION_FIELDS:
            args.append(f"msl_emu::pos_as<{p.type}>({POSITION_FIELDS[p.attr]})")
        else:
            args.append(f"({p.type})({SCALAR_FIELDS[p.attr]})")
    tg = " + ".join(f"sizeof({t}{d})" for t, _, d in k.tg_arrays) or "0"
    return (
        f"static void msl_body_{k.name}(void** a, const msl_emu::Pos& p) {{\n"
        f"  (void)a; (void)p;\n  {k.name}({', '.join(args)});\n}}\n"
        f'extern "C" int launch_{k.name}(void** a, const int64_t* grid, const int64_t* group, int nt, int fib,\n'
        f"                              uint64_t seed) {{\n"
        f"  return msl_emu::dispatch(msl_body_{k.name}, a, grid, group, nt, fib, seed);\n}}\n"
        f'extern "C" int64_t tgmem_{k.name}() {{ return int64_t({tg}); }}\n'
        f'extern "C" int64_t maxthreads_{k.name}() {{ return int64_t({k.max_threads or 0}); }}\n'
    )


def _shared_arrays(source: str, tg_decls: list[TgDecl]) -> str:
    """Each `threadgroup T a[N];` of a kernel body becomes a reference to the group's poisoned storage
    (msl_emu::tg_array), on the same line."""
    for slot, d in sorted(enumerate(tg_decls), key=lambda e: -e[1].start):
        t = f"msl_tg_type_{slot}"
        source = (
            source[: d.start] + f"using {t} = {d.type}{d.dims}; {t}& {d.name} = "
            f"*static_cast<{t}*>(msl_emu::tg_array({slot}, sizeof({t})));" + source[d.end :]
        )
    return source


# ---------------------------------------------------------------------------------------------
# Compiling and caching
# ---------------------------------------------------------------------------------------------
_compile_count = 0
_loaded: dict[str, "EmulatorLibrary"] = {}
_lock = threading.Lock()


def compile_count() -> int:
    """How many times this process has run the C++ compiler (cache misses)."""
    return _compile_count


def asan_enabled() -> bool:
    """SPLAT_METAL_EMU_ASAN=1 builds every library with AddressSanitizer (see asan_runtime)."""
    return os.environ.get("SPLAT_METAL_EMU_ASAN", "") not in ("", "0")


def ubsan_enabled() -> bool:
    """SPLAT_METAL_EMU_UBSAN=1 (or SPLAT_METAL_EMU_ASAN=1) builds every library with UBSan (_UBSAN_FLAGS).

    The UBSan runtime loads with the library (no LD_PRELOAD); a report ends the process."""
    return os.environ.get("SPLAT_METAL_EMU_UBSAN", "") not in ("", "0") or asan_enabled()


def tg_switch_enabled() -> bool:
    """SPLAT_METAL_EMU_TG_SWITCH=1 builds every library so that a group's threads switch at EVERY access to
    threadgroup memory, not only at barriers and simdgroup ops (msl_shim.h, tg_access): a lost update of a
    non-atomic read-modify-write between barriers shows. Read when a library is compiled (part of its cache
    key), never at import."""
    return os.environ.get("SPLAT_METAL_EMU_TG_SWITCH", "") not in ("", "0")


def fp_contract_enabled() -> bool:
    """SPLAT_METAL_EMU_FP_CONTRACT=1 builds every library with fp contraction on (_FP_CONTRACT_FLAGS), compiled
    as MSL 3.1: what Apple's compiler may do to a kernel on macOS 14 and older. Read when a library is
    compiled (part of its cache key), never at import."""
    return os.environ.get("SPLAT_METAL_EMU_FP_CONTRACT", "") not in ("", "0")


def _cpu_has_fma() -> bool:
    try:
        return " fma " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


def asan_runtime() -> str:
    """Path of the compiler's ASan runtime, which a Python process must LD_PRELOAD to load ASan builds."""
    lib = "libclang_rt.asan-x86_64.so" if "clang" in _compiler_version() else "libasan.so"
    path = subprocess.run([_CXX, f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        raise EmulatorError(
            f"cannot find {lib} of {_CXX!r} (for SPLAT_METAL_EMU_ASAN=1); install the compiler's "
            "AddressSanitizer runtime (Debian: it comes with g++ as libasan)"
        )
    return path


def asan_preload() -> str:
    """LD_PRELOAD for a Python process that loads ASan builds: the ASan runtime, then the C++ runtime where the
    compiler has one. Without the latter ASan aborts ("CHECK failed: asan_interceptors.cpp ... real___cxa_throw")
    when an extension module throws a C++ exception while it is imported, as triton does when torch imports it
    (the step ledger's torch dispatch mode)."""
    preload = [asan_runtime()]
    cxx = subprocess.run([_CXX, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True).stdout.strip()
    if os.path.isabs(cxx) and os.path.exists(cxx):
        preload.append(cxx)
    return " ".join(preload)


def _asan_loaded() -> bool:
    try:
        return "libasan" in Path("/proc/self/maps").read_text() or "asan" in os.environ.get("LD_PRELOAD", "")
    except OSError:  # no /proc (macOS): trust LD_PRELOAD / DYLD_INSERT_LIBRARIES
        return "asan" in os.environ.get("LD_PRELOAD", "") + os.environ.get("DYLD_INSERT_LIBRARIES", "")


def schedule_seed() -> int:
    """The seed of the emulator's thread order (SPLAT_METAL_EMU_SEED, default 0).

    Between two barriers (or simdgroup ops) the threads of a group run in an order shuffled by
    (seed, group, round); an odd seed also changes the poison byte of threadgroup memory (0x7F
    instead of 0xFF). A kernel without races gives the same result under every seed."""
    env = os.environ.get("SPLAT_METAL_EMU_SEED", "").strip()
    try:
        return int(env or 0) & (2**64 - 1)
    except ValueError:
        raise EmulatorError(f"SPLAT_METAL_EMU_SEED must be an integer, got {env!r}") from None


def cache_dir() -> Path:
    d = os.environ.get("SPLAT_METAL_CACHE_DIR") or os.path.join(Path.home(), ".cache", "splat_metal", "emulator")
    return Path(d)


@functools.lru_cache(maxsize=None)
def _compiler_version() -> str:
    return subprocess.run([_CXX, "--version"], capture_output=True, text=True).stdout


def _flags() -> list[str]:
    clang = "clang" in _compiler_version()
    flags = _FLAGS + (["-Wno-unknown-attributes", "-Wno-deprecated-declarations"] if clang else _GCC_ONLY_FLAGS)
    if asan_enabled():
        flags = flags + _ASAN_FLAGS
    if ubsan_enabled():  # clang links its sanitizer runtime into a shared object only with -shared-libsan
        flags = flags + _UBSAN_FLAGS + (["-shared-libsan"] if clang else [])
    if fp_contract_enabled():
        if not _cpu_has_fma():
            raise EmulatorError(
                "SPLAT_METAL_EMU_FP_CONTRACT=1 needs an x86-64 CPU with FMA (Linux /proc/cpuinfo says none)"
            )
        flags = [f for f in flags if f != "-ffp-contract=off"] + _FP_CONTRACT_FLAGS
    if tg_switch_enabled():
        if clang or asan_enabled():
            raise EmulatorError(
                "SPLAT_METAL_EMU_TG_SWITCH=1 needs g++ (its -fsanitize=thread hooks) and no SPLAT_METAL_EMU_ASAN"
            )
        flags = flags + _TG_SWITCH_FLAGS
    return flags


def _shim_text() -> str:
    """Everything a cached library depends on besides its source: the shim, and the address-space check
    (run only when a library is built; the subset check runs on every compile_library)."""
    files = [f for f in sorted(SHIM_DIR.iterdir()) if f.is_file() and (not f.suffix or f.suffix == ".h")]
    checks = [SHIM_DIR / "address_spaces.py", address_spaces.STANDIN_DIR / "metal_stdlib"]
    return "".join(f.read_text() for f in files + checks)


_warned_no_clang = False


def compile_library(source: str, name: str = "kernels") -> "EmulatorLibrary":
    """Compile `source` (MSL) to a cached shared library and return its kernels.

    Runs the MSL subset check first and, when the library is not cached yet, the address-space check
    (clang); both raise MetalCompileError. `name` only labels diagnostics when the source carries no
    `#line` directive of its own.
    """
    global _compile_count, _warned_no_clang
    if shutil.which(_CXX) is None:
        raise EmulatorError(f"the MSL emulator needs a C++ compiler ({_CXX!r} not found; set $CXX)")
    kernels, tg_decls = parse_kernels(source)
    if len(tg_decls) > MAX_THREADGROUP_ARRAYS:
        raise EmulatorError(f"{name}: {len(tg_decls)} threadgroup arrays; the emulator holds {MAX_THREADGROUP_ARRAYS}")
    check_msl_subset(source, strip_comments(source), kernels, name)
    fibers = uses_fibers(source) or tg_switch_enabled()  # a switch needs a fiber per thread
    flags = _flags()
    if asan_enabled() and not _asan_loaded():
        raise EmulatorError(
            "SPLAT_METAL_EMU_ASAN=1: AddressSanitizer builds load only into a process started with "
            f"LD_PRELOAD='{asan_preload()}' (and ASAN_OPTIONS=detect_leaks=0 for Python)"
        )
    check_spaces = address_spaces.clang() is not None
    if not check_spaces and not _warned_no_clang:
        _warned_no_clang = True
        warnings.warn(
            "clang++ not found: the MSL emulator skips its address-space check (scripts/setup.sh installs clang)",
            stacklevel=2,
        )
    original = source
    source = _shared_arrays(source, tg_decls)
    prefix = "" if source.lstrip().startswith("#line") else f'#line 1 "{name}"\n'
    cpp = (
        prefix + source + "\n\n"
        '#line 1 "<emulator-generated launch wrappers>"\n'
        "#include <type_traits>\nusing namespace metal;\n"
        + "".join(_wrapper(k) for k in kernels.values())
        + 'extern "C" const char* msl_emu_last_error() { return msl_emu::last_error.c_str(); }\n'
        + 'extern "C" void msl_emu_counters(int64_t* out) { msl_emu::read_counters(out); }\n'
    )
    key = hashlib.sha256("\0".join([cpp, _shim_text(), _CXX, *flags, str(check_spaces)]).encode()).hexdigest()[:24]
    with _lock:
        if key in _loaded:
            return _loaded[key]
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        so = d / f"{key}.so"
        if not so.exists():
            if check_spaces:
                address_spaces.check_address_spaces(original, tg_decls, name)
            with tempfile.TemporaryDirectory(dir=d) as tmp:
                src_path = Path(tmp) / f"{key}.cpp"
                src_path.write_text(cpp)
                tmp_so = Path(tmp) / f"{key}.so"
                source_args = ["-I", str(SHIM_DIR), "-x", "c++", str(src_path)]
                steps = [[_CXX, *flags, *source_args, "-o", str(tmp_so)]]
                if tg_switch_enabled():  # an instrumented object, then a shared object without the TSan runtime
                    obj = str(Path(tmp) / f"{key}.o")
                    steps = [[_CXX, "-c", *(f for f in flags if f != "-shared"), *source_args, "-o", obj],
                             [_CXX, "-shared", "-pthread", "-Wl,-Bsymbolic", obj, "-o", str(tmp_so)]]  # fmt: skip
                _compile_count += 1
                for cmd in steps:
                    res = subprocess.run(cmd, capture_output=True, text=True)
                    if res.returncode != 0:
                        raise MetalCompileError(f"MSL emulator: compiling {name!r} failed:\n{res.stderr}")
                os.replace(tmp_so, so)  # atomic: concurrent processes never see a half-written .so
        lib = EmulatorLibrary(ctypes.CDLL(str(so)), kernels, fibers)
        _loaded[key] = lib
        return lib


# ---------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------
def _n_os_threads() -> int:
    env = os.environ.get("SPLAT_METAL_EMU_THREADS")
    return int(env) if env else min(os.cpu_count() or 1, 8)


def _dims(kname: str, what: str, v) -> tuple[int, ...]:
    try:
        t = tuple(operator.index(x) for x in ((v,) if not hasattr(v, "__len__") else v))
    except TypeError:
        t = ()
    if not 1 <= len(t) <= 3 or not all(0 <= x < 2**32 for x in t):
        raise EmulatorError(f"[{kname}] {what} must be an int or a tuple of 1-3 ints in [0, 2**32), got {v!r}")
    return t


_KIND_WORDS = {"tensor": "a tensor", "int": "an int", "float": "a float", "list": "a list"}
# torch.mps.compile_shader packs a list/tuple of numbers into ONE setBytes argument, typed by its first element: ints
# (bool included) as int64, floats as float32 (docs/design.md, platform facts). Apple documents setBytes for data
# up to 4 KB: the emulator refuses a longer list.
SET_BYTES_LIMIT = 4096
_LIST_DECL = {"int": ("long", "ulong"), "float": ("float",)}


def _packed_list(where: str, values, p) -> ctypes.Array:
    """The setBytes array torch binds for a Python list/tuple `values` at parameter `p`; refuses what torch refuses
    and a declaration that would read the bytes as another type."""
    if len(values) == 0:
        raise EmulatorError(f"{where}: an empty list (torch.mps.compile_shader refuses it)")
    first = values[0]
    if isinstance(first, torch.Tensor):
        raise EmulatorError(
            f"{where}: a list of tensors (torch >= 2.8 binds their GPU addresses without making them resident or "
            "hazard-tracked; the emulator does not run it): bind each tensor to its own [[buffer(i)]]"
        )
    kind = "int" if isinstance(first, (bool, int)) else "float" if isinstance(first, float) else None
    if kind is None:
        raise EmulatorError(f"{where}: a list of {type(first).__name__} (torch packs lists of ints or of floats)")
    try:  # torch casts every element like its first (pybind11): an int list refuses floats, a float list takes ints
        cast = [operator.index(v) if kind == "int" else float(v) for v in values]
        if kind == "float" and any(isinstance(v, (str, bytes)) for v in values):
            raise TypeError
        box = (ctypes.c_int64 if kind == "int" else ctypes.c_float) * len(cast)
        packed = box(*cast)
    except (TypeError, OverflowError):
        raise EmulatorError(
            f"{where}: a list whose first element is {_KIND_WORDS[kind]} packs every element as "
            f"{'int64' if kind == 'int' else 'float32'}; {values!r} has one that is not (torch raises a cast error)"
        ) from None
    if ctypes.sizeof(packed) > SET_BYTES_LIMIT:
        raise EmulatorError(
            f"{where}: a list of {len(cast)} {kind}s is {ctypes.sizeof(packed)} bytes; Metal's setBytes takes at "
            f"most {SET_BYTES_LIMIT}: pass a tensor"
        )
    if not (p.kind == "tensor" and p.type.endswith("*") and p.constant and p.base in _LIST_DECL[kind]):
        want = "constant long*" if kind == "int" else "constant float*"
        raise EmulatorError(
            f"{where}: a list of {kind}s binds as {'int64' if kind == 'int' else 'float32'} elements; declare `{want}`"
        )
    return packed


_KIND_DECL = {
    "tensor": "a device/constant pointer",
    "int": "`constant long&` (int64)",
    "float": "`constant float&` (float32)",
}


class EmulatorKernel:
    def __init__(self, lib: "EmulatorLibrary", k: Kernel):
        self._lib, self._k = lib, k
        self._fn = getattr(lib._dll, f"launch_{k.name}")
        self._fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_uint64,
        ]
        self._fn.restype = ctypes.c_int
        tg = getattr(lib._dll, f"tgmem_{k.name}")
        tg.restype = ctypes.c_int64
        self.threadgroup_memory = int(tg())
        mt = getattr(lib._dll, f"maxthreads_{k.name}")
        mt.restype = ctypes.c_int64
        # What torch.mps.compile_shader's kernels report about their pipeline. maxTotalThreadsPerThreadgroup is
        # what the source declares ([[max_total_threads_per_threadgroup(N)]], else 1024); on a GPU it can be
        # lower still (register use), which only the Mac-side doctor can see.
        self.max_threads_per_threadgroup = int(mt()) or MAX_THREADS_PER_GROUP
        self.max_total_threads_per_threadgroup = self.max_threads_per_threadgroup
        self.thread_execution_width = 32
        self.static_thread_group_memory_length = self.threadgroup_memory
        if not 1 <= self.max_threads_per_threadgroup <= MAX_THREADS_PER_GROUP:
            raise EmulatorError(
                f"[{k.name}] [[max_total_threads_per_threadgroup({k.max_threads})]] is "
                f"{self.max_threads_per_threadgroup}; Metal allows 1..{MAX_THREADS_PER_GROUP}"
            )

    def __call__(self, *args, threads=None, group_size=None):
        k = self._k
        if threads is None or group_size is None:
            raise EmulatorError(f"[{k.name}] pass both threads= and group_size= (the emulator does not guess)")
        grid, group = _dims(k.name, "threads", threads), _dims(k.name, "group_size", group_size)
        if len(grid) != len(group):
            raise EmulatorError(f"[{k.name}] threads {grid} and group_size {group} must have the same rank")
        if 0 in group or 0 in grid:
            raise EmulatorError(
                f"[{k.name}] threads {grid} and group_size {group} must be positive in every dimension: "
                "Metal's validation refuses an empty dispatch (skip the launch when there is no work)"
            )
        n_group = group[0] * (group[1] if len(group) > 1 else 1) * (group[2] if len(group) > 2 else 1)
        if n_group > MAX_THREADS_PER_GROUP:
            raise EmulatorError(
                f"[{k.name}] group_size {group} has {n_group} threads; Metal allows at most "
                f"{MAX_THREADS_PER_GROUP} per threadgroup"
            )
        if n_group > self.max_threads_per_threadgroup:
            raise EmulatorError(
                f"[{k.name}] group_size {group} has {n_group} threads, more than the kernel's "
                f"[[max_total_threads_per_threadgroup({self.max_threads_per_threadgroup})]] "
                "(torch.mps.compile_shader raises ValueError on a Mac)"
            )
        if self.threadgroup_memory > MAX_THREADGROUP_MEMORY:
            raise EmulatorError(
                f"[{k.name}] declares {self.threadgroup_memory} bytes of threadgroup memory; "
                f"Metal allows at most {MAX_THREADGROUP_MEMORY}"
            )
        if len(args) != len(k.buffers):
            raise EmulatorError(
                f"[{k.name}] expects {len(k.buffers)} arguments "
                f"({', '.join(p.name for p in k.buffers)}), got {len(args)}"
            )
        slots = (ctypes.c_void_p * max(1, len(args)))()
        keep = []
        for i, (a, p) in enumerate(zip(args, k.buffers)):
            where = f"[{k.name}] argument {i} ({p.name}: `{p.type}`)"
            if isinstance(a, (list, tuple)):
                box = _packed_list(where, a, p)
                keep.append(box)  # must outlive the call
                slots[i] = ctypes.addressof(box)
                continue
            got = (
                "tensor"
                if isinstance(a, torch.Tensor)
                else "int"
                if isinstance(a, (bool, int))
                else "float"
                if isinstance(a, float)
                else None
            )
            if got is None:
                raise EmulatorError(f"{where}: unsupported argument type {type(a).__name__}")
            if got != p.kind:
                raise EmulatorError(
                    f"{where} takes {_KIND_WORDS[p.kind]}, got {_KIND_WORDS[got]} "
                    f"(a Python {_KIND_WORDS[got]} binds to {_KIND_DECL[got]})"
                )
            if got == "tensor":
                if a.device.type != "cpu":
                    raise EmulatorError(f"{where}: the emulator runs CPU tensors only, got {a.device}")
                if not a.is_contiguous():
                    raise EmulatorError(f"{where}: tensor must be contiguous (Metal ignores strides)")
                if p.scalar is not None and a.dtype not in DTYPES[p.scalar]:
                    raise EmulatorError(f"{where}: tensor dtype {a.dtype} does not match `{p.scalar}`")
                slots[i] = a.data_ptr()  # data_ptr() already includes the storage offset
            else:
                box = ctypes.c_int64(int(a)) if got == "int" else ctypes.c_float(a)
                keep.append(box)  # must outlive the call
                slots[i] = ctypes.addressof(box)
        pad = (1,) * (3 - len(grid))
        g = (ctypes.c_int64 * 3)(*(grid + pad))
        gs = (ctypes.c_int64 * 3)(*(group + pad))
        rc = self._fn(slots, g, gs, _n_os_threads(), int(self._lib._fibers), schedule_seed())
        if rc != 0:
            msg = self._lib._last_error().decode(errors="replace")
            raise EmulatorError(f"[{k.name}] {msg}")

    def __repr__(self) -> str:
        return f"<emulated Metal kernel {self._k.name}({', '.join(p.text for p in self._k.buffers)})>"


# The shim's work counters, in the order of its `enum Count`.
WORK_COUNTERS = ("simd_reductions", "simd_shuffles", "device_atomics", "threadgroup_atomics", "barriers",
                 "simd_reduction_ops")  # fmt: skip


class EmulatorLibrary:
    """Kernels of one compiled source, called like torch.mps.compile_shader's library."""

    def __init__(self, dll: ctypes.CDLL, kernels: dict[str, Kernel], fibers: bool):
        self._dll, self._kernels, self._fibers = dll, kernels, fibers
        self._last_error = dll.msl_emu_last_error
        self._last_error.restype = ctypes.c_char_p
        self._cache: dict[str, EmulatorKernel] = {}

    def work_counters(self) -> dict[str, int]:
        """Totals of the shim's work counters over every launch of this library so far (see Count in
        msl_shim.h): simdgroup reductions (scalar components), simdgroup shuffles/votes, device and
        threadgroup atomics, threadgroup barriers. The step ledger diffs them around each launch."""
        out = (ctypes.c_int64 * len(WORK_COUNTERS))()
        self._dll.msl_emu_counters(out)
        return dict(zip(WORK_COUNTERS, out))

    def __getattr__(self, name: str) -> EmulatorKernel:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._kernels:
            raise AttributeError(f"no kernel {name!r} in this library (kernels: {sorted(self._kernels)})")
        if name not in self._cache:
            self._cache[name] = EmulatorKernel(self, self._kernels[name])
        return self._cache[name]

    def __dir__(self):
        return sorted(self._kernels)
