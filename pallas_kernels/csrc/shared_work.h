// Work items shared out over XLA's intra-op thread pool, for the CPU kernels (issue 38).
#pragma once

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ced {

// Runs work(item) for every item in 0..items-1, each once, on the calling thread and on helpers from
// `pool`. The caller never waits for a helper that has not started (the pool's threads may all be busy,
// e.g. with another kernel call that waits too): once it runs out of items it closes the share and
// waits only for the helpers at work; a helper that starts later finds the share closed and touches
// nothing. `work` is copied into each helper, so it must hold its data by value or by pointer.
// `values` (the multiply-adds of all the items) below kValuesPerHelper keeps the work on the calling
// thread: waking a helper costs more than a small product (a `tiny` decode step's linears).
constexpr int64_t kValuesPerHelper = int64_t{1} << 18;

template <typename Work>
void share_items(xla::ffi::ThreadPool& pool, int64_t items, const Work& work, int64_t values = INT64_MAX) {
  struct Share {
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    int64_t working = 0;
    bool closed = false;
  };
  auto share = std::make_shared<Share>();
  auto drain = [items](Share& s, const Work& w) {
    for (int64_t item = s.next++; item < items; item = s.next++) w(item);
  };
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items);
  const int64_t helpers = std::min<int64_t>(threads - 1, values / kValuesPerHelper);
  for (int64_t t = 0; t < helpers; ++t)
    pool.Schedule([share, work, drain] {
      {
        std::lock_guard<std::mutex> lock(share->mu);
        if (share->closed) return;
        ++share->working;
      }
      drain(*share, work);
      std::lock_guard<std::mutex> lock(share->mu);
      if (--share->working == 0) share->cv.notify_all();
    });
  drain(*share, work);
  std::unique_lock<std::mutex> lock(share->mu);
  share->closed = true;
  share->cv.wait(lock, [&] { return share->working == 0; });
}

}  // namespace ced
