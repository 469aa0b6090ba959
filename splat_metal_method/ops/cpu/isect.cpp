// Native tile intersection: which 16x16 tiles each projected gaussian overlaps, sorted by camera,
// tile and depth (stable: ties keep emission order), exactly as the reference's isect_tiles.
//
// Instead of one global sort of M 64-bit keys, a counting sort by (camera, tile) in emission order
// (stable by construction) is followed by a stable sort by depth inside each tile, on n_threads
// threads. Same order as the reference, O(M log(M / tiles)).
//
// Layouts: means2d [G, 2] float32, radii [G] int32, depths [G] float32 with G = C * N (camera-major);
// tiles_per_gauss [G] int32; isect_ids [M] int64; flatten_ids [M] int32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"

namespace {

struct Bounds {
    int64_t x0, y0, w, h;  // first tile and span, clipped to the grid; w * h tiles when visible
};

// The reference's tile_bounds, in the same float32 operations so the clipping decisions agree.
Bounds tile_bounds(const float* means2d, const int32_t* radii, int64_t g, int tile_size, int tile_w, int tile_h) {
    Bounds b{0, 0, 0, 0};
    if (radii[g] <= 0) return b;
    float ts = (float)tile_size;
    float tx = means2d[2 * g] / ts, ty = means2d[2 * g + 1] / ts, tr = (float)radii[g] / ts;
    // A centre that is not finite covers no tile (projection never keeps one; this stage may be called
    // alone). Finite values are clamped to [0, limit] in floating point before the conversion, which
    // is undefined in C++ for a value outside int64's range.
    if (!std::isfinite(tx) || !std::isfinite(ty)) return b;
    auto clip = [](double v, int64_t limit) { return (int64_t)std::min(std::max(v, 0.0), (double)limit); };
    int64_t x0 = clip(std::floor(tx - tr), tile_w), x1 = clip(std::ceil(tx + tr), tile_w);
    int64_t y0 = clip(std::floor(ty - tr), tile_h), y1 = clip(std::ceil(ty + tr), tile_h);
    b.x0 = x0, b.y0 = y0, b.w = x1 - x0, b.h = y1 - y0;
    return b;
}

int bit_length(int64_t v) {
    int n = 0;
    while (v > 0) ++n, v >>= 1;
    return n;
}

}  // namespace

extern "C" {

// Writes tiles_per_gauss [G] and returns M, the number of intersections.
int64_t splat_isect_count(int64_t G, int tile_size, int tile_w, int tile_h, const float* means2d, const int32_t* radii,
                          int32_t* tiles_per_gauss, int n_threads) {
    splat::parallel_for(G, n_threads, [&](int64_t g) {
        Bounds b = tile_bounds(means2d, radii, g, tile_size, tile_w, tile_h);
        tiles_per_gauss[g] = (int32_t)(b.w * b.h);
    });
    int64_t M = 0;
    for (int64_t g = 0; g < G; ++g) M += tiles_per_gauss[g];
    return M;
}

// Fills isect_ids [M] and flatten_ids [M] (M from splat_isect_count with the same inputs).
int splat_isect_fill(int64_t C, int64_t N, int tile_size, int tile_w, int tile_h, const float* means2d,
                     const int32_t* radii, const float* depths, const int32_t* tiles_per_gauss, int64_t M,
                     int64_t* isect_ids, int32_t* flatten_ids, int n_threads) {
    const int64_t n_tiles = (int64_t)tile_w * tile_h, G = C * N;
    const int tile_bits = bit_length(n_tiles);
    // Counting sort by (camera, tile): count, exclusive scan, scatter in emission order.
    std::vector<int64_t> start(C * n_tiles + 1, 0);
    for (int64_t g = 0; g < G; ++g) {
        if (tiles_per_gauss[g] == 0) continue;
        Bounds b = tile_bounds(means2d, radii, g, tile_size, tile_w, tile_h);
        int64_t cam = g / N;
        for (int64_t y = b.y0; y < b.y0 + b.h; ++y)
            for (int64_t x = b.x0; x < b.x0 + b.w; ++x) ++start[cam * n_tiles + y * tile_w + x + 1];
    }
    for (int64_t t = 0; t < C * n_tiles; ++t) start[t + 1] += start[t];
    std::vector<int64_t> cursor(start.begin(), start.end() - 1);
    std::vector<uint32_t> depth_key(M);
    for (int64_t g = 0; g < G; ++g) {
        if (tiles_per_gauss[g] == 0) continue;
        Bounds b = tile_bounds(means2d, radii, g, tile_size, tile_w, tile_h);
        int64_t cam = g / N;
        uint32_t key;
        std::memcpy(&key, depths + g, sizeof(key));  // the float's bits, as the reference's isect_ids
        for (int64_t y = b.y0; y < b.y0 + b.h; ++y) {
            for (int64_t x = b.x0; x < b.x0 + b.w; ++x) {
                int64_t pos = cursor[cam * n_tiles + y * tile_w + x]++;
                flatten_ids[pos] = (int32_t)g;
                depth_key[pos] = key;
            }
        }
    }
    // Stable sort by depth key inside each tile, then the 64-bit ids.
    splat::parallel_for(C * n_tiles, n_threads, [&](int64_t t) {
        int64_t s = start[t], e = start[t + 1];
        if (e - s > 1) {
            std::vector<std::pair<uint32_t, int32_t>> items(e - s);
            for (int64_t i = s; i < e; ++i) items[i - s] = {depth_key[i], flatten_ids[i]};
            std::stable_sort(items.begin(), items.end(),
                             [](const auto& a, const auto& b) { return a.first < b.first; });
            for (int64_t i = s; i < e; ++i) depth_key[i] = items[i - s].first, flatten_ids[i] = items[i - s].second;
        }
        int64_t cam = t / n_tiles, tile = t % n_tiles;
        for (int64_t i = s; i < e; ++i)
            isect_ids[i] = (cam << (32 + tile_bits)) | (tile << 32) | (int64_t)depth_key[i];
    }, 1);
    return 0;
}

}  // extern "C"
