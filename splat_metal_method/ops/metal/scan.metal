// scan.metal: prefix sums (exclusive or inclusive) of int32 or int64 values into int64, on the device.
//
// Why our own scan: MPS integer cumsum has had correctness bugs across torch releases, and the
// emulator runs torch's CPU cumsum, so only a Mac would see one (issue 22, section 6). The sums are
// accumulated and written in 64 bits: the intersection count of a large scene can pass 2^31, and the
// host must see that to refuse it.
//
// A group of SCAN_THREADS threads owns a block of SCAN_BLOCK = SCAN_THREADS * SCAN_ITEMS consecutive
// values; thread t owns the contiguous run [t * SCAN_ITEMS, (t + 1) * SCAN_ITEMS) of its block.
// scan.py drives it by the number of blocks:
//   1 block                      scan_blocks alone, carry_mode 0 (one dispatch)
//   up to SCAN_SINGLE_BLOCKS,    scan_blocks alone, carry_mode 3: each group sums the values of all
//   out-of-place                 earlier blocks itself (one dispatch; at most SCAN_SINGLE_BLOCKS - 1
//                                blocks of loads per group; `out` must not alias the values, which
//                                other groups would be overwriting)
//   up to SCAN_CARRY_BLOCKS      scan_block_sums, then scan_blocks with carry_mode 1: each group sums
//                                the totals of all earlier blocks itself (two dispatches)
//   more                         scan_block_sums, an exclusive scan of the block totals (this scheme,
//                                recursively), then scan_blocks with carry_mode 2: each group reads
//                                its block's carry (three or more dispatches).
// Values are read from in32 (wide == 0) or in64 (wide != 0); the other buffer is never read.
// Compiled after common.h: kernels.py prepends it (compile_shader has no include path).

#if (SPLAT_SCAN_THREADS & (SPLAT_SCAN_THREADS - 1)) != 0
#error "SPLAT_SCAN_THREADS must be a power of two"
#endif

inline long scan_load(const device int* in32, const device long* in64, long wide, long j) {
  return wide != 0 ? in64[j] : (long)in32[j];
}

// Exclusive scan of one value per thread across the group, through `part` (SCAN_THREADS longs):
// returns the sum of the values of lower threads and sets `total` to the group's sum. Hillis-Steele,
// log2(SCAN_THREADS) rounds. Every thread of the group must call it (it holds barriers); `part` is
// free again when it returns.
inline long group_exclusive_scan(threadgroup long* part, uint tid, long v, thread long& total) {
  part[tid] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint off = 1; off < SPLAT_SCAN_THREADS; off <<= 1) {
    const long add = tid >= off ? part[tid - off] : 0;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    part[tid] += add;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  const long inclusive = part[tid];
  total = part[SPLAT_SCAN_THREADS - 1];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return inclusive - v;
}

// scan_block_sums: one group per block; block_sums[b] = sum of block b's values (values at index
// >= n count 0, never read). Grid padded to whole groups.
[[max_total_threads_per_threadgroup(SPLAT_SCAN_THREADS)]]
kernel void scan_block_sums(
    const device int* in32 [[buffer(0)]],     // [n] when wide == 0
    const device long* in64 [[buffer(1)]],    // [n] when wide != 0
    device long* block_sums [[buffer(2)]],    // [n_blocks]
    constant long& n [[buffer(3)]],
    constant long& wide [[buffer(4)]],
    uint tid [[thread_index_in_threadgroup]],
    uint3 tgp [[threadgroup_position_in_grid]]) {
  threadgroup long part[SPLAT_SCAN_THREADS];
  const long blk = (long)tgp.x;
  const long base = blk * SPLAT_SCAN_THREADS * SPLAT_SCAN_ITEMS + (long)tid * SPLAT_SCAN_ITEMS;
  long run = 0;
  for (int k = 0; k < SPLAT_SCAN_ITEMS; ++k) {
    if (base + k < n) {
      run += scan_load(in32, in64, wide, base + k);
    }
  }
  long total = 0;
  group_exclusive_scan(part, tid, run, total);
  if (tid == 0) {
    block_sums[blk] = total;
  }
}

// scan_blocks: one group per block; out[j] = carry of the block + sum of the block's values before j
// (exclusive) or up to and including j (inclusive). carry_mode 0: no carry (one block); 1: `carries`
// holds every block's total and the group sums those of blocks [0, b) (at most
// ceil(b / SCAN_THREADS) loads per thread); 2: `carries` holds the exclusive scan of the totals;
// 3: the group sums the values of blocks [0, b) itself (b * SCAN_ITEMS loads per thread; out-of-place).
// carry_mode is the same for every thread, so the barriers in its branch are reached by all.
[[max_total_threads_per_threadgroup(SPLAT_SCAN_THREADS)]]
kernel void scan_blocks(
    const device int* in32 [[buffer(0)]],     // [n] when wide == 0
    const device long* in64 [[buffer(1)]],    // [n] when wide != 0
    device long* out [[buffer(2)]],           // [n]
    const device long* carries [[buffer(3)]], // [n_blocks] (carry_mode 1, 2); unread for carry_mode 0
    constant long& n [[buffer(4)]],
    constant long& wide [[buffer(5)]],
    constant long& inclusive [[buffer(6)]],
    constant long& carry_mode [[buffer(7)]],
    uint tid [[thread_index_in_threadgroup]],
    uint3 tgp [[threadgroup_position_in_grid]]) {
  threadgroup long part[SPLAT_SCAN_THREADS];
  const long blk = (long)tgp.x;
  long carry = 0;
  if (carry_mode == 1) {
    long earlier = 0;
    for (long b = (long)tid; b < blk; b += SPLAT_SCAN_THREADS) {
      earlier += carries[b];
    }
    group_exclusive_scan(part, tid, earlier, carry);
  } else if (carry_mode == 2) {
    carry = carries[blk];
  } else if (carry_mode == 3) {
    long earlier = 0;
    const long first = blk * SPLAT_SCAN_THREADS * SPLAT_SCAN_ITEMS;
    for (long j = (long)tid; j < first; j += SPLAT_SCAN_THREADS) {
      earlier += scan_load(in32, in64, wide, j);
    }
    group_exclusive_scan(part, tid, earlier, carry);
  }
  const long base = blk * SPLAT_SCAN_THREADS * SPLAT_SCAN_ITEMS + (long)tid * SPLAT_SCAN_ITEMS;
  long run = 0;
  for (int k = 0; k < SPLAT_SCAN_ITEMS; ++k) {
    if (base + k < n) {
      run += scan_load(in32, in64, wide, base + k);
    }
  }
  long block_total = 0;
  long acc = carry + group_exclusive_scan(part, tid, run, block_total);
  for (int k = 0; k < SPLAT_SCAN_ITEMS; ++k) {
    const long j = base + k;
    if (j < n) {
      const long v = scan_load(in32, in64, wide, j);
      out[j] = inclusive != 0 ? acc + v : acc;
      acc += v;
    }
  }
}

// scan_compact: one thread per row i < n of a mask given as int32 0/1 values with `cum` their
// inclusive prefix sum (scan_blocks). Row i is the (cum[i] - 1)-th selected row when mask[i] != 0,
// else the (i - cum[i])-th unselected one: sel[cum[i] - 1] = i, rest[i - cum[i]] = i (rest only when
// has_rest). The same rows in the same order as torch.where(mask) and torch.where(~mask), from the
// device's own count (the host knows how many rows are selected, not which). Independent threads.
[[max_total_threads_per_threadgroup(SPLAT_GROUP_1D)]]
kernel void scan_compact(
    const device int* mask [[buffer(0)]],     // [n] 0/1
    const device long* cum [[buffer(1)]],     // [n] inclusive prefix sum of mask
    device long* sel [[buffer(2)]],           // [cum[n - 1]]
    device long* rest [[buffer(3)]],          // [n - cum[n - 1]] (has_rest), else unread placeholder
    constant long& n [[buffer(4)]],
    constant long& has_rest [[buffer(5)]],
    uint i [[thread_position_in_grid]]) {
  if ((long)i >= n) {
    return;
  }
  const long c = cum[i];
  if (mask[i] != 0) {
    sel[c - 1] = (long)i;
  } else if (has_rest != 0) {
    rest[(long)i - c] = (long)i;
  }
}
