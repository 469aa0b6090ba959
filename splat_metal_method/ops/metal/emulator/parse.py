"""Parsing the MSL source: kernels, their parameters and threadgroup arrays.

Regex- and bracket-based (the emulator's kernel-author rules keep the source simple enough), always
over the source with comments and string literals blanked, so offsets stay valid in the original.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .errors import EmulatorError

POSITION_FIELDS = {  # attribute -> expression over `const msl_emu::Pos& p`
    "thread_position_in_grid": "p.tpig",
    "thread_position_in_threadgroup": "p.tpt",
    "threadgroup_position_in_grid": "p.tgp",
    "threads_per_threadgroup": "p.tptg",
    "dispatch_threads_per_threadgroup": "p.dtptg",
    "threads_per_grid": "p.tpgrid",
    "threadgroups_per_grid": "p.tgpg",
}
SCALAR_FIELDS = {
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
DTYPES = {
    "float": {torch.float32},
    "int": {torch.int32},
    "uint": {torch.int32, torch.uint32},
    "long": {torch.int64},
    "ulong": {torch.int64, torch.uint64},
    "int64_t": {torch.int64},
    "short": {torch.int16},
    "ushort": {torch.int16, torch.uint16},
    "char": {torch.int8},
    "uchar": {torch.uint8, torch.bool},
    "bool": {torch.bool, torch.uint8},
    "half": {torch.float16},
}


@dataclass
class Param:
    text: str  # the declaration as written, without its attribute
    type: str  # e.g. "device const float*"
    name: str
    attr: str  # "buffer", a position attribute name, or "" (none)
    index: int | None = None  # the i of [[buffer(i)]]
    kind: str = ""  # buffers: "tensor" | "int" | "float"
    constant: bool = False  # a pointer into the constant address space (a packed list of numbers may bind here)
    base: str = ""  # buffers: the declared type without qualifiers, `*` and `&` ("long", "float4", a struct)
    scalar: str | None = None  # pointee scalar type name for dtype checks ("float", "int", ...)


@dataclass
class TgDecl:  # `threadgroup T name[dims];` at source[start:end]
    start: int
    end: int
    type: str
    name: str
    dims: str


@dataclass
class Kernel:
    name: str
    params: list[Param]
    buffers: list[Param]  # sorted by buffer index
    tg_arrays: list[tuple[str, str, str]]  # (type, name, dims) of `threadgroup T name[dims];`
    attrs: list[tuple[str, str]]  # kernel attributes: (name, argument text), e.g. max_total_threads_per_threadgroup
    offset: int  # of the declaration in the source

    @property
    def max_threads(self) -> str | None:
        """The expression of [[max_total_threads_per_threadgroup(N)]], if declared."""
        return next((v for a, v in self.attrs if a == "max_total_threads_per_threadgroup"), None)


def strip_comments(src: str) -> str:
    """Blank out comments and string literals, keeping offsets and newlines."""

    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', blank, src, flags=re.S)


def matching(src: str, i: int, open_c: str, close_c: str) -> int:
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


def split_top_level(s: str) -> list[str]:
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
    if m and m.group(1) in DTYPES:
        return m.group(1)
    m = re.fullmatch(r"atomic_(int|uint|float)", base)
    return m.group(1) if m else None


def _parse_param(kname: str, text: str) -> Param:
    m = re.search(r"\[\[\s*(\w+)\s*(?:\(\s*(\d+)\s*\))?\s*\]\]", text)
    attr, idx = (m.group(1), m.group(2)) if m else ("", None)
    decl = (text[: m.start()] + text[m.end() :]).strip() if m else text
    nm = re.search(r"(\w+)\s*$", decl)
    if not nm:
        raise EmulatorError(f"[{kname}] cannot parse parameter {text!r}")
    name, type_ = nm.group(1), decl[: nm.start()].strip()
    p = Param(text=decl, type=type_, name=name, attr=attr)
    if attr == "buffer":
        p.index = int(idx)
        if re.search(r"\bthreadgroup\b", type_):
            raise EmulatorError(f"[{kname}] threadgroup pointer params are not supported: {text!r}")
        base = p.base = _base_type(type_)
        p.scalar = _scalar_of(base)
        if type_.endswith("*"):
            p.kind = "tensor"
            p.constant = re.search(r"\bconstant\b", type_) is not None
        elif type_.endswith("&"):
            p.kind = "int" if base in _INT64_REF_TYPES else "float" if base == "float" else "tensor"
        else:
            raise EmulatorError(f"[{kname}] buffer param {name!r} must be a pointer or a reference, got {text!r}")
    elif attr in POSITION_FIELDS or attr in SCALAR_FIELDS:
        pass
    else:
        raise EmulatorError(
            f"[{kname}] unsupported kernel parameter {text!r} (supported: [[buffer(i)]] and the position attributes)"
        )
    return p


_ATTRS = r"(?:\[\[(?:(?!\]\]).)*\]\]\s*)*"
_KERNEL = re.compile(rf"(?P<pre>{_ATTRS})(?P<kw>\bkernel)\s+(?P<mid>{_ATTRS})void\s+(?P<name>\w+)\s*\(", re.S)
_ATTR = re.compile(r"(\w+)\s*(?:\(([^()]*(?:\([^()]*\)[^()]*)*)\))?")  # name(arg) inside [[...]]
_TG_DECL = re.compile(
    r"\bthreadgroup\s+((?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;<>]*>)?)\s+(\w+)\s*"
    r"((?:\[[^\]]+\]\s*)*);"
)
_TG_POINTER = re.compile(r"\bthreadgroup\s+(?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;<>]*>)?\s*(?:const\s*)?[*&]")


def parse_kernels(source: str) -> tuple[dict[str, Kernel], list[TgDecl]]:
    """Kernels of `source`, and the `threadgroup T name[N];` declarations of shared arrays.

    Every `threadgroup` must be either such a declaration in a kernel body (it becomes storage shared
    by the group's fibers, see msl_shim.h part 3) or a pointer/reference type, e.g. a helper's
    `threadgroup float* sh` param (the keyword then expands to nothing). Anything else is refused,
    because it would silently become a per-thread variable.
    """
    clean = strip_comments(source)
    kernels: dict[str, Kernel] = {}
    tg_decls: list[TgDecl] = []
    kernel_words = set()
    for m in _KERNEL.finditer(clean):
        name = m.group("name")
        kernel_words.add(m.start("kw"))
        close = matching(clean, m.end() - 1, "(", ")")
        params = [_parse_param(name, t) for t in split_top_level(clean[m.end() : close])]
        body_open = clean.index("{", close)
        if "[[" in clean[close:body_open]:
            raise EmulatorError(
                f"[{name}] a kernel attribute after the parameter list: write it before `kernel` "
                "(`[[max_total_threads_per_threadgroup(N)]] kernel void ...`), as MSL requires"
            )
        if m.group("mid").strip():
            raise EmulatorError(
                f"[{name}] write kernel attributes before `kernel` "
                "(`[[max_total_threads_per_threadgroup(N)]] kernel void ...`, the placement Apple's "
                f"compiler is known to accept), not between `kernel` and `void`: {m.group('mid')!r}"
            )
        attrs = _ATTR.findall(m.group("pre"))
        body_close = matching(clean, body_open, "{", "}")
        buffers = sorted((p for p in params if p.attr == "buffer"), key=lambda p: p.index)
        if [p.index for p in buffers] != list(range(len(buffers))):
            raise EmulatorError(
                f"[{name}] buffer indices must be 0..n-1 without gaps, got {[p.index for p in buffers]}"
            )
        decls = list(_TG_DECL.finditer(clean, body_open, body_close))
        tg_decls += [TgDecl(d.start(), d.end(), d.group(1), d.group(2), d.group(3).strip()) for d in decls]
        if name in kernels:
            raise EmulatorError(f"kernel {name!r} is defined twice")
        kernels[name] = Kernel(
            name,
            params,
            buffers,
            [(d.group(1), d.group(2), d.group(3).strip()) for d in decls],
            [(a, v.strip()) for a, v in attrs],
            m.start("kw"),
        )
    for w in re.finditer(r"\bkernel\b", clean):
        if w.start() not in kernel_words:
            raise EmulatorError(
                f"cannot parse the kernel declaration at line {clean.count(chr(10), 0, w.start()) + 1} "
                "of the assembled source: write `kernel void name(...)`, optionally preceded by "
                "`[[max_total_threads_per_threadgroup(N)]]`"
            )
    declared = {d.start for d in tg_decls}
    for t in re.finditer(r"\bthreadgroup\b", clean):
        if t.start() not in declared and not _TG_POINTER.match(clean, t.start()):
            line = clean.count("\n", 0, t.start()) + 1
            raise EmulatorError(
                f"unsupported use of `threadgroup` at line {line} of the assembled source: "
                f"{clean[t.start() : clean.find(chr(10), t.start())].strip()!r}. Declare shared memory as "
                "`threadgroup T name[N];` (one array per statement) in a kernel body; elsewhere use it only "
                "on pointer/reference types"
            )
    return kernels, tg_decls


def uses_fibers(source: str) -> bool:
    """Kernels that never synchronise run as plain loops; anything else gets one fiber per thread."""
    return (
        re.search(r"\b(threadgroup_barrier|simdgroup_barrier|simd_\w+|quad_\w+)\s*\(", strip_comments(source))
        is not None
    )
