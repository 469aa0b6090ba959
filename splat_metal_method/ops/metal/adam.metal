// adam.metal: Adam over every gaussian parameter tensor in one per-gaussian pass after the backward, with
// the NaN guard's flag folded in. Compiled after common.h: kernels.py prepends it.
//
// The step reads and writes torch's own optimizer state (exp_avg, exp_avg_sq, a float32 device `step`
// per parameter, as torch's fused Adam keeps it), so checkpoints, gsplat's densification (which slices
// that state) and resumes see what torch's Adam leaves. The unfused twin it is tested against is
// torch.optim.Adam (tests/ops/metal/test_adam.py); the math is torch's MPS `_fused_adam_` (adam_math in
// aten/src/ATen/native/mps/kernels/FusedOptimizerOps.metal), in its float32 operations and order:
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g g
//   p -= (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// Why a kernel: torch issues two dispatches per parameter group (the step counter's _foreach_add_ and
// _fused_adam_, six groups) and the NaN guard then read every parameter and gradient again.
// SPLAT_ADAM_SLOTS, SPLAT_ADAM_COEFS and the element update splat_adam_update: common.h (project_bwd.metal's
// SH step, PROJECT_SH_ADAM, uses them too).

// adam_prepare: one thread per slot k < SPLAT_ADAM_SLOTS. step[k] += 1, then the slot's coefficients
// from the new step, as _fused_adam_ derives them (float32, precise pow and sqrt); thread 0 also clears
// the flag and stores b1, b2 after the slots' coefficients. Runs before adam_step in the same queue, so
// adam_step only reads what this wrote. Bounds: 6 threads, each its own slot; unused slots (fewer
// tensors) are bound to a real slot's step and skipped (k >= slots).
[[max_total_threads_per_threadgroup(SPLAT_ADAM_SLOTS)]]
kernel void adam_prepare(
    device float* step0 [[buffer(0)]], device float* step1 [[buffer(1)]],  // [1] each: torch's state["step"]
    device float* step2 [[buffer(2)]], device float* step3 [[buffer(3)]],
    device float* step4 [[buffer(4)]], device float* step5 [[buffer(5)]],
    constant float& lr0 [[buffer(6)]], constant float& lr1 [[buffer(7)]],
    constant float& lr2 [[buffer(8)]], constant float& lr3 [[buffer(9)]],
    constant float& lr4 [[buffer(10)]], constant float& lr5 [[buffer(11)]],
    constant float& eps0 [[buffer(12)]], constant float& eps1 [[buffer(13)]],
    constant float& eps2 [[buffer(14)]], constant float& eps3 [[buffer(15)]],
    constant float& eps4 [[buffer(16)]], constant float& eps5 [[buffer(17)]],
    constant float& beta1 [[buffer(18)]],
    constant float& beta2 [[buffer(19)]],
    constant long& slots [[buffer(20)]],
    device float* coef [[buffer(21)]],  // [SLOTS * COEFS + 2]
    device float* flag [[buffer(22)]],  // [1]: 0 here, NaN from adam_step where a value is not finite
    uint k [[thread_position_in_grid]]) {
  if (k == 0) {
    flag[0] = 0.0f;
    coef[SPLAT_ADAM_SLOTS * SPLAT_ADAM_COEFS + 0] = beta1;
    coef[SPLAT_ADAM_SLOTS * SPLAT_ADAM_COEFS + 1] = beta2;
  }
  if ((long)k >= slots || k >= SPLAT_ADAM_SLOTS) {
    return;
  }
  device float* step = k == 0 ? step0 : k == 1 ? step1 : k == 2 ? step2 : k == 3 ? step3 : k == 4 ? step4 : step5;
  const float lr = k == 0 ? lr0 : k == 1 ? lr1 : k == 2 ? lr2 : k == 3 ? lr3 : k == 4 ? lr4 : lr5;
  const float eps = k == 0 ? eps0 : k == 1 ? eps1 : k == 2 ? eps2 : k == 3 ? eps3 : k == 4 ? eps4 : eps5;
  const float t = step[0] + 1.0f;
  step[0] = t;
  const float bias_correction1 = 1.0f - precise::pow(beta1, t);
  const float bias_correction2 = 1.0f - precise::pow(beta2, t);
  coef[SPLAT_ADAM_COEFS * k + 0] = lr / bias_correction1;
  coef[SPLAT_ADAM_COEFS * k + 1] = precise::sqrt(bias_correction2);
  coef[SPLAT_ADAM_COEFS * k + 2] = eps;
  coef[SPLAT_ADAM_COEFS * k + 3] = 0.0f;
}

// Adam on the `width` floats of row n of slot `slot`'s parameter p (its moments at the slot's offsets in the
// arenas); false when a gradient or an updated parameter is not finite (what the NaN guard reads after the step:
// the parameters and their gradients).
inline bool adam_row(device float* p, const device float* g, device float* exp_avgs, device float* exp_avg_sqs,
                     constant long* params, long width, long n, const device float* coef, long slot, float b1,
                     float b2) {
  device float* m = exp_avgs + params[ADAM_STEP_AVG0 + slot];
  device float* v = exp_avg_sqs + params[ADAM_STEP_AVG_SQ0 + slot];
  bool ok = true;
  for (long j = 0; j < width; ++j) {
    const long i = n * width + j;
    const float grad = g[i];
    float exp_avg = m[i], exp_avg_sq = v[i];
    const float param = splat_adam_update(p[i], grad, &exp_avg, &exp_avg_sq, coef, slot, b1, b2);
    m[i] = exp_avg;
    v[i] = exp_avg_sq;
    p[i] = param;
    ok = ok && isfinite(grad) && isfinite(param);
  }
  return ok;
}

// adam_step: one thread per gaussian n < N: Adam on row n of every slot (parameter p, gradient g, moments m
// and v, all [N, width_k] contiguous float32; width_k is byte k of `widths`, 0 for an unused slot), in place.
// The moments of every slot live in two allocations, torch's state a view of each (the moment arenas,
// adam.py): slot k's exp_avg starts at element params[ADAM_STEP_AVG0 + k] of exp_avgs, its exp_avg_sq at
// params[ADAM_STEP_AVG_SQ0 + k] of exp_avg_sqs, so 6 slots bind 2 moment buffers, not 12.
// The NaN guard's verdict comes out of the same pass: a simdgroup with a non-finite
// gradient or updated parameter (simd_any, one vote) has its first lane store NaN into flag[0] with
// one atomic; a finite step issues no atomic. No barriers, no threadgroup memory: threads past N vote
// "finite" and do nothing else. With `cams` > 0 (the model's visible_adam, engine/optimizers.py) a gaussian
// whose radius is 0 in every one of the render's cameras takes no step: its row of every slot (parameter and
// both moments) is neither read nor written (gsplat's SelectiveAdam; the step counters stay per tensor). Bounds: n < N checked before any access; row n of slot k is
// [n * width_k, (n + 1) * width_k) from its views' offsets (the host checks every view lies in its arena, none
// overlapping another).
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void adam_step(
    device float* p0 [[buffer(0)]], const device float* g0 [[buffer(1)]],
    device float* p1 [[buffer(2)]], const device float* g1 [[buffer(3)]],
    device float* p2 [[buffer(4)]], const device float* g2 [[buffer(5)]],
    device float* p3 [[buffer(6)]], const device float* g3 [[buffer(7)]],
    device float* p4 [[buffer(8)]], const device float* g4 [[buffer(9)]],
    device float* p5 [[buffer(10)]], const device float* g5 [[buffer(11)]],
    device float* exp_avgs [[buffer(12)]],     // the exp_avg arena: every slot's exp_avg at its offset
    device float* exp_avg_sqs [[buffer(13)]],  // the exp_avg_sq arena
    const device float* coef [[buffer(14)]],   // [SLOTS * COEFS + 2] from adam_prepare
    device atomic_float* flag [[buffer(15)]],  // [1]
    constant long* params [[buffer(16)]],      // [ADAM_STEP_COUNT] common.h ADAM_STEP_*
    const device int* radii [[buffer(17)]],    // [cams, N] the render's radii (visible_adam), else a placeholder
    uint n [[thread_position_in_grid]]) {
  const long N = params[ADAM_STEP_N];
  const long widths = params[ADAM_STEP_WIDTHS];
  const long cams = params[ADAM_STEP_CAMS];
  bool ok = true;
  bool visible = cams == 0;
  for (long c = 0; c < cams && !visible && (long)n < N; ++c) {
    visible = radii[c * N + n] > 0;
  }
  if ((long)n < N && visible) {
    const float b1 = coef[SPLAT_ADAM_SLOTS * SPLAT_ADAM_COEFS + 0];
    const float b2 = coef[SPLAT_ADAM_SLOTS * SPLAT_ADAM_COEFS + 1];
    ok = adam_row(p0, g0, exp_avgs, exp_avg_sqs, params, (widths >> 0) & 255, n, coef, 0, b1, b2) && ok;
    ok = adam_row(p1, g1, exp_avgs, exp_avg_sqs, params, (widths >> 8) & 255, n, coef, 1, b1, b2) && ok;
    ok = adam_row(p2, g2, exp_avgs, exp_avg_sqs, params, (widths >> 16) & 255, n, coef, 2, b1, b2) && ok;
    ok = adam_row(p3, g3, exp_avgs, exp_avg_sqs, params, (widths >> 24) & 255, n, coef, 3, b1, b2) && ok;
    ok = adam_row(p4, g4, exp_avgs, exp_avg_sqs, params, (widths >> 32) & 255, n, coef, 4, b1, b2) && ok;
    ok = adam_row(p5, g5, exp_avgs, exp_avg_sqs, params, (widths >> 40) & 255, n, coef, 5, b1, b2) && ok;
  }
  if (simd_any(!ok) && simd_is_first()) {
    atomic_store_explicit(flag, as_type<float>(0x7fc00000u), memory_order_relaxed);  // a quiet NaN
  }
}
