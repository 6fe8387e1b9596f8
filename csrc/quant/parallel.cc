#include "quant/parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

namespace fastopt::quant {

int worker_count(int threads, size_t tasks) {
  int n = threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, std::min<int>(n, static_cast<int>(std::max<size_t>(tasks, 1))));
}

void parallel_tasks(size_t n, const std::vector<uint64_t>& work, int threads,
                    const std::function<void(size_t, int)>& fn, const JobProgress& progress,
                    const TaskLabel& label) {
  if (n == 0) return;
  const int n_threads = worker_count(threads, n);
  int64_t total = 0;
  for (uint64_t w : work) total += static_cast<int64_t>(w);
  std::atomic<size_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex mu;
  std::condition_variable cv;
  int running = n_threads;
  auto worker = [&](int id) {
    try {
      for (size_t i; !failed && (i = next.fetch_add(1)) < n;) {
        fn(i, id);
        done += static_cast<int64_t>(work[i]);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::current_exception();
      failed = true;
    }
    std::lock_guard<std::mutex> lock(mu);
    --running;
    cv.notify_all();
  };
  std::vector<std::thread> pool;
  for (int i = 0; i < n_threads; ++i) pool.emplace_back(worker, i);
  {
    std::unique_lock<std::mutex> lock(mu);
    while (running > 0) {
      cv.wait_for(lock, std::chrono::milliseconds(100));
      if (progress && running > 0) {
        const std::string what = label ? label(std::min(next.load(), n - 1)) : std::string();
        lock.unlock();
        progress(done.load(), total, what);
        lock.lock();
      }
    }
  }
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

void parallel_tasks(size_t n, const std::vector<uint64_t>& work, int threads,
                    const std::function<void(size_t, int)>& fn, const JobProgress& progress,
                    const std::string& what) {
  parallel_tasks(n, work, threads, fn, progress, [&what](size_t) { return what; });
}

}  // namespace fastopt::quant
