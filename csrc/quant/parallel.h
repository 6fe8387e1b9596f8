// The worker pool every quantization kernel shares: tasks (tiles of weights) taken in order by
// `threads` threads, progress reported from the calling thread, the first error rethrown.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fastopt::quant {

// (done, total, what): work units (source bytes) done so far; may be empty.
using JobProgress = std::function<void(int64_t, int64_t, const std::string&)>;
// What the task about to be taken is (for progress), given its index.
using TaskLabel = std::function<std::string(size_t task)>;

// Workers for `tasks` tasks on `threads` threads (0 = all cores): at least 1, at most tasks.
int worker_count(int threads, size_t tasks);

// Runs fn(task, worker) for task in [0, n) on worker_count(threads, n) threads, worker ids
// below that count; the calling thread reports progress(done_work, total_work, label(next))
// about ten times a second, `work[i]` weighing task i. Rethrows the first error once all
// workers stopped (the others stop taking tasks).
void parallel_tasks(size_t n, const std::vector<uint64_t>& work, int threads,
                    const std::function<void(size_t task, int worker)>& fn,
                    const JobProgress& progress, const TaskLabel& label);
void parallel_tasks(size_t n, const std::vector<uint64_t>& work, int threads,
                    const std::function<void(size_t task, int worker)>& fn,
                    const JobProgress& progress, const std::string& what);

}  // namespace fastopt::quant
