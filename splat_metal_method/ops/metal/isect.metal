// isect.metal: gaussian/tile intersections (gsplat 1.4 isect_tiles + isect_offset_encode).
//
// Pipeline (driven by isect.py; the sorts are sort.metal's stable radix sort):
//   1. stable sort of all C*N gaussians by the 32 bits of their depth (unsigned), giving `order`.
//   2. isect_count        tiles_per_gauss[c*N+n] = number of tiles the 3-sigma square covers, also
//                         written in depth order (counts[p] = tiles_per_gauss[order[p]]).
//   3. inclusive prefix sum of counts (scan.metal). The total M is read by the host (exact lists), or
//      stays on the device (padded lists: buffers of a capacity the host keeps from earlier steps).
//   4. isect_emit         in depth order, every gaussian writes (camera, tile) keys and its flat id,
//                         those that fit the capacity (overflow drops the deepest intersections).
//   4b. isect_pad         padded lists only: entries [min(M, capacity), capacity) get a sentinel key
//                         that sorts after every real one.
//   5. stable sort of the entries by the (camera, tile) key.
//   6. isect_finalize     isect_id = (camera, tile) key << 32 | depth bits.
// Sorting by depth first and then stably by (camera, tile) is a stable sort by the whole 64-bit
// isect_id over the emission order (camera-major, gaussian-major, tile y-major, x-minor), because
// each gaussian covers a tile at most once: every backend therefore gets the same per-tile order.
// Compiled after common.h: kernels.py prepends it (compile_shader has no include path).

// Tile rectangle [x0, x1) x [y0, y1) of a gaussian, computed exactly as ops/reference.py does
// (float32 division by the tile size, floor/ceil, clamp to the tile grid). A float-to-int conversion
// of NaN, inf or an out-of-range value is undefined in MSL and C++ (x86 gives INT_MIN, a GPU may
// saturate to INT_MAX), so every bound is checked finite first (else the rectangle is empty, as the
// reference's comparisons make it) and clamped into [0, tile count] before it is converted.
inline void tile_rect(float mx, float my, int radius, long tile_size, long tile_width, long tile_height,
                      thread int& x0, thread int& y0, thread int& x1, thread int& y1) {
  const float ts = (float)tile_size;
  const float tx = mx / ts, ty = my / ts, tr = (float)radius / ts;
  const float tw = (float)tile_width, th = (float)tile_height;
  const float fx0 = floor(tx - tr), fy0 = floor(ty - tr), fx1 = ceil(tx + tr), fy1 = ceil(ty + tr);
  x0 = y0 = x1 = y1 = 0;
  if (!(isfinite(fx0) && isfinite(fy0) && isfinite(fx1) && isfinite(fy1))) {
    return;
  }
  x0 = (int)clamp(fx0, 0.0f, tw);
  y0 = (int)clamp(fy0, 0.0f, th);
  x1 = (int)clamp(fx1, 0.0f, tw);
  y1 = (int)clamp(fy1, 0.0f, th);
}

// isect_count: one thread per position p in depth order, p < C*N; thread p counts gaussian
// g = order[p] and writes tiles_per_gauss[g] and counts[p] (order is a permutation: every entry of
// both is written once). Independent threads, no barriers.
// Invariant: the count is 0 iff radius <= 0 or the rectangle is empty; <= tile_width*tile_height.
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void isect_count(
    const device float* means2d [[buffer(0)]],   // [C*N, 2]
    const device int* radii [[buffer(1)]],       // [C*N]
    const device uint* order [[buffer(2)]],      // [C*N] flat ids in depth order
    device int* tiles_per_gauss [[buffer(3)]],   // [C*N]
    device int* counts [[buffer(4)]],            // [C*N] tiles_per_gauss in depth order
    constant long& total [[buffer(5)]],          // C*N
    constant long& tile_size [[buffer(6)]],
    constant long& tile_width [[buffer(7)]],
    constant long& tile_height [[buffer(8)]],
    uint p [[thread_position_in_grid]]) {
  if ((long)p >= total) {
    return;
  }
  const uint g = order[p];
  const int r = radii[g];
  int count = 0;
  if (r > 0) {
    int x0, y0, x1, y1;
    tile_rect(means2d[2 * g], means2d[2 * g + 1], r, tile_size, tile_width, tile_height, x0, y0, x1, y1);
    count = (x1 - x0) * (y1 - y0);
  }
  tiles_per_gauss[g] = count;
  counts[p] = count;
}

// isect_emit: one thread per position p in depth order, p < C*N. Thread p writes the entries
// [cum[p] - count, cum[p]) where count = tiles_per_gauss[order[p]]: disjoint ranges, no races, no
// barriers. Keys are (camera << tile_bits | tile_id) as uint32 (the host checks they fit), values the
// flat gaussian index camera*N + n. Work per thread is bounded by tile_width*tile_height.
// The rectangle is recomputed here, but the range was sized by isect_count's `count`: the thread
// writes exactly `count` entries whatever the recomputation says, never past its range into a
// neighbour's (fast math or a later edit could make the two disagree). Should the recomputed
// rectangle hold fewer tiles, the rest of the range gets tile 0 of the gaussian's camera: a wrong but
// in-bounds entry, instead of unwritten memory that later kernels would index with.
// Nothing is written at or past `capacity` (= M for exact lists): when the lists overflow, the
// entries of the deepest gaussians (the end of the depth order) are the ones dropped.
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void isect_emit(
    const device float* means2d [[buffer(0)]],        // [C*N, 2]
    const device int* radii [[buffer(1)]],            // [C*N]
    const device int* tiles_per_gauss [[buffer(2)]],  // [C*N]
    const device uint* order [[buffer(3)]],           // [C*N] flat ids in depth order
    const device long* cum [[buffer(4)]],             // [C*N] inclusive cumsum of counts in depth order
    device uint* tile_keys [[buffer(5)]],             // [M]
    device uint* flat_ids [[buffer(6)]],              // [M]
    constant long& total [[buffer(7)]],               // C*N
    constant long& N [[buffer(8)]],
    constant long& tile_size [[buffer(9)]],
    constant long& tile_width [[buffer(10)]],
    constant long& tile_height [[buffer(11)]],
    constant long& tile_bits [[buffer(12)]],
    constant long& capacity [[buffer(13)]],           // entries the buffers hold
    uint p [[thread_position_in_grid]]) {
  if ((long)p >= total) {
    return;
  }
  const uint g = order[p];
  const int count = tiles_per_gauss[g];
  if (count <= 0) {
    return;
  }
  int x0, y0, x1, y1;
  tile_rect(means2d[2 * g], means2d[2 * g + 1], radii[g], tile_size, tile_width, tile_height, x0, y0, x1, y1);
  const uint cam_key = (uint)((long)g / N) << (uint)tile_bits;
  const long end = cum[p] < capacity ? cum[p] : capacity;
  long out = cum[p] - count;
  for (int y = y0; y < y1 && out < end; ++y) {
    for (int x = x0; x < x1 && out < end; ++x) {
      tile_keys[out] = cam_key | (uint)(y * tile_width + x);
      flat_ids[out] = g;
      ++out;
    }
  }
  for (; out < end; ++out) {
    tile_keys[out] = cam_key;
    flat_ids[out] = g;
  }
}

// isect_finalize: one thread per intersection i < M. isect_ids[i] = key << 32 | bits(depth), the
// depth bits zero-extended (as the reference's `& 0xFFFFFFFF`). Independent threads.
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void isect_finalize(
    const device uint* tile_keys [[buffer(0)]],   // [M] sorted
    const device uint* flat_ids [[buffer(1)]],    // [M] sorted alongside
    const device float* depths [[buffer(2)]],     // [C*N]
    device long* isect_ids [[buffer(3)]],         // [M]
    device int* flatten_ids [[buffer(4)]],        // [M]
    constant long& M [[buffer(5)]],
    uint i [[thread_position_in_grid]]) {
  if ((long)i >= M) {
    return;
  }
  const uint g = flat_ids[i];
  const ulong key = ((ulong)tile_keys[i] << 32) | (ulong)as_type<uint>(depths[g]);
  isect_ids[i] = (long)key;
  flatten_ids[i] = (int)g;
}

// isect_pad: one thread per entry i < capacity of padded lists. Entries past the real ones
// (i >= min(M, capacity), M = cum[total - 1] on the device) get `sentinel`, a key above every real
// (camera, tile) key, so the sort puts them last and isect_offsets sees them past the last tile.
// Independent threads.
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void isect_pad(
    const device long* cum [[buffer(0)]],     // [total] inclusive cumsum of counts
    device uint* tile_keys [[buffer(1)]],     // [capacity]
    device uint* flat_ids [[buffer(2)]],      // [capacity]
    constant long& total [[buffer(3)]],       // C*N >= 1
    constant long& capacity [[buffer(4)]],
    constant long& sentinel [[buffer(5)]],    // (1 << key bits) - 1
    uint i [[thread_position_in_grid]]) {
  if ((long)i >= capacity) {
    return;
  }
  const long n = cum[total - 1] < capacity ? cum[total - 1] : capacity;
  if ((long)i >= n) {
    tile_keys[i] = (uint)sentinel;
    flat_ids[i] = 0u;
  }
}

// isect_offsets: one thread per intersection i < M of the sorted list (M >= 1; the host fills the
// M == 0 case). With end_slot (padded lists), offsets has one more entry, offsets[total_tiles], the end
// of the last tile: the real entries' count, which only the device knows. Sentinel entries map past
// every tile (their dense index is >= total_tiles), so the first of them writes the remaining tiles
// and the end slot; without sentinels (the lists are full) the last thread writes them. Writes offsets[t] = i for every dense tile index t in (dense(i-1), dense(i)], where
// dense = camera * n_tiles + tile; the last thread also writes M for every t > dense(M-1). Each t is
// written by exactly one thread because dense() is non-decreasing: no races, no barriers. A thread's
// loop length is the number of empty tiles before its tile (bounded by C * n_tiles in total).
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void isect_offsets(
    const device long* isect_ids [[buffer(0)]],  // [M] sorted
    device int* offsets [[buffer(1)]],           // [C * n_tiles]
    constant long& M [[buffer(2)]],
    constant long& n_tiles [[buffer(3)]],
    constant long& total_tiles [[buffer(4)]],    // C * n_tiles
    constant long& tile_bits [[buffer(5)]],
    constant long& end_slot [[buffer(6)]],       // 1: offsets has total_tiles + 1 entries
    uint i [[thread_position_in_grid]]) {
  if ((long)i >= M) {
    return;
  }
  const long mask = ((long)1 << tile_bits) - 1;
  const long key = isect_ids[i] >> 32;
  const long cur = (key >> tile_bits) * n_tiles + (key & mask);
  long prev = -1;
  if (i > 0) {
    const long pkey = isect_ids[i - 1] >> 32;
    prev = (pkey >> tile_bits) * n_tiles + (pkey & mask);
  }
  const long last = total_tiles - 1 + end_slot;  // the last entry of offsets
  for (long t = prev + 1; t <= cur && t <= last; ++t) {
    offsets[t] = (int)i;
  }
  if ((long)i == M - 1) {
    for (long t = cur + 1; t <= last; ++t) {
      offsets[t] = (int)M;
    }
  }
}
