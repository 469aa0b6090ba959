// Native CPU rasterization: tile-parallel alpha compositing, forward and backward.
//
// Semantics are the reference backend's (ops/reference.py) and gsplat 1.4's: per pixel, the tile's
// depth-sorted gaussians are composited front to back; a gaussian is skipped where sigma is not
// finite or < 0, or its unclamped alpha (opacity exp(-sigma)) is not finite, or its alpha < alpha_min
// (explicit isfinite checks, the same in forward and backward: README "Known limits"); alpha is clamped
// to alpha_max, and a pixel stops before the gaussian that would take its transmittance to <= t_min.
// A gaussian whose mean, conic or opacity is not finite fails that rule at every pixel, so it is
// skipped whole (make_splat).
//
// Speed comes from doing only the work that matters and doing it in vector registers: each gaussian
// visits only the rows of its tile that its alpha >= alpha_min ellipse crosses (with slack, so every
// pixel it can reach is still tested with the exact rule), a row is one branch-free vector loop
// over structure-of-arrays pixel state (exp is inlined arithmetic), rows and tiles whose pixels
// have all stopped are skipped, and tiles run on `n_threads` threads.
//
// Determinism: a tile's pixels and its per-intersection gradients are computed by one thread in a
// fixed order, and gradients are summed per gaussian in intersection order after all threads
// joined. Results are bit-identical for any thread count.
//
// Layouts (all contiguous, float32 unless noted; G = C * N gaussians over all cameras):
//   means2d [G, 2], conics [G, 3] (a, b, c: sigma = 0.5 (a dx^2 + c dy^2) + b dx dy),
//   colors [G, D], opacities [G], isect_offsets [C, tile_h, tile_w] int32, flatten_ids [M] int32
//   (index into G), images [C, H, W, D], per-pixel maps [C, H, W].

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"

// Tells the compiler a loop's iterations are independent (it cannot prove it through pointers).
#if defined(__clang__)
#define VECTORIZE _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define VECTORIZE _Pragma("GCC ivdep")
#else
#define VECTORIZE
#endif

namespace {

struct Params {
    int C, D, width, height, tile_size, tile_w, tile_h;
    int64_t M;
    float alpha_max, alpha_min, t_min;
};

// Pixel rectangle [x0, x1) x [y0, y1) of tile `tile` (camera-major index) clipped to the image.
struct TileRect {
    int cam, x0, x1, y0, y1;
};

TileRect tile_rect(const Params& p, int64_t tile) {
    int64_t per_cam = (int64_t)p.tile_w * p.tile_h;
    int cam = (int)(tile / per_cam);
    int64_t local = tile % per_cam;
    int tx = (int)(local % p.tile_w), ty = (int)(local / p.tile_w);
    TileRect r;
    r.cam = cam;
    r.x0 = tx * p.tile_size;
    r.y0 = ty * p.tile_size;
    r.x1 = std::min(r.x0 + p.tile_size, p.width);
    r.y1 = std::min(r.y0 + p.tile_size, p.height);
    return r;
}

// exp(x) for float x, to about 1 ulp, as plain arithmetic so pixel loops vectorise (a libm call
// would stop that). Cephes' expf: x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial.
inline float fast_exp(float x) {
    // Clamped so that NaN becomes -87 too: the float-to-int conversion below must see a finite value
    // (converting NaN or an out-of-range float to int is undefined behaviour). Callers test sigma with
    // isfinite themselves.
    x = x > -87.0f ? x : -87.0f;
    x = x < 88.0f ? x : 88.0f;
    // n = round(x / ln2): t + 128.5 > 0 here, so truncation is floor (branch-free, vectorises).
    int32_t n = (int32_t)(x * 1.44269504088896341f + 128.5f) - 128;
    float fn = (float)n;
    float r = x - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    float q = 1.9875691500e-4f;
    q = q * r + 1.3981999507e-3f;
    q = q * r + 8.3334519073e-3f;
    q = q * r + 4.1665795894e-2f;
    q = q * r + 1.6666665459e-1f;
    q = q * r + 5.0000001201e-1f;
    q = q * r * r + r + 1.0f;
    int32_t bits = (n + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return q * scale;
}

// One gaussian as a tile sees it, and which of the tile's rows it can reach: alpha >= alpha_min
// needs sigma <= level = log(opacity / alpha_min), an ellipse; its rows (with slack on the level
// and a one-row margin) are the only ones composited, so every pixel the exact rule could accept is
// still tested with it.
struct Splat {
    float mx, my, a, b, c, opacity;
    const float* color;
    bool whole_tile;  // conic not positive definite or not finite: test every pixel of the tile
    float two_a_level, det;  // for row_reachable
    int ly0, ly1;  // tile-local rows it can reach
};

bool make_splat(const Params& p, const TileRect& r, const float* means2d, const float* conics, const float* colors,
                const float* opacities, int64_t g, Splat& s) {
    s.opacity = opacities[g];
    s.mx = means2d[2 * g], s.my = means2d[2 * g + 1];
    s.a = conics[3 * g], s.b = conics[3 * g + 1], s.c = conics[3 * g + 2];
    // Not finite: sigma or opacity exp(-sigma) is not finite at any pixel, so the per-pixel rule skips it.
    if (!(std::isfinite(s.opacity) && std::isfinite(s.mx) && std::isfinite(s.my) && std::isfinite(s.a) &&
          std::isfinite(s.b) && std::isfinite(s.c)))
        return false;
    if (!(s.opacity >= p.alpha_min)) return false;  // alpha = opacity * exp(-sigma) <= opacity
    s.color = colors + g * p.D;
    int h = r.y1 - r.y0;
    s.ly0 = 0, s.ly1 = h;
    double det = (double)s.a * s.c - (double)s.b * s.b;
    double level = std::log((double)s.opacity / p.alpha_min) * (1.0 + 1e-3) + 1e-3;
    // The ellipse {d : 0.5 d^T A d <= level} spans sqrt(2 level (A^-1)_yy) rows around my.
    double ey = std::sqrt(2.0 * level * s.a / det) + 1.0;
    s.whole_tile = !(det > 0.0) || !(s.a > 0.0f) || !std::isfinite(s.mx) || !std::isfinite(s.my) ||
                   !std::isfinite(ey) || !std::isfinite((float)(2.0 * s.a * level));
    if (s.whole_tile) return true;
    s.two_a_level = (float)(2.0 * s.a * level);
    s.det = (float)det;
    // Row y (centre y + 0.5) is reachable only if |my - (y + 0.5)| <= ey.
    s.ly0 = (int)std::max(0.0, std::min((double)h, std::floor(s.my - ey - 0.5) - r.y0));
    s.ly1 = (int)std::max(0.0, std::min((double)h, std::ceil(s.my + ey - 0.5) - r.y0 + 1));
    return s.ly0 < s.ly1;
}

// Whether the splat can reach a pixel of tile-local row ly: the row's centre line crosses the
// ellipse sigma <= level (with its slack). The whole row is then composited with the exact rule;
// a full tile row is one or two vector iterations, cheaper than finding the columns.
inline bool row_reachable(const Splat& s, const TileRect& r, int ly) {
    if (s.whole_tile) return true;
    // sigma(dx) = 0.5 a dx^2 + b dy dx + 0.5 c dy^2 has its minimum over dx below level iff
    // 2 a level - det dy^2 >= 0.
    float dy = s.my - ((float)(r.y0 + ly) + 0.5f);
    return s.two_a_level - s.det * dy * dy >= 0.0f;
}

// Backward, one row of one gaussian, first pass: undo this gaussian in T (back to front) and record
// what the colour pass and the gradient pass need (zero where the pixel did not use it).
void backward_row_alphas(int w, float x0, float dy, const Splat& s, float alpha_max, float alpha_min,
                         int32_t i, float* __restrict T_row, const float* __restrict T_final_row,
                         const float* __restrict v_alpha_out_row, const int32_t* __restrict last_row,
                         float* __restrict dxs, float* __restrict vis, float* __restrict alpha_raw,
                         float* __restrict T_before, float* __restrict ra, float* __restrict fac,
                         float* __restrict v_alpha, float* __restrict grad_ok) {
    const float a = s.a, b = s.b, c = s.c, mx = s.mx, opacity = s.opacity;
    VECTORIZE  // all row arrays are distinct (and __restrict)
    for (int x = 0; x < w; ++x) {
        float dx = mx - ((x0 + (float)x) + 0.5f);
        float sigma = 0.5f * (a * dx * dx + c * dy * dy) + b * dx * dy;
        float e = fast_exp(-sigma);
        float raw = opacity * e;
        float alpha = std::min(alpha_max, raw);
        // 1 where the pixel composited this gaussian, else 0: multiplying by it (exact, everything
        // is finite) instead of selecting keeps the loop vectorisable.
        float used = (float)((last_row[x] >= i) & std::isfinite(sigma) & (sigma >= 0.0f) & std::isfinite(raw) &
                             (alpha >= alpha_min));
        float r_alpha = 1.0f / (1.0f - alpha);
        float T_b = used != 0.0f ? T_row[x] * r_alpha : T_row[x];  // transmittance before this gaussian
        T_row[x] = T_b;
        dxs[x] = dx;
        vis[x] = e;
        alpha_raw[x] = raw;
        T_before[x] = used * T_b;
        ra[x] = used * r_alpha;
        fac[x] = used * (alpha * T_b);
        // render_alpha = 1 - T_final and T_final has the factor (1 - alpha).
        v_alpha[x] = used * (T_final_row[x] * r_alpha * v_alpha_out_row[x]);
        grad_ok[x] = used * (float)(raw <= alpha_max);  // the alpha clamp passes no gradient
    }
}

// Backward, one row of one gaussian, last pass: per-column partial sums of its gradients
// (partial [K, stride]: means2d x/y, conic a/b/c, opacity, D colours (filled by the colour pass),
// |x|, |y|; columns w..stride stay 0).
void backward_row_partials(int w, int stride, int D, float dy, const Splat& s, const float* __restrict dxs,
                           const float* __restrict vis, const float* __restrict alpha_raw,
                           const float* __restrict v_alpha, const float* __restrict grad_ok, float* partial) {
    const float a = s.a, b = s.b, c = s.c;
    float* p_x = partial;
    float* p_y = partial + stride;
    float* p_a = partial + 2 * stride;
    float* p_b = partial + 3 * stride;
    float* p_c = partial + 4 * stride;
    float* p_opacity = partial + 5 * stride;
    float* p_abs_x = partial + (size_t)(6 + D) * stride;
    float* p_abs_y = partial + (size_t)(7 + D) * stride;
    VECTORIZE  // the p_* rows of `partial` never overlap
    for (int x = 0; x < w; ++x) {
        float v_sigma = grad_ok[x] * (-alpha_raw[x] * v_alpha[x]);
        float dx = dxs[x];
        float gx = v_sigma * (a * dx + b * dy), gy = v_sigma * (b * dx + c * dy);
        p_x[x] += gx;
        p_y[x] += gy;
        p_a[x] += 0.5f * v_sigma * dx * dx;
        p_b[x] += v_sigma * dx * dy;
        p_c[x] += 0.5f * v_sigma * dy * dy;
        p_opacity[x] += grad_ok[x] * vis[x] * v_alpha[x];
        p_abs_x[x] += std::fabs(gx);
        p_abs_y[x] += std::fabs(gy);
    }
}

int64_t tile_end(const Params& p, const int32_t* offsets, int64_t tile) {
    int64_t n_tiles = (int64_t)p.C * p.tile_w * p.tile_h;
    return tile + 1 < n_tiles ? offsets[tile + 1] : p.M;
}

}  // namespace

extern "C" {

// Forward. Writes out_colors [C,H,W,D] (no background), out_trans [C,H,W] (final transmittance),
// out_last [C,H,W] int32 (index into flatten_ids of the last gaussian composited, -1 if none) and
// out_stopped [C,H,W] uint8 (1 where the pixel hit the transmittance floor).
// trans_in [C,H,W] and stopped_in [C,H,W] uint8 (both null for a whole render) resume compositing
// from an earlier depth chunk: pixels start at that transmittance, stopped ones stay as they are.
int splat_rasterize_fwd(int C, int D, int width, int height, int tile_size, int tile_w, int tile_h, int64_t M,
                        float alpha_max, float alpha_min, float t_min, const float* means2d, const float* conics,
                        const float* colors, const float* opacities, const int32_t* isect_offsets,
                        const int32_t* flatten_ids, const float* trans_in, const uint8_t* stopped_in,
                        float* out_colors, float* out_trans, int32_t* out_last, uint8_t* out_stopped,
                        int n_threads) {
    Params p{C, D, width, height, tile_size, tile_w, tile_h, M, alpha_max, alpha_min, t_min};
    int64_t n_tiles = (int64_t)C * tile_w * tile_h;
    splat::parallel_for(n_tiles, n_threads, [&](int64_t tile) {
        TileRect r = tile_rect(p, tile);
        const int w = r.x1 - r.x0, h = r.y1 - r.y0, P = w * h;
        // Per-pixel state, structure of arrays (row-major in the tile) so the loops vectorise.
        std::vector<float> T(P, 1.0f), stopped(P, 0.0f), acc((size_t)D * P, 0.0f), weight(w);
        std::vector<int32_t> last(P, -1);
        int n_running = P;
        std::vector<int> row_running(h, w);  // pixels of each row still compositing
        if (trans_in != nullptr) {
            for (int ly = 0; ly < h; ++ly) {
                for (int lx = 0; lx < w; ++lx) {
                    int64_t pix = ((int64_t)r.cam * height + r.y0 + ly) * width + r.x0 + lx;
                    T[ly * w + lx] = trans_in[pix];
                    if (stopped_in[pix]) {
                        stopped[ly * w + lx] = 1.0f;
                        --row_running[ly];
                        --n_running;
                    }
                }
            }
        }
        int64_t start = isect_offsets[tile], end = tile_end(p, isect_offsets, tile);
        for (int64_t i = start; i < end && n_running > 0; ++i) {
            Splat s;
            if (!make_splat(p, r, means2d, conics, colors, opacities, flatten_ids[i], s)) continue;
            const float a = s.a, b = s.b, c = s.c, mx = s.mx, opacity = s.opacity;
            const int32_t i32 = (int32_t)i;
            for (int ly = s.ly0; ly < s.ly1; ++ly) {
                if (row_running[ly] == 0 || !row_reachable(s, r, ly)) continue;
                const float dy = s.my - ((float)(r.y0 + ly) + 0.5f);
                float* T_row = &T[ly * w];
                float* stopped_row = &stopped[ly * w];
                int32_t* last_row = &last[ly * w];
                int n_stopping = 0;
                VECTORIZE  // T_row, stopped_row, last_row and weight are distinct arrays
                for (int x = 0; x < w; ++x) {
                    float dx = mx - ((float)(r.x0 + x) + 0.5f);
                    float sigma = 0.5f * (a * dx * dx + c * dy * dy) + b * dx * dy;
                    float raw = opacity * fast_exp(-sigma);
                    float alpha = std::min(alpha_max, raw);
                    float next_T = T_row[x] * (1.0f - alpha);
                    bool hit = std::isfinite(sigma) & (sigma >= 0.0f) & std::isfinite(raw) & (alpha >= alpha_min) &
                               (stopped_row[x] == 0.0f);
                    bool use = hit & (next_T > t_min);
                    bool stop = hit & (next_T <= t_min);  // the pixel stops before this gaussian
                    weight[x] = use ? alpha * T_row[x] : 0.0f;
                    T_row[x] = use ? next_T : T_row[x];
                    stopped_row[x] = stop ? 1.0f : stopped_row[x];
                    last_row[x] += (int32_t)use * (i32 - last_row[x]);  // arithmetic select: vectorises
                    n_stopping += stop;
                }
                for (int d = 0; d < D; ++d) {
                    const float cd = s.color[d];
                    float* acc_row = &acc[(size_t)d * P + ly * w];
                    for (int x = 0; x < w; ++x) acc_row[x] += weight[x] * cd;
                }
                n_running -= n_stopping;
                row_running[ly] -= n_stopping;
            }
        }
        for (int ly = 0; ly < h; ++ly) {
            for (int lx = 0; lx < w; ++lx) {
                int q = ly * w + lx;
                int64_t pix = ((int64_t)r.cam * height + r.y0 + ly) * width + r.x0 + lx;
                for (int d = 0; d < D; ++d) out_colors[pix * D + d] = acc[(size_t)d * P + q];
                out_trans[pix] = T[q];
                out_last[pix] = last[q];
                out_stopped[pix] = stopped[q] != 0.0f;
            }
        }
    }, 1);
    return 0;
}

// Backward. From the forward's final transmittance and last index per pixel, walks each tile's
// gaussians back to front and writes the gradients of every intersection to isect_grads [M, K]
// with K = 2 (means2d) + 3 (conics) + 1 (opacity) + D (colors) + 2 (|per-pixel means2d grads|),
// then sums them per gaussian (in intersection order) into v_means2d [G,2], v_conics [G,3],
// v_opacities [G], v_colors [G,D] and absgrad [G,2] (all added to, so zero them first).
int splat_rasterize_bwd(int C, int D, int width, int height, int tile_size, int tile_w, int tile_h, int64_t M,
                        float alpha_max, float alpha_min, float t_min, const float* means2d, const float* conics,
                        const float* colors, const float* opacities, const int32_t* isect_offsets,
                        const int32_t* flatten_ids, const float* final_trans, const int32_t* final_last,
                        const float* v_render_colors, const float* v_render_alphas, float* isect_grads,
                        float* v_means2d, float* v_conics, float* v_opacities, float* v_colors, float* absgrad,
                        int n_threads) {
    Params p{C, D, width, height, tile_size, tile_w, tile_h, M, alpha_max, alpha_min, t_min};
    const int K = 2 + 3 + 1 + D + 2;
    int64_t n_tiles = (int64_t)C * tile_w * tile_h;
    std::memset(isect_grads, 0, sizeof(float) * (size_t)M * K);
    splat::parallel_for(n_tiles, n_threads, [&](int64_t tile) {
        TileRect r = tile_rect(p, tile);
        const int w = r.x1 - r.x0, h = r.y1 - r.y0, P = w * h;
        int64_t start = isect_offsets[tile], end = tile_end(p, isect_offsets, tile);
        if (end <= start) return;
        // Per-pixel state walking back to front (structure of arrays): T, the transmittance before
        // the current gaussian once it is divided out; the colour composited behind it; the
        // pixel's final T, last index and output gradients.
        std::vector<float> T(P), T_final(P), behind((size_t)D * P, 0.0f), v_out((size_t)D * P), v_alpha_out(P);
        std::vector<int32_t> last(P);
        int32_t max_last = -1;
        std::vector<int32_t> row_max_last(h, -1);  // no gaussian after this one touches the row
        for (int ly = 0; ly < h; ++ly) {
            for (int lx = 0; lx < w; ++lx) {
                int q = ly * w + lx;
                int64_t pix = ((int64_t)r.cam * height + r.y0 + ly) * width + r.x0 + lx;
                T[q] = T_final[q] = final_trans[pix];
                last[q] = final_last[pix];
                max_last = std::max(max_last, last[q]);
                row_max_last[ly] = std::max(row_max_last[ly], last[q]);
                for (int d = 0; d < D; ++d) v_out[(size_t)d * P + q] = v_render_colors[pix * D + d];
                v_alpha_out[q] = v_render_alphas[pix];
            }
        }
        // Per-row scratch, and per-column partial sums of this gaussian's gradients, summed over the
        // columns once per gaussian by a fixed pairwise tree (deterministic, and it vectorises):
        // rows of `stride` = w rounded up to a power of two, zero-padded.
        std::vector<float> dxs(w), vis(w), alpha_raw(w), T_before(w), ra(w), fac(w), v_alpha(w), grad_ok(w);
        int stride = 1;
        while (stride < w) stride *= 2;
        std::vector<float> partial((size_t)K * stride);
        for (int64_t i = std::min<int64_t>(end - 1, max_last); i >= start; --i) {
            Splat s;
            if (!make_splat(p, r, means2d, conics, colors, opacities, flatten_ids[i], s)) continue;
            const int32_t i32 = (int32_t)i;
            bool touched = false;
            for (int ly = s.ly0; ly < s.ly1; ++ly) {
                if (row_max_last[ly] < i || !row_reachable(s, r, ly)) continue;
                if (!touched) std::fill(partial.begin(), partial.end(), 0.0f);
                touched = true;
                const float dy = s.my - ((float)(r.y0 + ly) + 0.5f);
                float* T_row = &T[ly * w];
                const float* T_final_row = &T_final[ly * w];
                const float* v_alpha_out_row = &v_alpha_out[ly * w];
                const int32_t* last_row = &last[ly * w];
                backward_row_alphas(w, (float)r.x0, dy, s, alpha_max, alpha_min, i32, T_row, T_final_row,
                                    v_alpha_out_row, last_row, dxs.data(), vis.data(), alpha_raw.data(),
                                    T_before.data(), ra.data(), fac.data(), v_alpha.data(), grad_ok.data());
                for (int d = 0; d < D; ++d) {
                    const float cd = s.color[d];
                    const float* v_row = &v_out[(size_t)d * P + ly * w];
                    float* behind_row = &behind[(size_t)d * P + ly * w];
                    float* partial_color = &partial[(size_t)(6 + d) * stride];
                    VECTORIZE  // distinct rows of distinct arrays
                    for (int x = 0; x < w; ++x) {
                        v_alpha[x] += (cd * T_before[x] - behind_row[x] * ra[x]) * v_row[x];
                        partial_color[x] += fac[x] * v_row[x];
                        behind_row[x] += cd * fac[x];
                    }
                }
                backward_row_partials(w, stride, D, dy, s, dxs.data(), vis.data(), alpha_raw.data(), v_alpha.data(),
                                      grad_ok.data(), partial.data());
            }
            if (!touched) continue;
            for (int step = stride / 2; step >= 1; step /= 2) {
                for (int k = 0; k < K; ++k) {
                    float* row = &partial[(size_t)k * stride];
                    for (int x = 0; x < step; ++x) row[x] += row[x + step];
                }
            }
            float* grad = isect_grads + (size_t)i * K;
            for (int k = 0; k < K; ++k) grad[k] = partial[(size_t)k * stride];
        }
    }, 1);
    // Deterministic reduction: one pass over the intersections in their sorted order.
    for (int64_t i = 0; i < M; ++i) {
        int64_t g = flatten_ids[i];
        const float* grad = isect_grads + (size_t)i * K;
        v_means2d[2 * g] += grad[0];
        v_means2d[2 * g + 1] += grad[1];
        v_conics[3 * g] += grad[2];
        v_conics[3 * g + 1] += grad[3];
        v_conics[3 * g + 2] += grad[4];
        v_opacities[g] += grad[5];
        for (int d = 0; d < D; ++d) v_colors[g * D + d] += grad[6 + d];
        absgrad[2 * g] += grad[6 + D];
        absgrad[2 * g + 1] += grad[7 + D];
    }
    return 0;
}

}  // extern "C"
