// Native CPU rasterization: tile-parallel alpha compositing, forward and backward.
//
// Semantics are the reference backend's (ops/reference.py) and gsplat 1.4's: per pixel, the tile's
// depth-sorted gaussians are composited front to back; a gaussian is skipped where sigma < 0 or its
// alpha < alpha_min, alpha is clamped to alpha_max, and a pixel stops before the gaussian that would
// take its transmittance to <= t_min.
//
// Speed comes from doing only the work that matters: each gaussian touches only the pixels of its
// tile inside the bounding box of its alpha >= alpha_min ellipse (plus a one-pixel margin, so every
// pixel it can reach is still tested with the exact rule), a tile stops once all its pixels have
// stopped, and tiles run on `n_threads` threads.
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
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

struct Params {
    int C, D, width, height, tile_size, tile_w, tile_h;
    int64_t M;
    float alpha_max, alpha_min, t_min;
};

// Runs fn(tile) for every tile index in [0, n_tiles) on n_threads threads (dynamic schedule).
template <typename Fn>
void for_each_tile(int64_t n_tiles, int n_threads, Fn fn) {
    std::atomic<int64_t> next(0);
    auto worker = [&]() {
        for (int64_t t = next++; t < n_tiles; t = next++) fn(t);
    };
    int n = std::max(1, std::min<int>(n_threads, (int)std::min<int64_t>(n_tiles, 256)));
    std::vector<std::thread> pool;
    for (int i = 1; i < n; ++i) pool.emplace_back(worker);
    worker();
    for (auto& th : pool) th.join();
}

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

// The pixels of `r` a gaussian can reach (alpha >= alpha_min), as a rectangle in tile-local pixel
// coordinates. Falls back to the whole tile when the conic is not positive definite.
void reach_rect(const Params& p, const TileRect& r, float mx, float my, float a, float b, float c, float opacity,
                int& lx0, int& lx1, int& ly0, int& ly1) {
    int w = r.x1 - r.x0, h = r.y1 - r.y0;
    lx0 = 0, lx1 = w, ly0 = 0, ly1 = h;
    float det = a * c - b * b;
    float level = std::log(opacity / p.alpha_min);  // sigma beyond this gives alpha < alpha_min
    if (!(det > 0.0f) || !(a > 0.0f) || !std::isfinite(level) || !std::isfinite(mx) || !std::isfinite(my)) return;
    // {d : 0.5 d^T A d <= level} has half-extents sqrt(2 level (A^-1)_xx), sqrt(2 level (A^-1)_yy).
    double ex = std::sqrt(2.0 * level * (double)c / (double)det) + 1.0;
    double ey = std::sqrt(2.0 * level * (double)a / (double)det) + 1.0;
    if (!std::isfinite(ex) || !std::isfinite(ey)) return;
    // Pixel x (centre x + 0.5) is reachable only if |mx - (x + 0.5)| <= ex.
    double fx0 = std::floor(mx - ex - 0.5) - r.x0, fx1 = std::ceil(mx + ex - 0.5) - r.x0 + 1;
    double fy0 = std::floor(my - ey - 0.5) - r.y0, fy1 = std::ceil(my + ey - 0.5) - r.y0 + 1;
    lx0 = (int)std::max(0.0, std::min((double)w, fx0));
    lx1 = (int)std::max(0.0, std::min((double)w, fx1));
    ly0 = (int)std::max(0.0, std::min((double)h, fy0));
    ly1 = (int)std::max(0.0, std::min((double)h, fy1));
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
int splat_rasterize_fwd(int C, int D, int width, int height, int tile_size, int tile_w, int tile_h, int64_t M,
                        float alpha_max, float alpha_min, float t_min, const float* means2d, const float* conics,
                        const float* colors, const float* opacities, const int32_t* isect_offsets,
                        const int32_t* flatten_ids, float* out_colors, float* out_trans, int32_t* out_last,
                        uint8_t* out_stopped, int n_threads) {
    Params p{C, D, width, height, tile_size, tile_w, tile_h, M, alpha_max, alpha_min, t_min};
    int64_t n_tiles = (int64_t)C * tile_w * tile_h;
    for_each_tile(n_tiles, n_threads, [&](int64_t tile) {
        TileRect r = tile_rect(p, tile);
        int w = r.x1 - r.x0, h = r.y1 - r.y0, P = w * h;
        std::vector<float> T(P, 1.0f), acc((size_t)P * D, 0.0f);
        std::vector<int32_t> last(P, -1);
        std::vector<uint8_t> done(P, 0);
        int n_done = 0;
        int64_t start = isect_offsets[tile], end = tile_end(p, isect_offsets, tile);
        for (int64_t i = start; i < end && n_done < P; ++i) {
            int64_t g = flatten_ids[i];
            float mx = means2d[2 * g], my = means2d[2 * g + 1];
            float a = conics[3 * g], b = conics[3 * g + 1], c = conics[3 * g + 2];
            float opacity = opacities[g];
            if (!(opacity >= alpha_min)) continue;  // alpha = opacity * exp(-sigma) <= opacity
            int lx0, lx1, ly0, ly1;
            reach_rect(p, r, mx, my, a, b, c, opacity, lx0, lx1, ly0, ly1);
            const float* col = colors + g * D;
            for (int ly = ly0; ly < ly1; ++ly) {
                float dy = my - ((float)(r.y0 + ly) + 0.5f);
                for (int lx = lx0; lx < lx1; ++lx) {
                    int q = ly * w + lx;
                    if (done[q]) continue;
                    float dx = mx - ((float)(r.x0 + lx) + 0.5f);
                    float sigma = 0.5f * (a * dx * dx + c * dy * dy) + b * dx * dy;
                    if (sigma < 0.0f) continue;
                    float alpha = std::min(alpha_max, opacity * std::exp(-sigma));
                    if (alpha < alpha_min) continue;
                    float next_T = T[q] * (1.0f - alpha);
                    if (next_T <= t_min) {
                        done[q] = 1;
                        ++n_done;
                        continue;
                    }
                    float weight = alpha * T[q];
                    float* out = &acc[(size_t)q * D];
                    for (int d = 0; d < D; ++d) out[d] += weight * col[d];
                    T[q] = next_T;
                    last[q] = (int32_t)i;
                }
            }
        }
        for (int ly = 0; ly < h; ++ly) {
            for (int lx = 0; lx < w; ++lx) {
                int q = ly * w + lx;
                int64_t pix = ((int64_t)r.cam * height + r.y0 + ly) * width + r.x0 + lx;
                std::memcpy(out_colors + pix * D, &acc[(size_t)q * D], sizeof(float) * D);
                out_trans[pix] = T[q];
                out_last[pix] = last[q];
                out_stopped[pix] = done[q];
            }
        }
    });
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
    for_each_tile(n_tiles, n_threads, [&](int64_t tile) {
        TileRect r = tile_rect(p, tile);
        int w = r.x1 - r.x0, h = r.y1 - r.y0, P = w * h;
        int64_t start = isect_offsets[tile], end = tile_end(p, isect_offsets, tile);
        if (end <= start) return;
        // Per-pixel state, walking back to front: T (transmittance before the current gaussian once
        // divided out), the colour composited behind it, the pixel's last index and output grads.
        std::vector<float> T(P), T_final(P), behind((size_t)P * D, 0.0f), v_out((size_t)P * D), v_alpha_out(P);
        std::vector<int32_t> last(P);
        int32_t max_last = -1;
        for (int ly = 0; ly < h; ++ly) {
            for (int lx = 0; lx < w; ++lx) {
                int q = ly * w + lx;
                int64_t pix = ((int64_t)r.cam * height + r.y0 + ly) * width + r.x0 + lx;
                T[q] = T_final[q] = final_trans[pix];
                last[q] = final_last[pix];
                max_last = std::max(max_last, last[q]);
                std::memcpy(&v_out[(size_t)q * D], v_render_colors + pix * D, sizeof(float) * D);
                v_alpha_out[q] = v_render_alphas[pix];
            }
        }
        for (int64_t i = std::min<int64_t>(end - 1, max_last); i >= start; --i) {
            int64_t g = flatten_ids[i];
            float mx = means2d[2 * g], my = means2d[2 * g + 1];
            float a = conics[3 * g], b = conics[3 * g + 1], c = conics[3 * g + 2];
            float opacity = opacities[g];
            if (!(opacity >= alpha_min)) continue;
            int lx0, lx1, ly0, ly1;
            reach_rect(p, r, mx, my, a, b, c, opacity, lx0, lx1, ly0, ly1);
            const float* col = colors + g * D;
            float* grad = isect_grads + (size_t)i * K;
            for (int ly = ly0; ly < ly1; ++ly) {
                float dy = my - ((float)(r.y0 + ly) + 0.5f);
                for (int lx = lx0; lx < lx1; ++lx) {
                    int q = ly * w + lx;
                    if (i > last[q]) continue;  // behind where this pixel stopped
                    float dx = mx - ((float)(r.x0 + lx) + 0.5f);
                    float sigma = 0.5f * (a * dx * dx + c * dy * dy) + b * dx * dy;
                    if (sigma < 0.0f) continue;
                    float vis = std::exp(-sigma);
                    float alpha_raw = opacity * vis;
                    float alpha = std::min(alpha_max, alpha_raw);
                    if (alpha < alpha_min) continue;
                    float ra = 1.0f / (1.0f - alpha);
                    T[q] *= ra;  // transmittance before this gaussian
                    float fac = alpha * T[q];
                    float v_alpha = 0.0f;
                    float* bh = &behind[(size_t)q * D];
                    const float* vo = &v_out[(size_t)q * D];
                    for (int d = 0; d < D; ++d) {
                        grad[6 + d] += fac * vo[d];
                        v_alpha += (col[d] * T[q] - bh[d] * ra) * vo[d];
                        bh[d] += col[d] * fac;
                    }
                    // render_alpha = 1 - T_final and T_final contains the factor (1 - alpha).
                    v_alpha += T_final[q] * ra * v_alpha_out[q];
                    if (alpha_raw <= alpha_max) {  // the clamp passes no gradient
                        float v_sigma = -alpha_raw * v_alpha;
                        float gx = v_sigma * (a * dx + b * dy), gy = v_sigma * (b * dx + c * dy);
                        grad[0] += gx;
                        grad[1] += gy;
                        grad[2] += 0.5f * v_sigma * dx * dx;
                        grad[3] += v_sigma * dx * dy;
                        grad[4] += 0.5f * v_sigma * dy * dy;
                        grad[5] += vis * v_alpha;
                        grad[6 + D] += std::fabs(gx);
                        grad[7 + D] += std::fabs(gy);
                    }
                }
            }
        }
    });
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
