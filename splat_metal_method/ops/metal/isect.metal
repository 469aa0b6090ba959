// isect.metal: gaussian/tile intersections (gsplat 1.4 isect_tiles + isect_offset_encode).
//
// Exact lists (driven by isect.py isect_tiles_fwd; the sorts are sort.metal's stable radix sort):
//   1. stable sort of all C*N gaussians by the 32 bits of their depth (unsigned), giving `order`.
//   2. isect_count        tiles_per_gauss[c*N+n] = number of tiles the 3-sigma square covers, also
//                         written in depth order (counts[p] = tiles_per_gauss[order[p]]).
//   3. inclusive prefix sum of counts (scan.metal); the host reads the total M.
//   4. isect_emit         in depth order, every gaussian writes (camera, tile) keys and its flat id.
//   5. stable sort of the entries by the (camera, tile) key.
//   6. isect_finalize     isect_id = (camera, tile) key << 32 | depth bits.
// Sorting by depth first and then stably by (camera, tile) is a stable sort by the whole 64-bit
// isect_id over the emission order (camera-major, gaussian-major, tile y-major, x-minor), because
// each gaussian covers a tile at most once: every backend therefore gets the same per-tile order.
//
// Padded lists (isect.py isect_tiles_padded_fwd: training steps, no host read; buffers of a capacity
// the host keeps from earlier steps) sort nothing globally: no depth sort (step 1), no sort by tile
// (step 5); per-tile bins, each sorted by (depth bits, flat id) in threadgroup memory, instead:
//   1. isect_count        in FLAT order (ordered = 0: position p is gaussian p), also zeroes the bin
//                         counters.
//   2. inclusive prefix sum of tiles_per_gauss in flat order; M stays on the device.
//   3. bin_count          every entry of the flat-order emission (camera-major, gaussian-major, tile
//                         y-major, x-minor) within the capacity (its first min(M, capacity)) adds one
//                         to its tile's counter and stores its rank in its tile at its emission position
//                         (slots[out]; the host binds bin_sort's merge buffer ranks2 there, unused until
//                         bin_sort). A threadgroup counts the entries of a run of gaussians per tile in
//                         threadgroup memory (threadgroup atomics), then reserves each tile's ranks with
//                         one device atomic per (group, tile) it touched (tiles past its window: one
//                         device atomic per entry).
//   4. inclusive prefix sum of the counters: ends[t], the end of tile t's bin in the list.
//   5. bin_fill           the same entries store their gaussian's flat id g (unique per tile) at the
//                         start of their tile's bin (ends[t - 1], 0 for t = 0) plus their rank: no
//                         atomics. The counters keep the bins' lengths (isect_count zeroes them).
//   6. bin_sort           one threadgroup per tile sorts its bin by the 64-bit key
//                         (depth bits << 32 | g), the depth gathered here (a bitonic sort in threadgroup
//                         memory; longer bins in blocks, then merged in device memory: exact at any
//                         length) and writes flatten_ids, the tile offsets and, when asked (with_ids:
//                         training renders do not ask, nothing in a step reads them), isect_ids.
// That key orders a tile exactly as the exact lists do (the depth bits compared unsigned, as the depth
// sort and the reference's zero-extended bits compare them, then the flat id: emission order), whatever
// order the atomics handed out the ranks, and whatever the depths' signs: the lists are the exact lists
// entry for entry. On an overflow of the capacity the entries left out are the end of the flat-order
// emission: those of the highest flat ids (the last camera's last gaussians), not the deepest.
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
// both is written once). Independent threads, no barriers. With ordered = 0 (padded lists) p is the
// flat id (g = p), order is not read and counts not written: tiles_per_gauss is the flat-order count.
// Invariant: the count is 0 iff radius <= 0 or the rectangle is empty; <= tile_width*tile_height.
// Padded lists: thread p also zeroes bins[p], bins[p + total], ... below n_bins (the counters of
// bin_count / bin_sort, which run after this kernel); exact lists pass n_bins = 0.
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
    device int* bins [[buffer(9)]],              // [n_bins] (unread with n_bins = 0)
    constant long& n_bins [[buffer(10)]],
    constant long& ordered [[buffer(11)]],       // 1: p is a position in `order`; 0: p is the flat id
    uint p [[thread_position_in_grid]]) {
  if ((long)p >= total) {
    return;
  }
  for (long b = (long)p; b < n_bins; b += total) {
    bins[b] = 0;
  }
  const uint g = ordered != 0 ? order[p] : p;
  const int r = radii[g];
  int count = 0;
  if (r > 0) {
    int x0, y0, x1, y1;
    tile_rect(means2d[2 * g], means2d[2 * g + 1], r, tile_size, tile_width, tile_height, x0, y0, x1, y1);
    count = (x1 - x0) * (y1 - y0);
  }
  tiles_per_gauss[g] = count;
  if (ordered != 0) {
    counts[p] = count;
  }
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
// Nothing is written at or past `capacity` (the exact lists pass M: a guard, never a cut).
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

// ---- per-tile bins (padded lists) -------------------------------------------------------------------

// The entries of gaussian g (flat id) in the flat-order emission within `capacity`: [first, end) of
// the emission, and the rectangle they walk (y-major, x-minor; past the rectangle, tile 0 of the
// camera, as isect_emit pads). Returns false when there are none.
inline bool bin_entries(const device float* means2d, const device int* radii, const device int* tiles_per_gauss,
                        const device long* cum, uint g, long capacity, long tile_size, long tile_width,
                        long tile_height, thread long& first, thread long& end, thread int& x0, thread int& y0,
                        thread int& x1, thread int& y1) {
  const int count = tiles_per_gauss[g];
  first = cum[g] - count;
  end = cum[g] < capacity ? cum[g] : capacity;
  if (count <= 0 || first >= end) {
    return false;
  }
  const int radius = radii[g];
  tile_rect(means2d[2 * g], means2d[2 * g + 1], radius, tile_size, tile_width, tile_height, x0, y0, x1, y1);
  return true;
}

// bin_count: one threadgroup per run of G = threads x per_thread consecutive gaussians (flat ids
// [G * group, G * (group + 1)); thread tid takes g = G * group + j * threads + tid, j < per_thread).
// Every entry of the flat-order emission within the capacity adds one to its (camera, tile) counter
// bins[camera * n_tiles + tile] (zeroed by isect_count) and ends with its rank among its tile's entries
// in slots[out] (out: its emission position, < capacity). Threadgroup tile histograms: the counters of
// the window of SPLAT_BIN_WINDOW dense tiles from the group's first camera's tile 0 ([w0, w0 + window),
// spanning later cameras where the tiles are few) live in threadgroup memory for the group:
//   pass 1  each entry of a tile in the window adds one to the tile's threadgroup counter (a threadgroup
//           atomic) and stores the old value, its rank among the group's entries of the tile; an entry
//           of a tile past the window (a large image, a later camera) adds one to the device counter (a
//           device atomic, as every entry did before) and stores its final rank.
//   reserve each tile of the window with a nonzero count reserves that many ranks of its device counter:
//           ONE device atomic per (group, tile) the group touches; the counter's old value, the start of
//           the group's ranks in the tile, replaces the count in threadgroup memory.
//   pass 2  the same entries again (the rectangle math is cheap): each in-window entry adds its tile's
//           start to its rank.
// Ranks of a tile are therefore 0..count_t - 1, each once, in an order that depends on the scheduling
// (bin_sort orders each bin by (depth bits, flat id): the lists do not depend on it). The entries past
// the rectangle (isect_emit's tile 0 padding; none while the rectangle holds `count` tiles) take
// consecutive ranks of tile `base` with one atomic add of their number (threadgroup or device, as the
// tile's). The counters keep the bins' lengths (bin_fill reads none of them; the next isect_count
// zeroes them). Threadgroup memory: SPLAT_BIN_ROUND ints, the window's counters a round at a time: the three
// steps run once per SPLAT_BIN_ROUND tiles of the window, each round counting only its tiles' entries in
// threadgroup memory (the entries past the window take their device atomics in the first), so the atomics and the
// ranks are those of one round over the whole window. Every thread reaches every barrier (no early return: the
// gaussians past C*N are skipped; the rounds are the same for the whole group).
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void bin_count(
    const device float* means2d [[buffer(0)]],        // [C*N, 2]
    const device int* radii [[buffer(1)]],            // [C*N]
    const device int* tiles_per_gauss [[buffer(2)]],  // [C*N]
    const device long* cum [[buffer(3)]],             // [C*N] inclusive cumsum of tiles_per_gauss (flat order)
    device atomic_int* bins [[buffer(4)]],            // [C * n_tiles + 2] counters
    device int* slots [[buffer(5)]],                  // [capacity] each entry's rank in its tile's bin
    constant long& total [[buffer(6)]],               // C*N
    constant long& N [[buffer(7)]],
    constant long& tile_size [[buffer(8)]],
    constant long& tile_width [[buffer(9)]],
    constant long& tile_height [[buffer(10)]],
    constant long& capacity [[buffer(11)]],
    constant long& per_thread [[buffer(12)]],         // gaussians per thread (the group's run: threads x this)
    uint tid [[thread_index_in_threadgroup]],
    uint3 tgp [[threadgroup_position_in_grid]],
    uint3 tpg [[threads_per_threadgroup]]) {
  // ints seen as atomics (the emulator's address-space check builds no threadgroup array of atomic objects)
  threadgroup int hist_ints[SPLAT_BIN_ROUND];
  threadgroup atomic_int* hist = (threadgroup atomic_int*)hist_ints;
  const long threads = (long)tpg.x;
  const long g0 = (long)tgp.x * threads * per_thread;  // the group's first gaussian
  const long n_tiles = tile_width * tile_height;
  const long w0 = (g0 < total ? g0 / N : 0) * n_tiles;  // the window: dense tiles [w0, w0 + SPLAT_BIN_WINDOW)
  const long w1 = w0 + SPLAT_BIN_WINDOW;
  for (long r0 = w0; r0 < w1; r0 += SPLAT_BIN_ROUND) {  // one round per SPLAT_BIN_ROUND tiles of the window
    const long r1 = r0 + SPLAT_BIN_ROUND < w1 ? r0 + SPLAT_BIN_ROUND : w1;
    const bool first_round = r0 == w0;  // the entries past the window take their device atomics in it
    if (!first_round) {
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous round's pass 2 has read its counters
    }
    for (long i = tid; i < r1 - r0; i += threads) {
      atomic_store_explicit(&hist[i], 0, memory_order_relaxed);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int pass = 0; pass < 2; ++pass) {
      for (long j = 0; j < per_thread; ++j) {
        const long gl = g0 + j * threads + (long)tid;
        if (gl >= total) {
          break;
        }
        const uint g = (uint)gl;
        long out, end;
        int x0, y0, x1, y1;
        if (!bin_entries(means2d, radii, tiles_per_gauss, cum, g, capacity, tile_size, tile_width, tile_height,
                         out, end, x0, y0, x1, y1)) {
          continue;
        }
        const long base = (gl / N) * n_tiles;
        for (int y = y0; y < y1 && end > out; ++y) {
          for (int x = x0; x < x1 && end > out; ++x, ++out) {
            const long t = base + (long)y * tile_width + x;
            if (t >= r0 && t < r1) {
              if (pass == 0) {
                slots[out] = atomic_fetch_add_explicit(&hist[t - r0], 1, memory_order_relaxed);
              } else {
                slots[out] += atomic_load_explicit(&hist[t - r0], memory_order_relaxed);
              }
            } else if (t >= w1 && pass == 0 && first_round) {
              slots[out] = atomic_fetch_add_explicit(&bins[t], 1, memory_order_relaxed);
            }
          }
        }
        if (out < end) {
          const int n = (int)(end - out);
          if (base >= r0 && base < r1) {
            const int first = pass == 0 ? atomic_fetch_add_explicit(&hist[base - r0], n, memory_order_relaxed)
                                        : atomic_load_explicit(&hist[base - r0], memory_order_relaxed);
            for (int i = 0; out < end; ++i, ++out) {
              slots[out] = pass == 0 ? first + i : slots[out] + first;
            }
          } else if (base >= w1 && pass == 0 && first_round) {
            const int first = atomic_fetch_add_explicit(&bins[base], n, memory_order_relaxed);
            for (int i = 0; out < end; ++i, ++out) {
              slots[out] = first + i;
            }
          }
        }
      }
      if (pass == 0) {  // reserve: one device atomic per tile of the round the group touched
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (long i = tid; i < r1 - r0; i += threads) {
          const int c = atomic_load_explicit(&hist[i], memory_order_relaxed);
          if (c > 0) {
            atomic_store_explicit(&hist[i], atomic_fetch_add_explicit(&bins[r0 + i], c, memory_order_relaxed),
                                  memory_order_relaxed);
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
    }
  }
}

// bin_fill: one thread per gaussian g < C*N (flat id), the entries of bin_count, in the same order. Each
// stores g at its slot: the start of its tile's bin [ends[t - 1], ends[t]) (0 for t = 0) plus the rank
// bin_count gave it (slots[out]; the ranks of a tile are 0..count_t - 1, each once). No atomics, no
// counters read. Ranks are handed out in any order: bin_sort orders each bin by (depth bits, g).
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void bin_fill(
    const device float* means2d [[buffer(0)]],        // [C*N, 2]
    const device int* radii [[buffer(1)]],            // [C*N]
    const device int* tiles_per_gauss [[buffer(2)]],  // [C*N]
    const device long* cum [[buffer(3)]],             // [C*N] inclusive cumsum of tiles_per_gauss (flat order)
    const device int* slots [[buffer(4)]],            // [capacity] bin_count's ranks, by emission position
    const device long* ends [[buffer(5)]],            // [C * n_tiles + 2] inclusive cumsum of the counters
    device uint* ranks [[buffer(6)]],                 // [capacity] flat ids, per-tile bins
    constant long& total [[buffer(7)]],
    constant long& N [[buffer(8)]],
    constant long& tile_size [[buffer(9)]],
    constant long& tile_width [[buffer(10)]],
    constant long& tile_height [[buffer(11)]],
    constant long& capacity [[buffer(12)]],
    uint g [[thread_position_in_grid]]) {
  if ((long)g >= total) {
    return;
  }
  long out, end;
  int x0, y0, x1, y1;
  if (!bin_entries(means2d, radii, tiles_per_gauss, cum, g, capacity, tile_size, tile_width, tile_height,
                   out, end, x0, y0, x1, y1)) {
    return;
  }
  const long base = ((long)g / N) * tile_width * tile_height;
  for (int y = y0; y < y1 && end > out; ++y) {
    for (int x = x0; x < x1 && end > out; ++x, ++out) {
      const long t = base + (long)y * tile_width + x;
      ranks[(t > 0 ? ends[t - 1] : 0) + slots[out]] = g;
    }
  }
  const long start = base > 0 ? ends[base - 1] : 0;
  for (; out < end; ++out) {
    ranks[start + slots[out]] = g;
  }
}

// Ascending bitonic sort of keys[0, n) in threadgroup memory, n a power of two <= SPLAT_BIN_CAPACITY.
// Every thread of the group calls it with the same n (the barriers are reached uniformly).
inline void bitonic_sort(threadgroup ulong* keys, uint n, uint tid) {
  for (uint k = 2; k <= n; k <<= 1) {
    for (uint j = k >> 1; j > 0; j >>= 1) {
      for (uint q = tid; q < n / 2; q += SPLAT_BIN_THREADS) {
        const uint i = (q / j) * 2 * j + (q % j);
        const uint l = i + j;
        const ulong a = keys[i], b = keys[l];
        if (((i & k) == 0) == (a > b)) {
          keys[i] = b;
          keys[l] = a;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
}

// The sort key of an entry of a bin: its gaussian's depth bits (unsigned) << 32 | its flat id g. Unique
// within a tile (a gaussian covers a tile once); ascending keys are the exact lists' order.
inline ulong bin_key(uint g, const device float* depths) {
  return ((ulong)as_type<uint>(depths[g]) << 32) | (ulong)g;
}

// Entries of src[lo, hi) (flat ids, sorted by bin_key) whose key is below x (binary search).
inline long count_below(const device uint* src, long lo, long hi, ulong x, const device float* depths) {
  while (lo < hi) {
    const long mid = (lo + hi) / 2;
    if (bin_key(src[mid], depths) < x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Entry i of the sorted list: the entry of bin_key `k` in tile t (camera t / n_tiles); its isect_id only
// `with_ids` (else isect_ids is a placeholder, not written).
inline void bin_write(long i, ulong k, long t, device long* isect_ids, device int* flatten_ids, long n_tiles,
                      long tile_bits, long with_ids) {
  if (with_ids != 0) {
    const ulong key = ((ulong)(t / n_tiles) << (uint)tile_bits) | (ulong)(t % n_tiles);
    isect_ids[i] = (long)((key << 32) | (k >> 32));
  }
  flatten_ids[i] = (int)(uint)k;
}

// Merge steps a tile of `len` entries needs after its blocks of SPLAT_BIN_CAPACITY are sorted.
inline int bin_merges(long len) {
  int m = 0;
  for (long w = SPLAT_BIN_CAPACITY; w < len; w <<= 1) {
    ++m;
  }
  return m;
}

// bin_sort: one threadgroup of SPLAT_BIN_THREADS threads per tile t < C * n_tiles (grid: groups in x).
// A tile's bin, ranks[start, end) with end = ends[t], start = ends[t - 1] (0 for t = 0), flat ids, is
// sorted by bin_key (depth bits << 32 | flat id; the depths gathered here) in steps; this dispatch runs
// the tile's steps [step_lo, step_hi):
//   step 0       a bin of len <= SPLAT_BIN_CAPACITY: bitonic sort of the keys in threadgroup memory
//                (padded with all ones to a power of two), written as the final entries; done. A longer
//                bin: each block of SPLAT_BIN_CAPACITY sorted likewise and its flat ids written back.
//   step s >= 1  merge of runs of width SPLAT_BIN_CAPACITY << (s - 1), pairwise, from ranks to ranks2
//                (s odd) or back (s even); the tile's last merge writes the final entries. Keys are
//                unique within a tile, so an entry's place in the merged run is its place in its own
//                run plus the count of the partner run below it (no ties).
// The host plans step_lo/step_hi from the longest tile seen a step late (one dispatch per merge
// step, bounded work each); the last dispatch has step_hi = 1 << 30 and finishes every tile
// whatever its length, so the result is exact even when the estimate was short.
// Step 0 also writes offsets[t] = start (offsets[C * n_tiles] = the list's end, from the last tile),
// the longest bin (atomic max into bins[n + 1]) and the intersection count M (bins[n], from cum),
// and gives the padding entries [end of the list, capacity) flat id 0 and (with_ids) a key past every tile.
// with_ids = 0 (training renders): isect_ids is a small placeholder buffer, never written.
// Threadgroup memory: SPLAT_BIN_CAPACITY ulongs (16 KiB). Every thread runs the same steps (len, and
// so the step count, is uniform in the group); a device-memory barrier ends each step.
[[max_total_threads_per_threadgroup(SPLAT_BIN_THREADS)]]
kernel void bin_sort(
    device uint* ranks [[buffer(0)]],              // [capacity] bins of flat ids
    device uint* ranks2 [[buffer(1)]],             // [capacity] merge ping-pong
    const device long* ends [[buffer(2)]],         // [n + 2] inclusive cumsum of the bin counts
    const device float* depths [[buffer(3)]],      // [C*N]
    const device long* cum [[buffer(4)]],          // [C*N] inclusive cumsum of tiles_per_gauss (flat order)
    device atomic_int* bins [[buffer(5)]],         // [n + 2]: bins[n] = M, bins[n + 1] = the longest bin
    device long* isect_ids [[buffer(6)]],          // [capacity]; with_ids = 0: a placeholder, not written
    device int* flatten_ids [[buffer(7)]],         // [capacity]
    device int* offsets [[buffer(8)]],             // [n + 1]
    constant long& n [[buffer(9)]],                // C * n_tiles
    constant long& n_tiles [[buffer(10)]],
    constant long& tile_bits [[buffer(11)]],
    constant long& total [[buffer(12)]],           // C*N
    constant long& capacity [[buffer(13)]],
    constant long& sentinel [[buffer(14)]],        // the padding's key: (1 << key bits) - 1
    constant long& step_lo [[buffer(15)]],
    constant long& step_hi [[buffer(16)]],
    constant long& with_ids [[buffer(17)]],        // 1: write isect_ids; 0: flatten_ids and offsets only
    uint tid [[thread_index_in_threadgroup]],
    uint3 tgp [[threadgroup_position_in_grid]]) {
  threadgroup ulong keys[SPLAT_BIN_CAPACITY];
  const long t = (long)tgp.x;
  const long start = t > 0 ? ends[t - 1] : 0;
  const long len = ends[t] - start;
  const long merges = len > SPLAT_BIN_CAPACITY ? (long)bin_merges(len) : 0;
  const long last = step_hi < merges + 1 ? step_hi : merges + 1;
  for (long s = step_lo; s < last; ++s) {
    if (s == 0) {
      if (tid == 0) {
        offsets[t] = (int)start;
        if (t == n - 1) {
          offsets[n] = (int)ends[t];
        }
        atomic_fetch_max_explicit(&bins[n + 1], (int)len, memory_order_relaxed);
        if (t == 0) {
          const long m = cum[total - 1];
          atomic_store_explicit(&bins[n], (int)(m < 2147483647 ? m : 2147483647), memory_order_relaxed);
        }
      }
      for (long i = ends[n - 1] + t * SPLAT_BIN_THREADS + tid; i < capacity; i += n * SPLAT_BIN_THREADS) {
        if (with_ids != 0) {
          isect_ids[i] = (long)((ulong)sentinel << 32);
        }
        flatten_ids[i] = 0;
      }
      for (long b0 = 0; b0 < len; b0 += SPLAT_BIN_CAPACITY) {
        const long bl = len - b0 < SPLAT_BIN_CAPACITY ? len - b0 : SPLAT_BIN_CAPACITY;
        uint width = 1;
        while ((long)width < bl) {
          width <<= 1;
        }
        for (uint i = tid; i < width; i += SPLAT_BIN_THREADS) {
          keys[i] = (long)i < bl ? bin_key(ranks[start + b0 + i], depths) : 0xFFFFFFFFFFFFFFFFul;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        bitonic_sort(keys, width, tid);
        for (uint i = tid; (long)i < bl; i += SPLAT_BIN_THREADS) {
          if (merges == 0) {
            bin_write(start + i, keys[i], t, isect_ids, flatten_ids, n_tiles, tile_bits, with_ids);
          } else {
            ranks[start + b0 + i] = (uint)keys[i];
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
    } else {
      const long w = (long)SPLAT_BIN_CAPACITY << (s - 1);
      const device uint* src = (s % 2) == 1 ? ranks : ranks2;
      device uint* dst = (s % 2) == 1 ? ranks2 : ranks;
      for (long i = tid; i < len; i += SPLAT_BIN_THREADS) {
        const ulong x = bin_key(src[start + i], depths);
        const long run = i / w;
        const long a0 = (run & ~(long)1) * w;  // the pair's first run [a0, a0 + w), second [a0 + w, a0 + 2w)
        const long b0 = a0 + w < len ? a0 + w : len;
        const long b1 = a0 + 2 * w < len ? a0 + 2 * w : len;
        long pos;
        if ((run & 1) == 0) {
          pos = (i - a0) + (count_below(src, start + b0, start + b1, x, depths) - (start + b0));
        } else {
          pos = (i - b0) + (count_below(src, start + a0, start + b0, x, depths) - (start + a0));
        }
        if (s == merges) {
          bin_write(start + a0 + pos, x, t, isect_ids, flatten_ids, n_tiles, tile_bits, with_ids);
        } else {
          dst[start + a0 + pos] = (uint)x;
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_device);
  }
}
