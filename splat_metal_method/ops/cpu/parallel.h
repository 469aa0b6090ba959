// parallel.h: the one threading helper of the native CPU backend.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace splat {

// Runs fn(i) for every i in [0, n) on up to n_threads threads (the calling thread is one of them).
// Threads take `chunk` consecutive indices at a time from a shared counter, so uneven work (tiles
// with many gaussians) balances itself. Which thread runs which i varies; callers make every i's
// result independent of that (each i writes its own outputs), which keeps results bit-identical
// for any thread count.
template <typename Fn>
void parallel_for(int64_t n, int n_threads, Fn fn, int64_t chunk = 1024) {
    std::atomic<int64_t> next(0);
    auto worker = [&]() {
        for (int64_t s = next.fetch_add(chunk); s < n; s = next.fetch_add(chunk))
            for (int64_t i = s; i < std::min(n, s + chunk); ++i) fn(i);
    };
    int64_t chunks = (n + chunk - 1) / chunk;
    int workers = (int)std::max<int64_t>(1, std::min<int64_t>(n_threads, chunks));
    std::vector<std::thread> pool;
    for (int t = 1; t < workers; ++t) pool.emplace_back(worker);
    worker();
    for (auto& t : pool) t.join();
}

}  // namespace splat
