// common.h: shared by every splat-metal kernel library.
//
// The Python side (splat_metal_method/ops/metal/kernels.py) assembles each library's source as
//     <#defines generated from splat_metal_method/ops/constants.py and per-variant values>
//     + this header + covar.h and sh.h (math shared with the native CPU backend) + the stage's .metal file,
// because torch.mps.compile_shader compiles one string and has no include path. The constants are
// therefore defined once, in Python, and the checks below fail loudly if a source was assembled
// without them.
//
// Conventions for every kernel (see docs/design.md section 3.2):
//   * [N,3] tensors are read through `const device float*` with 3*i indexing, never float3* (16 bytes).
//   * Python ints arrive as `constant long&`, Python floats as `constant float&`; a list of ints as one
//     `constant long*`, of floats as one `constant float*` (the packed arguments at the end of this file).
//   * Tensors are contiguous; a kernel never sees strides.
//   * No swizzles (.xy): the emulator compiles this file as C++.
#include <metal_stdlib>
using namespace metal;

// Safe math, whatever torch was told: with PYTORCH_MPS_FAST_MATH set, torch compiles every library with
// fast math, under which NaN tests, forward and backward agreeing at the ALPHA_MIN threshold, and
// isect_count / isect_emit agreeing on a tile rectangle no longer hold. From MSL 3.2 (macOS 15, torch
// >= 2.11) the source declares its math mode, which the compile option does not override; below it
// cannot, and the self-check (which runs the kernels as compiled, keyed on PYTORCH_MPS_FAST_MATH) turns
// a fast-math mismatch into a failed stage that runs on the reference (splat_metal_method/self_check.py).
// The emulator compiles as MSL 3.2 (msl_shim.h) with exactly this math: no fast math, -ffp-contract=off.
#if __METAL_VERSION__ >= 320
#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
#endif

#ifndef SPLAT_TILE_SIZE
#error "SPLAT_TILE_SIZE must be injected by kernels.py (from ops/constants.py)"
#endif
#ifndef SPLAT_ALPHA_MAX
#error "SPLAT_ALPHA_MAX must be injected by kernels.py (from ops/constants.py)"
#endif
#ifndef SPLAT_ALPHA_MIN
#error "SPLAT_ALPHA_MIN must be injected by kernels.py (from ops/constants.py)"
#endif
#ifndef SPLAT_TRANSMITTANCE_MIN
#error "SPLAT_TRANSMITTANCE_MIN must be injected by kernels.py (from ops/constants.py)"
#endif

// Threads of one rasterization threadgroup: one per pixel of a tile.
#define SPLAT_TILE_PIXELS (SPLAT_TILE_SIZE * SPLAT_TILE_SIZE)
// Rows of its tile one rasterizer threadgroup covers: all of them, unless this GPU's pipeline allows fewer
// threads per group (kernels.tile_library injects a divisor of SPLAT_TILE_SIZE); each strip's group then
// walks the whole tile list for its pixels, so every pixel computes exactly what it does in a full tile.
#ifndef SPLAT_GROUP_ROWS
#define SPLAT_GROUP_ROWS SPLAT_TILE_SIZE
#endif
#if SPLAT_TILE_SIZE % SPLAT_GROUP_ROWS != 0
#error "SPLAT_GROUP_ROWS must divide SPLAT_TILE_SIZE (a group's rows lie in one tile)"
#endif
#define SPLAT_RASTER_THREADS (SPLAT_TILE_SIZE * SPLAT_GROUP_ROWS)

// The pixel of its group a rasterizer thread takes (column, row within the group's rows), by thread index.
// Apple GPUs form simdgroups from 32 consecutive thread indices, so in row order a simdgroup of a 16-wide tile
// is a 16x2 strip of pixels (gsplat's order: warps of 16x16 CUDA blocks). Where the tile width is a multiple of
// 8 and the group's rows a multiple of 4 (16x16 tiles and their strips of 4 and 8 rows), a simdgroup takes an 8x4
// block instead (msplat's: it rasterizes in 8x8 threadgroups): a gaussian's footprint meets fewer simdgroups (a
// fifth fewer on garden), and the backward reduces and issues its atomics once per (gaussian, simdgroup) it
// meets. What a pixel computes does not depend on the order.
#if SPLAT_TILE_SIZE % 8 == 0 && SPLAT_GROUP_ROWS % 4 == 0
#define SPLAT_PIXEL_BLOCKS 1
#else
#define SPLAT_PIXEL_BLOCKS 0
#endif
inline uint2 raster_pixel_in_group(uint tid) {
#if SPLAT_PIXEL_BLOCKS
  const uint block = tid / 32, lane = tid % 32;
  return uint2((block % (SPLAT_TILE_SIZE / 8)) * 8 + lane % 8, (block / (SPLAT_TILE_SIZE / 8)) * 4 + lane / 8);
#else
  return uint2(tid % SPLAT_TILE_SIZE, tid / SPLAT_TILE_SIZE);
#endif
}

// Every kernel declares [[max_total_threads_per_threadgroup(N)]] with N = the group size its host
// code dispatches: SPLAT_TILE_PIXELS (rasterizer), SPLAT_RADIX_THREADS (sort),
// SPLAT_PROJECT_BWD_GROUP (projection backward) or SPLAT_GROUP_1D (one thread per item), so the
// compiler keeps register use low enough for that many threads.
#ifndef SPLAT_GROUP_1D
#error "SPLAT_GROUP_1D must be injected by kernels.py"
#endif

// Radix sort geometry (sort.metal): RADIX_BITS per pass, RADIX_THREADS threads per group, each owning
// a contiguous run of RADIX_KEYS_PER_THREAD keys. Defined in kernels.py (RADIX_*) and injected.
#if !defined(SPLAT_RADIX_BITS) || !defined(SPLAT_RADIX_THREADS) || !defined(SPLAT_RADIX_KEYS_PER_THREAD)
#error "SPLAT_RADIX_* must be injected by kernels.py"
#endif
#define SPLAT_RADIX_BINS (1 << SPLAT_RADIX_BITS)
#define SPLAT_RADIX_BLOCK (SPLAT_RADIX_THREADS * SPLAT_RADIX_KEYS_PER_THREAD)

// Row-major 3x3 helpers on plain float arrays (index r*3+c). Plain arrays rather than float3x3 keep
// the arithmetic order explicit, which is what the reference backend is compared against.
inline void mat3_mul(thread const float* a, thread const float* b, thread float* out) {
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 3; ++c) {
      out[r * 3 + c] = a[r * 3 + 0] * b[0 * 3 + c] + a[r * 3 + 1] * b[1 * 3 + c] + a[r * 3 + 2] * b[2 * 3 + c];
    }
  }
}

// out = a * b^T
inline void mat3_mul_bt(thread const float* a, thread const float* b, thread float* out) {
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 3; ++c) {
      out[r * 3 + c] = a[r * 3 + 0] * b[c * 3 + 0] + a[r * 3 + 1] * b[c * 3 + 1] + a[r * 3 + 2] * b[c * 3 + 2];
    }
  }
}

// det [[a, b, c], [d, e, f], [g, h, i]]
inline float splat_det3(float a, float b, float c, float d, float e, float f, float g, float h, float i) {
  return a * (e * i - f * h) - b * (d * i - f * g) + c * (d * h - e * g);
}

// The fused preparation's camera position (ops/metal/prepare.py): column 3 of inv(V) for the row-major
// [4, 4] view matrix V (the glue's torch.linalg.inv_ex(viewmats)[0][:, :3, 3], by cofactors: inv[i][3] =
// C[3][i] / det, expanded along row 3), so no inverse is made on the host. For V = [[A, t], [0, 0, 0, 1]]
// it is -A^-1 t; a singular or non-finite V gives non-finite entries (its camera is culled).
inline void splat_camera_position(const device float* V, thread float* p) {
  const float m0 = splat_det3(V[1], V[2], V[3], V[5], V[6], V[7], V[9], V[10], V[11]);  // without column 0
  const float m1 = splat_det3(V[0], V[2], V[3], V[4], V[6], V[7], V[8], V[10], V[11]);
  const float m2 = splat_det3(V[0], V[1], V[3], V[4], V[5], V[7], V[8], V[9], V[11]);
  const float m3 = splat_det3(V[0], V[1], V[2], V[4], V[5], V[6], V[8], V[9], V[10]);
  const float det = V[12] * -m0 + V[13] * m1 + V[14] * -m2 + V[15] * m3;
  p[0] = -m0 / det;
  p[1] = m1 / det;
  p[2] = -m2 / det;
}

// The fused preparation's culling of a camera (prepare.py): what rasterization.py's glue culls besides
// projection (its "x * 0 == 0" tests) for a camera: one whose 16 view matrix entries or position p are not
// finite. (A gaussian's opacity is tested where it is activated, its colour where it is computed.)
inline bool splat_camera_finite(const device float* V, thread const float* p) {
  bool keep = isfinite(p[0]) && isfinite(p[1]) && isfinite(p[2]);
  for (int k = 0; k < 16; ++k) {
    keep = keep && isfinite(V[k]);
  }
  return keep;
}

// splatfacto's background composite clamp(x, 0, 1), as torch.clamp (NaN stays NaN): train.metal's
// composite_fwd and rasterize.metal's fused composite. Its gradient passes where 0 <= x <= 1.
inline float splat_clamp01(float x) {
  return isnan(x) ? x : min(max(x, 0.0f), 1.0f);
}

// Adam (adam.metal's layout, torch's MPS _fused_adam_ math in its float32 operations and order): the slots one
// adam_prepare serves and the floats per slot of its coefficient buffer (step size lr / (1 - b1^t),
// sqrt(1 - b2^t), eps, unused; b1 and b2 after the last slot). adam.metal's adam_step and project_bwd.metal's
// SH step (PROJECT_SH_ADAM) both update an element with splat_adam_update.
#define SPLAT_ADAM_SLOTS 6
#define SPLAT_ADAM_COEFS 4
// One element: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g; returns p - step_size m / (sqrt(v) / bc2_sqrt + eps)
// and stores m and v.
inline float splat_adam_update(float p, float grad, thread float* m, thread float* v, const device float* coef,
                               long slot, float b1, float b2) {
  const float step_size = coef[SPLAT_ADAM_COEFS * slot + 0];
  const float bias_correction2_sqrt = coef[SPLAT_ADAM_COEFS * slot + 1];
  const float eps = coef[SPLAT_ADAM_COEFS * slot + 2];
  const float exp_avg = b1 * m[0] + (1.0f - b1) * grad;
  const float exp_avg_sq = b2 * v[0] + (1.0f - b2) * grad * grad;
  const float denom = (precise::sqrt(exp_avg_sq) / bias_correction2_sqrt) + eps;
  m[0] = exp_avg;
  v[0] = exp_avg_sq;
  return p - step_size * exp_avg / denom;
}

// Packed scalar arguments (ops/metal/params.py, its mirror): a kernel with many scalars takes them as ONE list,
// which torch.mps.compile_shader packs as int64 (a list of floats: float32) into a single setBytes slot
// (docs/design.md 3.1), read as `constant long* params` at these indices. <LAYOUT>_COUNT: its length.
// rasterize_fwd (rasterize.metal)
#define RASTER_FWD_WIDTH          0
#define RASTER_FWD_HEIGHT         1
#define RASTER_FWD_TILE_WIDTH     2
#define RASTER_FWD_TILE_HEIGHT    3
#define RASTER_FWD_TOTAL_TILES    4  // C * tile_height * tile_width (+ 1: padded lists)
#define RASTER_FWD_N_ISECTS       5  // M
#define RASTER_FWD_HAS_BACKGROUND 6
#define RASTER_FWD_PASS_INDEX     7
#define RASTER_FWD_CHUNK          8
#define RASTER_FWD_HAS_RESUME     9
#define RASTER_FWD_ROW0           10  // first tile row of this dispatch, of [C * tile_height]
#define RASTER_FWD_HAS_COMPOSITE  11
#define RASTER_FWD_COUNT          12
// rasterize_bwd (rasterize_bwd.metal)
#define RASTER_BWD_WIDTH       0
#define RASTER_BWD_HEIGHT      1
#define RASTER_BWD_TILE_WIDTH  2
#define RASTER_BWD_TILE_HEIGHT 3
#define RASTER_BWD_TOTAL_TILES 4  // C * tile_height * tile_width (+ 1: padded lists)
#define RASTER_BWD_N_ISECTS    5  // M
#define RASTER_BWD_FLAGS       6  // SPLAT_BWD_* bits
#define RASTER_BWD_PASS_INDEX  7
#define RASTER_BWD_CHUNK       8
#define RASTER_BWD_ROW0        9  // first tile row of this dispatch, of [C * tile_height]
#define RASTER_BWD_COUNT       10
// project_fwd (project.metal): `constant long* ints` and `constant float* floats`
#define PROJECT_FWD_INTS_C           0
#define PROJECT_FWD_INTS_N           1
#define PROJECT_FWD_INTS_WIDTH       2
#define PROJECT_FWD_INTS_HEIGHT      3
#define PROJECT_FWD_INTS_CALC_COMP   4  // write compensations
#define PROJECT_FWD_INTS_FLAGS       5  // PROJECT_* bits (0: the plain stage)
#define PROJECT_FWD_INTS_DEGREE      6  // SH degree in use, 0..4
#define PROJECT_FWD_INTS_DC_STRIDE   7
#define PROJECT_FWD_INTS_REST_STRIDE 8
#define PROJECT_FWD_INTS_REST_OFFSET 9  // (prepare.py _layout)
#define PROJECT_FWD_INTS_COUNT       10
#define PROJECT_FWD_FLOATS_EPS2D       0
#define PROJECT_FWD_FLOATS_NEAR_PLANE  1
#define PROJECT_FWD_FLOATS_FAR_PLANE   2
#define PROJECT_FWD_FLOATS_RADIUS_CLIP 3
#define PROJECT_FWD_FLOATS_COUNT       4
// adam_step (adam.metal)
#define ADAM_STEP_N       0   // rows (gaussians)
#define ADAM_STEP_WIDTHS  1   // byte k: floats per row of slot k
#define ADAM_STEP_CAMS    2   // 0: every gaussian steps; else only one with a radius > 0 in a camera
#define ADAM_STEP_AVG0    3   // element offset of slot 0's exp_avg in the exp_avg arena
#define ADAM_STEP_AVG1    4
#define ADAM_STEP_AVG2    5
#define ADAM_STEP_AVG3    6
#define ADAM_STEP_AVG4    7
#define ADAM_STEP_AVG5    8
#define ADAM_STEP_AVG_SQ0 9   // of its exp_avg_sq in the exp_avg_sq arena
#define ADAM_STEP_AVG_SQ1 10
#define ADAM_STEP_AVG_SQ2 11
#define ADAM_STEP_AVG_SQ3 12
#define ADAM_STEP_AVG_SQ4 13
#define ADAM_STEP_AVG_SQ5 14
#define ADAM_STEP_COUNT   15
// project_bwd (project_bwd.metal)
#define PROJECT_BWD_N                0   // gaussians
#define PROJECT_BWD_WIDTH            1
#define PROJECT_BWD_HEIGHT           2
#define PROJECT_BWD_N_GROUPS         3   // threadgroups along the gaussians
#define PROJECT_BWD_EPS2D            4   // the float32's bits
#define PROJECT_BWD_FLAGS            5   // project_bwd.metal PROJECT_* bits
#define PROJECT_BWD_V_MEANS          6   // element offset in grads (PROJECT_ADAM_MEANS: of its exp_avg in exp_avgs)
#define PROJECT_BWD_V_QUATS          7
#define PROJECT_BWD_V_SCALES         8
#define PROJECT_BWD_V_OPACITIES      9
#define PROJECT_BWD_V_SH_DC          10  // (PROJECT_SH_ADAM: of the SH exp_avgs in exp_avgs)
#define PROJECT_BWD_V_SH_REST        11
#define PROJECT_BWD_AVG_SQ_MEANS     12  // element offset of its exp_avg_sq in exp_avg_sqs
#define PROJECT_BWD_AVG_SQ_QUATS     13
#define PROJECT_BWD_AVG_SQ_SCALES    14
#define PROJECT_BWD_AVG_SQ_OPACITIES 15
#define PROJECT_BWD_AVG_SQ_DC        16
#define PROJECT_BWD_AVG_SQ_REST      17
#define PROJECT_BWD_COUNT            18
