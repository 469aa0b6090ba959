"""The MSL subset check: what Apple's compiler (or torch.mps.compile_shader) refuses but g++ accepts.

Runs on the assembled source before g++ sees it (library.compile_library); a violation raises
MetalCompileError naming the .metal file and line. Refused:

  * any non-ASCII byte (torch builds the shader string as ASCII: one byte >= 0x80, in a comment or
    in a ``#line`` path such as ``/Users/José/...``, makes the whole library fail to build);
  * ``double``, ``std::``, C library calls (printf, malloc, ...), exceptions (throw/try/catch),
    ``virtual``, function pointers, recursion (direct or through other functions of the source;
    the call graph is by name, so overloads of one name that call each other count as recursion),
    ``#include`` of anything but <metal_stdlib>, ``#pragma once`` (torch's header inliner refuses
    it in some releases), any ``#pragma`` other than
    ``METAL fp math_mode(safe)`` and ``METAL fp contract(off)`` (the only math the emulator runs: a
    fast-math pragma would make the GPU compute what the emulator never tested); variable-length arrays
    are refused by the compilers
    (``-Werror=vla`` for g++ and the address-space check's clang);
  * kernel signatures Metal rejects: a buffer index above 30 (Metal binds at most 31 buffers), a
    buffer that is not a ``device``/``constant`` pointer or reference, a pointer or reference
    parameter (of a kernel or a helper) without an explicit address space, position attributes of
    the wrong type (uint/ushort, or uint2/3 / ushort2/3 where Metal allows vectors; the vector ones
    of one kernel must have the same number of components), and kernel attributes other than
    ``[[max_total_threads_per_threadgroup(N)]]`` (parse.py accepts it only before ``kernel``).
"""

from __future__ import annotations

import re

from .errors import MetalCompileError
from .parse import matching, split_top_level

# position attributes that may be vectors (uint2/uint3 ...) and those that are scalars only
GRID_ATTRS = {
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
    "dispatch_threads_per_threadgroup",
    "threads_per_grid",
    "threadgroups_per_grid",
}
SCALAR_ATTRS = {
    "thread_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup",
    "threads_per_simdgroup",
    "thread_execution_width",
}
KERNEL_ATTRS = {"max_total_threads_per_threadgroup"}
MAX_BUFFERS = 31
ADDRESS_SPACES = ("device", "constant", "threadgroup", "thread")

_BANNED = [  # (regex over comment-free source, why Metal refuses it)
    (r"\bdouble\b", "`double`: Metal has no double precision (use float)"),
    (r"\bstd\s*::", "`std::`: there is no C++ standard library in MSL (metal:: has the math)"),
    (
        r"\b(?:printf|fprintf|sprintf|snprintf|puts|malloc|calloc|realloc|free|abort|exit)\s*\(",
        "a C library call: MSL has no C library (no printf, no heap)",
    ),
    (r"\b(?:throw|try|catch)\b", "exceptions: MSL has no throw/try/catch"),
    (r"\bvirtual\b", "`virtual`: MSL has no virtual functions"),
    (r"\(\s*\*\s*\w*\s*\)\s*\(", "a function pointer: MSL kernels cannot use function pointers"),
]
_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include\b[^\n]*", re.M)
_PRAGMA = re.compile(r"^[ \t]*#[ \t]*pragma\b([^\n]*)", re.M)
_ALLOWED_PRAGMAS = {"METAL fp math_mode(safe)", "METAL fp contract(off)"}
_LINE_DIRECTIVE = re.compile(r'^[ \t]*#[ \t]*line[ \t]+(\d+)(?:[ \t]+"([^"\n]*)")?', re.M)
_NOT_CALLS = {"if", "for", "while", "switch", "return", "sizeof", "alignof", "defined", "static_assert"}


def where(source: str, offset: int, name: str = "<source>") -> str:
    """`file:line` of `offset` in an assembled source, following its #line directives (`name` before any)."""
    file, base, base_line = name, 1, 1
    for m in _LINE_DIRECTIVE.finditer(source, 0, offset):
        file = m.group(2) if m.group(2) is not None else file
        base = int(m.group(1))
        base_line = source.count("\n", 0, m.start()) + 2  # the line after the directive
    return f"{file}:{base + source.count(chr(10), 0, offset) + 1 - base_line}"


def _fail(name: str, source: str, offset: int, what: str) -> None:
    raise MetalCompileError(f"MSL subset check of {name!r}: {where(source, offset, name)}: {what}")


def check_ascii(source: str, name: str) -> None:
    for i, ch in enumerate(source):
        if ord(ch) > 127:
            line_start = source.rfind("\n", 0, i) + 1
            line_end = source.find("\n", i) % (len(source) + 1)
            hint = ""
            if _LINE_DIRECTIVE.match(source, line_start):
                hint = (
                    f" inside the directive `{source[line_start:line_end]}` (line "
                    f"{source.count(chr(10), 0, i) + 1} of the assembled source): a kernel file's path is not "
                    "ASCII; assemble the source with ASCII-only #line paths"
                )
                i = line_start
            _fail(
                name,
                source,
                i,
                f"non-ASCII character {ch!r} (U+{ord(ch):04X}){hint}. torch.mps.compile_shader "
                "builds the shader source as ASCII, so this library would fail to build on a Mac",
            )


def _params_before_body(head: str):
    """The match `name(params)` that ends `head` (text before a `{`): the balanced parenthesis group right
    before it, so a parenthesised macro earlier in the text (`#define N ((D + 3) / 4)`) is not taken for the
    start of the parameter list. None if `head` does not end in such a group or it holds `{`, `}` or `;`."""
    close = re.search(r"\)\s*(?:const\s*)?$", head)
    if close is None:
        return None
    depth, j = 0, close.start()
    while j >= 0:
        depth += {")": 1, "(": -1}.get(head[j], 0)
        if depth == 0:
            break
        j -= 1
    if j < 0:
        return None
    name = re.search(r"\w+\s*$", head[:j])
    return _SIGNATURE.match(head, name.start()) if name else None


_SIGNATURE = re.compile(r"(\w+)\s*\(([^{};]*)\)\s*(?:const\s*)?$")


def _functions(clean: str) -> dict[str, list[tuple[int, int, int, int]]]:
    """name -> [(params_open, params_close, body_open, body_close)] of every file-scope function."""
    out: dict[str, list] = {}
    depth, i = 0, 0
    while i < len(clean):
        c = clean[i]
        if c == "{":
            if depth == 0:
                head = clean[max(0, i - 4000) : i]
                m = _params_before_body(head)
                if (
                    m
                    and m.group(1) not in _NOT_CALLS
                    and not re.search(
                        r"\b(?:struct|class|namespace|enum|union)\b"
                        r"[^;{}]*$",
                        head,
                    )
                ):
                    close = matching(clean, i, "{", "}")
                    p_open = i - len(head) + m.start(2) - 1
                    out.setdefault(m.group(1), []).append((p_open, i - len(head) + m.end(2), i, close))
            depth += 1
        elif c == "}":
            depth -= 1
        i += 1
    return out


def _check_recursion(name: str, source: str, clean: str, funcs: dict) -> None:
    calls = {f: set() for f in funcs}
    first_call = {}
    for f, defs in funcs.items():
        for _, _, b0, b1 in defs:
            for m in re.finditer(r"\b(\w+)\s*\(", clean[b0:b1]):
                if m.group(1) in funcs:
                    calls[f].add(m.group(1))
                    first_call.setdefault((f, m.group(1)), b0 + m.start())
    state: dict[str, int] = {}  # 1 = on the DFS stack, 2 = done

    def visit(f: str, path: list[str]) -> None:
        state[f] = 1
        for g in sorted(calls[f]):
            if state.get(g) == 1:
                cycle = path[path.index(g) :] + [f, g] if g in path else [f, g]
                _fail(
                    name,
                    source,
                    first_call[(f, g)],
                    f"recursion ({' -> '.join(dict.fromkeys(cycle))} -> {g}): Metal does not allow recursive functions",
                )
            if g not in state:
                visit(g, path + [f])
        state[f] = 2

    for f in funcs:
        if f not in state:
            visit(f, [])


def _has_address_space(type_text: str) -> bool:
    return any(re.search(rf"\b{a}\b", type_text) for a in ADDRESS_SPACES)


def _check_param_address_spaces(name: str, source: str, clean: str, funcs: dict) -> None:
    for f, defs in funcs.items():
        for p0, p1, _, _ in defs:
            for part in split_top_level(clean[p0 + 1 : p1]):
                decl = re.sub(r"\[\[.*?\]\]", "", part)
                if re.search(r"[*&]", decl) and not _has_address_space(decl):
                    _fail(
                        name,
                        source,
                        p0 + 1 + clean[p0 + 1 : p1].find(part),
                        f"parameter `{decl.strip()}` of {f}() is a pointer or reference without an address space: "
                        "Metal needs device, constant, threadgroup or thread on every one",
                    )


def _rank(type_text: str) -> tuple[str, int] | None:
    words = [w for w in re.findall(r"\w+", type_text) if w not in ("const", "metal")]
    m = re.fullmatch(r"(uint|ushort)([23]?)", words[-1]) if len(words) == 1 else None
    return (m.group(1), int(m.group(2) or 1)) if m else None


def _check_kernel_signatures(name: str, source: str, kernels: dict) -> None:
    for k in kernels.values():
        grid_ranks = {}
        for attr, value in k.attrs:
            if attr not in KERNEL_ATTRS:
                _fail(
                    name,
                    source,
                    k.offset,
                    f"kernel {k.name}: unsupported kernel attribute [[{attr}]] "
                    f"(supported: {', '.join(sorted(KERNEL_ATTRS))})",
                )
            if not value.strip():
                _fail(name, source, k.offset, f"kernel {k.name}: [[{attr}(N)]] needs a thread count")
        for p in k.params:
            if p.attr == "buffer":
                if p.index >= MAX_BUFFERS:
                    _fail(
                        name,
                        source,
                        k.offset,
                        f"kernel {k.name}: [[buffer({p.index})]] of `{p.text}`: Metal binds "
                        f"at most {MAX_BUFFERS} buffers (indices 0..{MAX_BUFFERS - 1})",
                    )
                if not re.search(r"\b(device|constant)\b", p.type):
                    _fail(
                        name,
                        source,
                        k.offset,
                        f"kernel {k.name}: buffer `{p.text}` must be a device or constant "
                        "pointer/reference (an explicit address space)",
                    )
                continue
            r = _rank(p.type)
            if p.attr in SCALAR_ATTRS and (r is None or r[1] != 1):
                _fail(name, source, k.offset, f"kernel {k.name}: [[{p.attr}]] `{p.text}` must be uint or ushort")
            if p.attr in GRID_ATTRS:
                if r is None:
                    _fail(
                        name,
                        source,
                        k.offset,
                        f"kernel {k.name}: [[{p.attr}]] `{p.text}` must be uint, uint2, "
                        "uint3, ushort, ushort2 or ushort3",
                    )
                if r[1] > 1:
                    grid_ranks[p.attr] = r[1]
        if len(set(grid_ranks.values())) > 1:
            _fail(
                name,
                source,
                k.offset,
                f"kernel {k.name}: vector position attributes must all have the same number "
                f"of components, got {grid_ranks}",
            )


def check_msl_subset(source: str, clean: str, kernels: dict, name: str) -> None:
    """Raise MetalCompileError at the first construct of `source` that Metal refuses.

    clean: `source` with comments and string literals blanked (library.strip_comments);
    kernels: library.parse_kernels's result for it."""
    check_ascii(source, name)
    for pattern, why in _BANNED:
        m = re.search(pattern, clean)
        if m:
            _fail(name, source, m.start(), why)
    for m in _INCLUDE.finditer(clean):
        raw = source[m.start() : m.end()]
        if not re.search(r"#\s*include\s*<metal_stdlib>", raw):
            _fail(
                name,
                source,
                m.start(),
                f"`{raw.strip()}`: include only <metal_stdlib> "
                "(torch.mps.compile_shader compiles one string and has no include path)",
            )
    for m in _PRAGMA.finditer(clean):
        if " ".join(m.group(1).split()) == "once":
            _fail(
                name,
                source,
                m.start(),
                "`#pragma once`: torch.mps.compile_shader's header inliner refuses it in some releases; "
                "kernel sources are concatenated once each (runtime.load_source), so delete the line",
            )
        if " ".join(m.group(1).split()) not in _ALLOWED_PRAGMAS:
            _fail(
                name,
                source,
                m.start(),
                f"`{m.group(0).strip()}`: the MSL emulator runs safe math only; allowed "
                f"pragmas: {', '.join('#pragma ' + p for p in sorted(_ALLOWED_PRAGMAS))}",
            )
    funcs = _functions(clean)
    _check_recursion(name, source, clean, funcs)
    _check_kernel_signatures(name, source, kernels)
    _check_param_address_spaces(name, source, clean, funcs)
