"""MSL emulator: run our .metal kernels on CPU tensors, without a Mac.

The same .metal source is compiled as C++17 by g++ against ``msl_shim.h`` (found as
``#include <metal_stdlib>``), loaded with ctypes, and launched with torch.mps.compile_shader's call
convention::

    lib = compile_library(source)                       # cached .so, see "Cache" below
    lib.my_kernel(out, x, n, 2.5, threads=(W, H), group_size=(16, 16))

Kernel-author rules (the MSL subset that runs both here and on Apple GPUs)
--------------------------------------------------------------------------
Kernels
  * Include only ``<metal_stdlib>`` (then ``using namespace metal;``).
  * ``kernel void name(params) { ... }`` at file scope, one per name, written out literally
    (not produced by a macro: the emulator finds kernels with a regex), optionally preceded by
    ``[[max_total_threads_per_threadgroup(N)]]`` (N a constant expression; the only kernel attribute,
    written before ``kernel``, where Apple's compiler is known to take it). A launch with a bigger
    group fails, as torch's ValueError does on a Mac.
  * At most 31 buffers; every pointer or reference parameter (kernels and helpers) names its
    address space (``device``, ``constant``, ``threadgroup`` or ``thread``).
  * Buffer params: ``device T* p [[buffer(i)]]``, ``device const T* p``, ``constant T* p``, or a
    reference ``constant long& n [[buffer(i)]]`` / ``constant float& x [[buffer(i)]]``. Buffer
    indices are 0..n-1 and positional argument i binds to ``[[buffer(i)]]``.
    Python int/bool -> ``constant long&`` (int64), Python float -> ``constant float&``, torch
    tensor (contiguous, CPU for the emulator) -> pointer at its storage offset (or a
    ``constant Struct&``). The pointee's scalar type must match the tensor dtype
    (float*/float3*/packed_float3*/atomic_float* <-> float32, int*/atomic_int* <-> int32,
    uint* <-> int32/uint32, long* <-> int64, uchar* <-> uint8/bool, ...).
  * Position params (uint, ushort, uint2 or uint3 as you like): thread_position_in_grid,
    thread_position_in_threadgroup, threadgroup_position_in_grid, threads_per_threadgroup (the
    ACTUAL size of this group; edge groups of a non-multiple grid are smaller),
    dispatch_threads_per_threadgroup (the requested size), threads_per_grid,
    threadgroups_per_grid, thread_index_in_threadgroup (x + y*tptg.x + z*tptg.x*tptg.y),
    thread_index_in_simdgroup, simdgroup_index_in_threadgroup, simdgroups_per_threadgroup,
    threads_per_simdgroup and thread_execution_width (both 32). The index/count attributes are uint or
    ushort; the position/size ones uint, uint2, uint3 (or ushort...), the vector ones of a kernel
    with the same number of components.
  * Always pass ``threads=`` and ``group_size=`` (same rank, 1-3 dims; at most 1024 threads per
    group). The emulator refuses to guess defaults, and refuses a zero in either (an empty dispatch, which
    Metal's validation rejects): skip the launch when there is no work.
Types
  * Scalars: bool, char/uchar, short/ushort, int/uint, long/ulong (64-bit), float. No double, no half.
  * Vectors floatN/intN/uintN/shortN/ushortN/charN/ucharN/boolN (N = 2, 3, 4) with Metal sizes:
    float3 is 16 bytes, aligned 16. packed_float3 etc. are 12 bytes: convert them to float3
    (``float3 v = p[i];``) before doing math. A torch [N, 3] tensor is packed: read it through
    ``float*`` with 3*i indexing or ``packed_float3*``; never ``device float3*``.
  * Components only ``.x .y .z .w`` and ``v[i]``. NO swizzles (``.xy``, ``.xyz``): write
    ``float2(v.x, v.y)``. A swizzle is a compile error here, never a silent miscompile.
  * Vector constructors: ``float3(s)`` (broadcast, explicit), ``float3(x, y, z)``,
    ``float3(float2, z)``, ``float4(float3, w)``, ``float4(float2, float2)``, ``float3(int3)``.
    ``float3 v = 0.0f;`` (implicit scalar -> vector) does not compile here: write ``float3(0.0f)``.
  * Matrices floatCxR (C columns of floatR, column-major; float3x3 is 48 bytes): ``m[c]`` is a
    column, ``float3x3(c0, c1, c2)``, ``float2x2(a, b, c, d)`` (column-major scalars),
    ``float3x3(1.0f)`` = identity (a scalar sets the diagonal), ``m * v``, ``v * m``, ``m * m``,
    ``+ - `` and scalar ``*``, ``transpose``, ``determinant`` (2x2, 3x3).
Functions
  * dot, length, length_squared, distance, normalize, cross, min, max, clamp, abs, fabs, fmin,
    fmax, exp, exp2, log, log2, sqrt, rsqrt, pow, powr, floor, ceil, round, rint, trunc, fract,
    sin, cos, tan, asin, acos, atan, atan2, tanh, fmod, copysign, fma, mix, select, step, sign,
    saturate, isfinite, isnan, isinf, any, all, ``as_type<T>(x)``; ``precise::`` and ``fast::``
    are aliases of the same functions. Unsuffixed literals like ``0.5`` are float (as in Metal).
Threadgroup memory
  * Only as ``threadgroup T name[N];`` (or ``[N][M]``) declarations in a kernel body, with N a
    constant visible at file scope (literal, #define, or file-scope constexpr/constant): the
    emulator adds up ``sizeof`` of every such array and refuses launches over 32 KiB.
    Helpers may take ``threadgroup T*`` / ``threadgroup T&`` params and kernels may use such
    local pointers; any other use of ``threadgroup`` (two arrays in one statement, an initialiser,
    a ``threadgroup`` kernel param) is refused. ``[[threadgroup(i)]]`` params are not supported
    (torch.mps.compile_shader cannot size them either).
    Threadgroup memory is undefined at group start on the GPU; here it is poisoned at the start of
    every group (0xFF bytes: float NaN, int -1; 0x7F with an odd schedule seed: 3.4e38 and
    0x7F7F7F7F), so a read before any write shows.
Synchronisation
  * Between two barriers (or simdgroup ops) the threads of a group run one at a time, in an order
    shuffled per (seed, group, round): ``SPLAT_METAL_EMU_SEED`` (an integer, default 0; the same seed
    gives the same schedule, whichever OS thread runs the group). A correct kernel gives the same
    result under every seed (up to the summation order of float atomics); the tests require it.
  * ``threadgroup_barrier(mem_flags::mem_threadgroup | mem_device | mem_none)`` must be reached by
    every thread of the group the same number of times, at the same call: never ``return`` early before a
    barrier (mask the work instead), never write one barrier on both branches of an if/else (two calls are
    two barriers on a GPU). Violations raise EmulatorError naming the group, the threads and, for two calls,
    both .metal file:line (and column under clang; g++ 12 has no __builtin_COLUMN, so two calls on one line
    are told apart only by what they are).
  * simdgroup ops (32 lanes; lane = thread_index_in_threadgroup % 32; the last simdgroup of a
    group may be partial): simd_sum/max/min, simd_prefix_exclusive_sum,
    simd_prefix_inclusive_sum, simd_shuffle, simd_shuffle_down/up/xor, simd_broadcast,
    simd_broadcast_first, simd_ballot (-> simd_vote, ``(ulong)vote``, ``.any()``, ``.all()``),
    simd_any, simd_all, simd_is_first, simdgroup_barrier. Call them in uniform control flow
    (every live lane of the simdgroup at the same call of the same op, as with barriers: two calls of
    simd_sum on two branches are an error naming both); lanes that have returned are inactive
    and excluded. Reading an inactive/nonexistent lane returns the caller's own value. A helper
    that holds the op is one call site wherever it is called from.
  * Device atomics over 4-byte buffers: atomic_int, atomic_uint, atomic_float (``atomic<T>``);
    atomic_load/store/exchange/fetch_add/fetch_sub/compare_exchange_weak _explicit (all three);
    fetch_max/min/and/or/xor _explicit (int/uint only, as in Metal); memory_order_relaxed.

Checks (every compile_library; a violation raises MetalCompileError naming the .metal file:line)
-------------------------------------------------------------------------------------------------
  * The MSL subset (msl_subset.py): non-ASCII bytes anywhere (torch builds the source as ASCII; a
    ``#line`` path with a non-ASCII user name included), ``double``, ``std::``, C library calls,
    exceptions, ``virtual``, function pointers, recursion, includes other than <metal_stdlib>,
    ``#pragma once`` (torch's header inliner refuses it in some releases), and the kernel-signature rules
    above. Variable-length arrays: ``-Werror=vla``.
  * Address spaces (address_spaces.py): clang++ -fsyntax-only compiles the source against a
    declaration-only <metal_stdlib> in which device, constant and threadgroup are distinct
    address spaces (thread the default), so a device pointer passed to a thread pointer parameter
    or a threadgroup reference bound to a thread one fails as on Apple's compiler. Runs when clang++
    is installed (scripts/setup.sh installs it; without it a warning says the check was skipped).
  * ``SPLAT_METAL_EMU_ASAN=1`` builds the libraries with AddressSanitizer: an index past a tensor or
    a threadgroup array aborts with a report instead of reading neighbouring memory. The Python
    process must preload the runtime (and the C++ runtime, for extension modules that throw while
    they are imported): ``LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++
    -print-file-name=libstdc++.so.6)" ASAN_OPTIONS=detect_leaks=0`` (``asan_preload()`` gives the list;
    the tests run part of the kernel suite that way in a subprocess). Fiber stack switches are annotated for ASan.
  * ``SPLAT_METAL_EMU_TG_SWITCH=1`` builds them so that a group's threads switch at EVERY access to
    threadgroup memory (g++'s -fsanitize=thread instrumentation calls hooks the shim defines; no TSan
    runtime): a non-atomic read-modify-write of threadgroup memory between barriers (``tg[0] += 1`` from
    every thread) loses updates, which the default build (threads run whole between synchronisation points)
    cannot show. It also records each threadgroup word's last plain store: a load of a word another
    simdgroup's thread stored before a ``threadgroup_barrier`` without ``mem_flags::mem_threadgroup`` (and no
    barrier with it since) is an EmulatorError naming both threads and the barrier. g++ only; several times
    slower. tests/ops/metal/test_emulator_tg_switch.py runs part of the kernel suite that way at a fixed seed.
  * ``SPLAT_METAL_EMU_FP_CONTRACT=1`` builds them with ``-ffp-contract=fast -mfma`` as MSL 3.1 (no
    ``fp contract(off)`` pragma): multiply-adds fused as Apple's compiler may below MSL 3.2 (macOS 14 and
    older). tests/ops/metal/test_emulator_fp_contract.py runs the forward and backward kernel comparisons
    under it. x86-64 CPUs with FMA only.
  * ``SPLAT_METAL_EMU_UBSAN=1`` builds them with UndefinedBehaviorSanitizer (float-cast-overflow,
    signed-integer-overflow, shift, bounds; no recovery), and ``SPLAT_METAL_EMU_ASAN=1`` does too. A
    float-to-int conversion of NaN, inf or an out-of-range value, undefined in C++ and MSL (x86 gives
    INT_MIN, an Apple GPU may saturate to INT_MAX), then ends the process with a ``runtime error:``
    report instead of passing silently. Its runtime loads with the library (no LD_PRELOAD), but a
    report exits the process: tests run it in a subprocess (tests/ops/metal/test_emulator_ubsan.py).

What the emulator cannot see (the Mac-side doctor command and the macOS CI job cover these)
------------------------------------------------------------------------------------------
  * Apple compiler errors beyond the checks above (the stand-in <metal_stdlib> declares what the
    shim supports, not Apple's exact overloads; implicit conversions Apple refuses may pass here).
  * GPU precision: fast paths of exp/log/rsqrt and fma contraction on the GPU differ in the last
    bits; compare with tolerances, never bit-exactly.
  * Races are found only when a schedule exposes them: threads run one at a time between
    synchronisation points (at every threadgroup-memory access in the SPLAT_METAL_EMU_TG_SWITCH=1 build), so
    a race shows as a seed-dependent result (or poison, or a lost update), not as a torn value; lanes of a
    simdgroup are not in lockstep here (stricter than the GPU). ``mem_flags`` are checked only in the
    SPLAT_METAL_EMU_TG_SWITCH=1 build, for threadgroup memory and plain loads and stores between
    simdgroups; ``mem_device`` is never checked. Races through
    device memory between different groups are not shuffled (groups run whole, on several OS
    threads). Atomics are real.
  * Undefined behaviour only under ``SPLAT_METAL_EMU_UBSAN=1`` / ``SPLAT_METAL_EMU_ASAN=1``.
  * Out-of-bounds accesses only under ``SPLAT_METAL_EMU_ASAN=1``, and only past a tensor's
    allocation (an index into another part of the same storage is not caught). The GPU watchdog
    (~2 s per command buffer), GPU memory limits and the register-dependent
    maxTotalThreadsPerThreadgroup do not exist here; per-thread stacks are 256 KiB.
  * Performance: one CPU core runs a whole group; kernels are correct-not-fast here.

Cache
-----
Compiled libraries live in ``$SPLAT_METAL_CACHE_DIR`` (default ``~/.cache/splat_metal/emulator``),
keyed by a hash of (source, shim, compiler flags); a second process reuses them without compiling.
"""

from .library import (
    EmulatorError,
    EmulatorLibrary,
    MetalCompileError,
    asan_preload,
    asan_runtime,
    cache_dir,
    compile_count,
    compile_library,
    schedule_seed,
    ubsan_enabled,
)

__all__ = [
    "EmulatorError",
    "EmulatorLibrary",
    "MetalCompileError",
    "asan_preload",
    "asan_runtime",
    "cache_dir",
    "compile_count",
    "compile_library",
    "schedule_seed",
    "ubsan_enabled",
]
