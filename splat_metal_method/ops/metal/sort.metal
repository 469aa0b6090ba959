// sort.metal: stable LSD radix sort of (uint32 key, uint32 value) pairs, SPLAT_RADIX_BITS per pass.
//
// Why our own sort: MPS sort/argsort has had int64 and large-size bugs, and MPSGraph documents no
// stability; the tile lists must be stably sorted for every backend to agree on per-tile order.
//
// One pass over bits [shift, shift + RADIX_BITS) (driven by sort.py):
//   radix_hist     block b counts the digits of its RADIX_BLOCK keys -> block_hist[digit, b] (int64)
//   scan.metal     exclusive prefix sum over block_hist flattened digit-major, in place (all digits
//                  of the pass in one scan) -> bin_offsets[digit, b]: where block b's first key with
//                  that digit goes in the output
//   radix_scatter  block b writes every key to bin_offsets[digit, b] + its rank among the block's
//                  keys with the same digit that come before it (stable by construction).
// Every thread owns a CONTIGUOUS run of RADIX_KEYS_PER_THREAD keys, so a key's rank inside its block
// is (keys with that digit in runs of lower threads) + (keys with that digit earlier in its own run):
// a per-(digit, thread) count table and one scan across threads per digit give it.
// Compiled after common.h: kernels.py prepends it (compile_shader has no include path).

#if (SPLAT_RADIX_THREADS % SPLAT_RADIX_BINS) != 0
#error "SPLAT_RADIX_THREADS must be a multiple of SPLAT_RADIX_BINS"
#endif
// counts[digit * THREADS + thread] is one 4-byte slot per (digit, thread) pair.
#if (SPLAT_RADIX_BINS * SPLAT_RADIX_THREADS * 4 + SPLAT_RADIX_THREADS * 4) > 32768
#error "radix sort tables exceed 32 KB of threadgroup memory"
#endif

// radix_hist: one threadgroup of RADIX_THREADS threads per block of RADIX_BLOCK keys (grid padded to
// whole groups; keys at index >= n are skipped, never read). Threadgroup memory: BINS*THREADS uints.
// Each thread writes only its own column of `counts` before the barrier; after it, threads
// 0..BINS-1 each sum one digit's row. Every thread reaches the single barrier.
[[max_total_threads_per_threadgroup(SPLAT_RADIX_THREADS)]]
kernel void radix_hist(
    const device uint* keys [[buffer(0)]],       // [n]
    device long* block_hist [[buffer(1)]],       // [BINS, n_blocks]
    constant long& n [[buffer(2)]],
    constant long& shift [[buffer(3)]],
    constant long& n_blocks [[buffer(4)]],
    uint tid [[thread_index_in_threadgroup]],
    uint3 tgp [[threadgroup_position_in_grid]]) {
  threadgroup uint counts[SPLAT_RADIX_BINS * SPLAT_RADIX_THREADS];
  const long blk = (long)tgp.x;
  for (int d = 0; d < SPLAT_RADIX_BINS; ++d) {
    counts[d * SPLAT_RADIX_THREADS + tid] = 0;
  }
  const long base = blk * SPLAT_RADIX_BLOCK + (long)tid * SPLAT_RADIX_KEYS_PER_THREAD;
  for (int k = 0; k < SPLAT_RADIX_KEYS_PER_THREAD; ++k) {
    const long j = base + k;
    if (j < n) {
      const uint d = (keys[j] >> (uint)shift) & (SPLAT_RADIX_BINS - 1);
      counts[d * SPLAT_RADIX_THREADS + tid] += 1;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < SPLAT_RADIX_BINS) {
    uint sum = 0;
    for (int t = 0; t < SPLAT_RADIX_THREADS; ++t) {
      sum += counts[tid * SPLAT_RADIX_THREADS + t];
    }
    block_hist[(long)tid * n_blocks + blk] = (long)sum;
  }
}

// radix_scatter: same grid as radix_hist. Threadgroup memory: BINS*THREADS + THREADS uints.
// Steps (every thread reaches all three barriers):
//   1. each thread counts its run's digits into its own column (no sharing yet);
//   2. barrier; thread t scans digit (t % BINS) over the column segment (t / BINS) of BINS columns,
//      in place to exclusive prefixes, and stores the segment total in seg[digit * SEGS + segment];
//   3. barrier; threads 0..BINS-1 turn their digit's SEGS segment totals into exclusive prefixes;
//   4. barrier; each thread walks its run again and writes key/value to
//      bin_offsets[digit, block] + seg prefix + column prefix, bumping its own column slot. With
//      iota != 0 the value of key j is j itself (vals_in is not read): the first pass of an argsort
//      needs no index tensor.
// Output positions are a permutation of [0, n): bin_offsets come from the exclusive scan of all
// blocks' histograms, and inside a block the ranks of one digit are 0..count-1.
[[max_total_threads_per_threadgroup(SPLAT_RADIX_THREADS)]]
kernel void radix_scatter(
    const device uint* keys_in [[buffer(0)]],       // [n]
    const device uint* vals_in [[buffer(1)]],       // [n] (unread with iota != 0)
    device uint* keys_out [[buffer(2)]],            // [n]
    device uint* vals_out [[buffer(3)]],            // [n]
    const device long* bin_offsets [[buffer(4)]],   // [BINS, n_blocks] exclusive scan
    constant long& n [[buffer(5)]],
    constant long& shift [[buffer(6)]],
    constant long& n_blocks [[buffer(7)]],
    constant long& iota [[buffer(8)]],
    uint tid [[thread_index_in_threadgroup]],
    uint3 tgp [[threadgroup_position_in_grid]]) {
  threadgroup uint counts[SPLAT_RADIX_BINS * SPLAT_RADIX_THREADS];
  threadgroup uint seg[SPLAT_RADIX_THREADS];  // [BINS][SEGS], SEGS = THREADS / BINS
  const int SEGS = SPLAT_RADIX_THREADS / SPLAT_RADIX_BINS;
  const long blk = (long)tgp.x;
  const uint sh = (uint)shift;

  // 1. own column
  for (int d = 0; d < SPLAT_RADIX_BINS; ++d) {
    counts[d * SPLAT_RADIX_THREADS + tid] = 0;
  }
  const long base = blk * SPLAT_RADIX_BLOCK + (long)tid * SPLAT_RADIX_KEYS_PER_THREAD;
  for (int k = 0; k < SPLAT_RADIX_KEYS_PER_THREAD; ++k) {
    const long j = base + k;
    if (j < n) {
      const uint d = (keys_in[j] >> sh) & (SPLAT_RADIX_BINS - 1);
      counts[d * SPLAT_RADIX_THREADS + tid] += 1;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 2. segment scans: digit dg, columns [sg * BINS, sg * BINS + BINS)
  {
    const int dg = (int)tid % SPLAT_RADIX_BINS;
    const int sg = (int)tid / SPLAT_RADIX_BINS;
    uint run = 0;
    for (int c = 0; c < SPLAT_RADIX_BINS; ++c) {
      const int slot = dg * SPLAT_RADIX_THREADS + sg * SPLAT_RADIX_BINS + c;
      const uint v = counts[slot];
      counts[slot] = run;
      run += v;
    }
    seg[dg * SEGS + sg] = run;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 3. per-digit scan of the segment totals
  if (tid < SPLAT_RADIX_BINS) {
    uint run = 0;
    for (int s = 0; s < SEGS; ++s) {
      const uint v = seg[tid * SEGS + s];
      seg[tid * SEGS + s] = run;
      run += v;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 4. stable scatter of the own run
  const int my_seg = (int)tid / SPLAT_RADIX_BINS;
  for (int k = 0; k < SPLAT_RADIX_KEYS_PER_THREAD; ++k) {
    const long j = base + k;
    if (j < n) {
      const uint key = keys_in[j];
      const uint d = (key >> sh) & (SPLAT_RADIX_BINS - 1);
      const int slot = (int)d * SPLAT_RADIX_THREADS + (int)tid;
      const long dst = bin_offsets[(long)d * n_blocks + blk] + (long)seg[d * SEGS + my_seg] + (long)counts[slot];
      counts[slot] += 1;
      keys_out[dst] = key;
      vals_out[dst] = iota != 0 ? (uint)j : vals_in[j];
    }
  }
}
