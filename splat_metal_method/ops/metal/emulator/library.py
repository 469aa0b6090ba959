"""Compile .metal source with g++ against msl_shim.h and launch its kernels on CPU tensors.

See the package docstring for the supported MSL subset.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

SHIM_DIR = Path(__file__).resolve().parent
MAX_THREADS_PER_GROUP = 1024
MAX_THREADGROUP_MEMORY = 32 * 1024

_CXX = os.environ.get("CXX", "g++")
_FLAGS = [
    "-std=c++17", "-O2", "-fPIC", "-shared", "-pthread",
    "-Wno-attributes",  # [[buffer(0)]] and friends are unknown to g++ and ignored
    "-ffp-contract=off",  # no silent fma contraction: torch.mps.compile_shader has fast-math off
    "-U_FORTIFY_SOURCE",  # fortified longjmp refuses to jump between fiber stacks
]
_GCC_ONLY_FLAGS = ["-fsingle-precision-constant"]  # `0.5` is a float literal in MSL, not a double


class EmulatorError(RuntimeError):
    """A kernel was launched wrongly, or misbehaved in a way Metal leaves undefined."""


class MetalCompileError(EmulatorError):
    """g++ rejected the kernel source; the message carries its diagnostics (file:line of the .metal)."""


# ---------------------------------------------------------------------------------------------
# Parsing: find kernels, their params and threadgroup arrays
# ---------------------------------------------------------------------------------------------
_POSITION_FIELDS = {  # attribute -> expression over `const msl_emu::Pos& p`
    "thread_position_in_grid": "p.tpig",
    "thread_position_in_threadgroup": "p.tpt",
    "threadgroup_position_in_grid": "p.tgp",
    "threads_per_threadgroup": "p.tptg",
    "dispatch_threads_per_threadgroup": "p.dtptg",
    "threads_per_grid": "p.tpgrid",
    "threadgroups_per_grid": "p.tgpg",
}
_SCALAR_FIELDS = {
    "thread_index_in_threadgroup": "p.tidx",
    "thread_index_in_simdgroup": "p.lane",
    "simdgroup_index_in_threadgroup": "p.sgidx",
    "simdgroups_per_threadgroup": "p.nsg",
    "threads_per_simdgroup": "32u",
    "thread_execution_width": "32u",
}
_INT64_REF_TYPES = {"long", "int64_t", "ulong", "uint64_t", "bool"}
_QUALIFIERS = {"device", "constant", "const", "volatile", "thread", "metal"}
# pointee scalar type -> tensor dtypes allowed behind it (unknown types, e.g. structs, accept any)
_DTYPES = {
    "float": {torch.float32}, "int": {torch.int32}, "uint": {torch.int32, torch.uint32},
    "long": {torch.int64}, "ulong": {torch.int64, torch.uint64}, "int64_t": {torch.int64},
    "short": {torch.int16}, "ushort": {torch.int16, torch.uint16}, "char": {torch.int8},
    "uchar": {torch.uint8, torch.bool}, "bool": {torch.bool, torch.uint8}, "half": {torch.float16},
}


@dataclass
class Param:
    text: str  # the declaration as written, without its attribute
    type: str  # e.g. "device const float*"
    name: str
    attr: str  # "buffer", a position attribute name, or "" (none)
    index: int | None = None  # the i of [[buffer(i)]]
    kind: str = ""  # buffers: "tensor" | "int" | "float"
    scalar: str | None = None  # pointee scalar type name for dtype checks ("float", "int", ...)


@dataclass
class Kernel:
    name: str
    params: list[Param]
    buffers: list[Param]  # sorted by buffer index
    tg_arrays: list[tuple[str, str, str]]  # (type, name, dims) of `threadgroup T name[dims];`


def _strip_comments(src: str) -> str:
    """Blank out comments and string literals, keeping offsets and newlines."""

    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', blank, src, flags=re.S)


def _matching(src: str, i: int, open_c: str, close_c: str) -> int:
    """Index of the bracket closing the one at src[i]."""
    depth = 0
    for j in range(i, len(src)):
        if src[j] == open_c:
            depth += 1
        elif src[j] == close_c:
            depth -= 1
            if depth == 0:
                return j
    raise EmulatorError(f"unbalanced {open_c!r} at offset {i}")


def _split_top_level(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([<":
            depth += 1
        elif ch in ")]>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p.strip() for p in parts]


def _base_type(type_text: str) -> str:
    words = [w for w in re.findall(r"[A-Za-z_][\w:]*", type_text) if w not in _QUALIFIERS]
    return words[-1].split("::")[-1] if words else ""


def _scalar_of(base: str) -> str | None:
    m = re.fullmatch(r"(?:packed_)?([a-z]+?)(?:[234](?:x[234])?)?", base)
    if m and m.group(1) in _DTYPES:
        return m.group(1)
    m = re.fullmatch(r"atomic_(int|uint|float)", base)
    return m.group(1) if m else None


def _parse_param(kname: str, text: str) -> Param:
    m = re.search(r"\[\[\s*(\w+)\s*(?:\(\s*(\d+)\s*\))?\s*\]\]", text)
    attr, idx = (m.group(1), m.group(2)) if m else ("", None)
    decl = (text[: m.start()] + text[m.end():]).strip() if m else text
    nm = re.search(r"(\w+)\s*$", decl)
    if not nm:
        raise EmulatorError(f"[{kname}] cannot parse parameter {text!r}")
    name, type_ = nm.group(1), decl[: nm.start()].strip()
    p = Param(text=decl, type=type_, name=name, attr=attr)
    if attr == "buffer":
        p.index = int(idx)
        if re.search(r"\bthreadgroup\b", type_):
            raise EmulatorError(f"[{kname}] threadgroup pointer params are not supported: {text!r}")
        base = _base_type(type_)
        p.scalar = _scalar_of(base)
        if type_.endswith("*"):
            p.kind = "tensor"
        elif type_.endswith("&"):
            p.kind = "int" if base in _INT64_REF_TYPES else "float" if base == "float" else "tensor"
        else:
            raise EmulatorError(f"[{kname}] buffer param {name!r} must be a pointer or a reference, got {text!r}")
    elif attr in _POSITION_FIELDS or attr in _SCALAR_FIELDS:
        pass
    else:
        raise EmulatorError(f"[{kname}] unsupported kernel parameter {text!r} "
                            "(supported: [[buffer(i)]] and the position attributes)")
    return p


_TG_DECL = re.compile(r"\bthreadgroup\s+((?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;<>]*>)?)\s+(\w+)\s*"
                      r"((?:\[[^\]]+\]\s*)*);")
_TG_POINTER = re.compile(r"\bthreadgroup\s+(?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;<>]*>)?\s*(?:const\s*)?[*&]")


def parse_kernels(source: str) -> tuple[dict[str, Kernel], list[int]]:
    """Kernels of `source`, and the offsets of the `threadgroup` keywords that declare shared arrays.

    Every `threadgroup` must be either such a declaration in a kernel body (it becomes
    `static thread_local`: shared by the group's fibers) or a pointer/reference type, e.g. a helper's
    `threadgroup float* sh` param (the keyword then expands to nothing). Anything else is refused,
    because it would silently become a per-thread variable.
    """
    clean = _strip_comments(source)
    kernels: dict[str, Kernel] = {}
    decl_offsets: list[int] = []
    for m in re.finditer(r"\bkernel\s+void\s+(\w+)\s*\(", clean):
        name = m.group(1)
        close = _matching(clean, m.end() - 1, "(", ")")
        params = [_parse_param(name, t) for t in _split_top_level(clean[m.end(): close])]
        body_open = clean.index("{", close)
        body_close = _matching(clean, body_open, "{", "}")
        buffers = sorted((p for p in params if p.attr == "buffer"), key=lambda p: p.index)
        if [p.index for p in buffers] != list(range(len(buffers))):
            raise EmulatorError(f"[{name}] buffer indices must be 0..n-1 without gaps, got "
                                f"{[p.index for p in buffers]}")
        decls = list(_TG_DECL.finditer(clean, body_open, body_close))
        decl_offsets += [d.start() for d in decls]
        if name in kernels:
            raise EmulatorError(f"kernel {name!r} is defined twice")
        kernels[name] = Kernel(name, params, buffers, [(d.group(1), d.group(2), d.group(3).strip()) for d in decls])
    declared = set(decl_offsets)
    for t in re.finditer(r"\bthreadgroup\b", clean):
        if t.start() not in declared and not _TG_POINTER.match(clean, t.start()):
            line = clean.count("\n", 0, t.start()) + 1
            raise EmulatorError(
                f"unsupported use of `threadgroup` at line {line} of the assembled source: "
                f"{clean[t.start():clean.find(chr(10), t.start())].strip()!r}. Declare shared memory as "
                "`threadgroup T name[N];` (one array per statement) in a kernel body; elsewhere use it only "
                "on pointer/reference types")
    return kernels, decl_offsets


def uses_fibers(source: str) -> bool:
    """Kernels that never synchronise run as plain loops; anything else gets one fiber per thread."""
    return re.search(r"\b(threadgroup_barrier|simdgroup_barrier|simd_\w+|quad_\w+)\s*\(",
                     _strip_comments(source)) is not None


def _wrapper(k: Kernel) -> str:
    args = []
    for p in k.params:
        if p.attr == "buffer" and p.type.endswith("*"):
            args.append(f"({p.type})a[{p.index}]")
        elif p.attr == "buffer":
            args.append(f"*(std::remove_reference_t<{p.type}>*)a[{p.index}]")
        elif p.attr in _POSITION_FIELDS:
            args.append(f"msl_emu::pos_as<{p.type}>({_POSITION_FIELDS[p.attr]})")
        else:
            args.append(f"({p.type})({_SCALAR_FIELDS[p.attr]})")
    tg = " + ".join(f"sizeof({t}{d})" for t, _, d in k.tg_arrays) or "0"
    return (
        f"static void msl_body_{k.name}(void** a, const msl_emu::Pos& p) {{\n"
        f"  (void)a; (void)p;\n  {k.name}({', '.join(args)});\n}}\n"
        f'extern "C" int launch_{k.name}(void** a, const int64_t* grid, const int64_t* group, int nt, int fib) {{\n'
        f"  return msl_emu::dispatch(msl_body_{k.name}, a, grid, group, nt, fib);\n}}\n"
        f'extern "C" int64_t tgmem_{k.name}() {{ return int64_t({tg}); }}\n'
    )


# ---------------------------------------------------------------------------------------------
# Compiling and caching
# ---------------------------------------------------------------------------------------------
_compile_count = 0
_loaded: dict[str, "EmulatorLibrary"] = {}
_lock = threading.Lock()


def compile_count() -> int:
    """How many times this process has run the C++ compiler (cache misses)."""
    return _compile_count


def cache_dir() -> Path:
    d = os.environ.get("SPLAT_METAL_CACHE_DIR") or os.path.join(Path.home(), ".cache", "splat_metal", "emulator")
    return Path(d)


@functools.lru_cache(maxsize=None)
def _flags() -> list[str]:
    out = subprocess.run([_CXX, "--version"], capture_output=True, text=True).stdout
    return _FLAGS + (["-Wno-unknown-attributes", "-Wno-deprecated-declarations"] if "clang" in out
                     else _GCC_ONLY_FLAGS)


def _shim_text() -> str:
    return "".join(f.read_text() for f in sorted(SHIM_DIR.iterdir())
                   if f.is_file() and (not f.suffix or f.suffix == ".h"))


def compile_library(source: str, name: str = "kernels") -> "EmulatorLibrary":
    """Compile `source` (MSL) to a cached shared library and return its kernels.

    `name` only labels diagnostics when the source carries no `#line` directive of its own.
    """
    global _compile_count
    if shutil.which(_CXX) is None:
        raise EmulatorError(f"the MSL emulator needs a C++ compiler ({_CXX!r} not found; set $CXX)")
    kernels, tg_decls = parse_kernels(source)
    fibers = uses_fibers(source)
    for off in sorted(tg_decls, reverse=True):  # shared-array declarations become static thread_local
        source = source[:off] + "msl_tg_shared" + source[off + len("threadgroup"):]
    flags = _flags()
    prefix = "" if source.lstrip().startswith("#line") else f'#line 1 "{name}"\n'
    cpp = (
        prefix + source + "\n\n"
        '#line 1 "<emulator-generated launch wrappers>"\n'
        "#include <type_traits>\nusing namespace metal;\n" + "".join(_wrapper(k) for k in kernels.values())
        + 'extern "C" const char* msl_emu_last_error() { return msl_emu::last_error.c_str(); }\n'
    )
    key = hashlib.sha256("\0".join([cpp, _shim_text(), _CXX, *flags]).encode()).hexdigest()[:24]
    with _lock:
        if key in _loaded:
            return _loaded[key]
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        so = d / f"{key}.so"
        if not so.exists():
            with tempfile.TemporaryDirectory(dir=d) as tmp:
                src_path = Path(tmp) / f"{key}.cpp"
                src_path.write_text(cpp)
                tmp_so = Path(tmp) / f"{key}.so"
                cmd = [_CXX, *flags, "-I", str(SHIM_DIR), "-x", "c++", str(src_path), "-o", str(tmp_so)]
                _compile_count += 1
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


_KIND_WORDS = {"tensor": "a tensor", "int": "an int", "float": "a float"}
_KIND_DECL = {"tensor": "a device/constant pointer", "int": "`constant long&` (int64)",
              "float": "`constant float&` (float32)"}


class EmulatorKernel:
    def __init__(self, lib: "EmulatorLibrary", k: Kernel):
        self._lib, self._k = lib, k
        self._fn = getattr(lib._dll, f"launch_{k.name}")
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        self._fn.restype = ctypes.c_int
        tg = getattr(lib._dll, f"tgmem_{k.name}")
        tg.restype = ctypes.c_int64
        self.threadgroup_memory = int(tg())

    def __call__(self, *args, threads=None, group_size=None):
        k = self._k
        if threads is None or group_size is None:
            raise EmulatorError(f"[{k.name}] pass both threads= and group_size= (the emulator does not guess)")
        grid, group = _dims(k.name, "threads", threads), _dims(k.name, "group_size", group_size)
        if len(grid) != len(group):
            raise EmulatorError(f"[{k.name}] threads {grid} and group_size {group} must have the same rank")
        if 0 in group:
            raise EmulatorError(f"[{k.name}] group_size must be positive, got {group}")
        n_group = group[0] * (group[1] if len(group) > 1 else 1) * (group[2] if len(group) > 2 else 1)
        if n_group > MAX_THREADS_PER_GROUP:
            raise EmulatorError(f"[{k.name}] group_size {group} has {n_group} threads; Metal allows at most "
                                f"{MAX_THREADS_PER_GROUP} per threadgroup")
        if self.threadgroup_memory > MAX_THREADGROUP_MEMORY:
            raise EmulatorError(f"[{k.name}] declares {self.threadgroup_memory} bytes of threadgroup memory; "
                                f"Metal allows at most {MAX_THREADGROUP_MEMORY}")
        if len(args) != len(k.buffers):
            raise EmulatorError(f"[{k.name}] expects {len(k.buffers)} arguments "
                                f"({', '.join(p.name for p in k.buffers)}), got {len(args)}")
        slots = (ctypes.c_void_p * max(1, len(args)))()
        keep = []
        for i, (a, p) in enumerate(zip(args, k.buffers)):
            where = f"[{k.name}] argument {i} ({p.name}: `{p.type}`)"
            got = "tensor" if isinstance(a, torch.Tensor) else "int" if isinstance(a, (bool, int)) else \
                "float" if isinstance(a, float) else None
            if got is None:
                raise EmulatorError(f"{where}: unsupported argument type {type(a).__name__}")
            if got != p.kind:
                raise EmulatorError(f"{where} takes {_KIND_WORDS[p.kind]}, got {_KIND_WORDS[got]} "
                                    f"(a Python {_KIND_WORDS[got]} binds to {_KIND_DECL[got]})")
            if got == "tensor":
                if a.device.type != "cpu":
                    raise EmulatorError(f"{where}: the emulator runs CPU tensors only, got {a.device}")
                if not a.is_contiguous():
                    raise EmulatorError(f"{where}: tensor must be contiguous (Metal ignores strides)")
                if p.scalar is not None and a.dtype not in _DTYPES[p.scalar]:
                    raise EmulatorError(f"{where}: tensor dtype {a.dtype} does not match `{p.scalar}`")
                slots[i] = a.data_ptr()  # data_ptr() already includes the storage offset
            else:
                box = ctypes.c_int64(int(a)) if got == "int" else ctypes.c_float(a)
                keep.append(box)  # must outlive the call
                slots[i] = ctypes.addressof(box)
        pad = (1,) * (3 - len(grid))
        g = (ctypes.c_int64 * 3)(*(grid + pad))
        gs = (ctypes.c_int64 * 3)(*(group + pad))
        rc = self._fn(slots, g, gs, _n_os_threads(), int(self._lib._fibers))
        if rc != 0:
            msg = self._lib._last_error().decode(errors="replace")
            raise EmulatorError(f"[{k.name}] {msg}")

    def __repr__(self) -> str:
        return f"<emulated Metal kernel {self._k.name}({', '.join(p.text for p in self._k.buffers)})>"


class EmulatorLibrary:
    """Kernels of one compiled source, called like torch.mps.compile_shader's library."""

    def __init__(self, dll: ctypes.CDLL, kernels: dict[str, Kernel], fibers: bool):
        self._dll, self._kernels, self._fibers = dll, kernels, fibers
        self._last_error = dll.msl_emu_last_error
        self._last_error.restype = ctypes.c_char_p
        self._cache: dict[str, EmulatorKernel] = {}

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
