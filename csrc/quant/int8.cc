#include "quant/int8.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <mutex>

#include "quant/vector_clones.h"

namespace fastopt::quant {
namespace {

// Floats per tile: 4 MB of codes input per task.
constexpr int64_t kTileFloats = 1 << 20;
// Mapped source bytes all threads together hold at once: a weight up to its share of this is
// read once (its range, then its codes over the same mapped pages); a larger one (an lm_head)
// is read twice, its range in tiles, then its codes in tiles, each tile's pages released
// after use.
constexpr uint64_t kMappedBudget = 128u << 20;

struct Range {
  std::vector<float> lo, hi;  // per channel
  bool finite = true;
  explicit Range(size_t channels) : lo(channels, INFINITY), hi(channels, -INFINITY) {}
  void merge(const Range& o) {
    finite &= o.finite;
    for (size_t k = 0; k < lo.size(); ++k) {
      lo[k] = std::min(lo[k], o.lo[k]);
      hi[k] = std::max(hi[k], o.hi[k]);
    }
  }
};

// The loops keep kLanes partial results (min, max, sums) side by side in local arrays and
// combine them at the end: a float reduction into one variable does not vectorize without
// -ffast-math, and partial results kept behind a reference did not either (the int8 code
// stores may alias them), which left these loops scalar and branchy.
constexpr int kLanes = 16;

struct RangeStats {
  float lo = INFINITY, hi = -INFINITY;
  bool finite = true;
};

// The range (per tensor) and finiteness of n floats. min / max as std::min(l, v) /
// std::max(h, v): a NaN v leaves them unchanged; v - v is NaN for NaN and infinities.
FASTOPT_VECTOR_CLONES RangeStats range_of(const float* __restrict x, int64_t n) {
  float lo[kLanes], hi[kLanes], bad[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    lo[l] = INFINITY;
    hi[l] = -INFINITY;
    bad[l] = 0;
  }
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = x[c + l];
      lo[l] = v < lo[l] ? v : lo[l];
      hi[l] = v > hi[l] ? v : hi[l];
      bad[l] += v - v;
    }
  }
  for (; c < n; ++c) {
    const float v = x[c];
    lo[0] = v < lo[0] ? v : lo[0];
    hi[0] = v > hi[0] ? v : hi[0];
    bad[0] += v - v;
  }
  RangeStats r;
  float nonfinite = 0;
  for (int l = 0; l < kLanes; ++l) {
    r.lo = std::min(r.lo, lo[l]);
    r.hi = std::max(r.hi, hi[l]);
    nonfinite += bad[l];
  }
  r.finite = nonfinite == 0;
  return r;
}

// Per channel: the columns' ranges over `rows` rows of n floats (into lo / hi); finiteness.
FASTOPT_VECTOR_CLONES bool column_ranges(const float* __restrict x, int64_t rows, int64_t n,
                                         float* __restrict lo, float* __restrict hi) {
  float bad[kLanes] = {};
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict row = x + r * n;
    for (int64_t c = 0; c < n; ++c) {
      lo[c] = row[c] < lo[c] ? row[c] : lo[c];
      hi[c] = row[c] > hi[c] ? row[c] : hi[c];
    }
    int64_t c = 0;
    for (; c + kLanes <= n; c += kLanes) {
      for (int l = 0; l < kLanes; ++l) bad[l] += row[c + l] - row[c + l];
    }
    for (; c < n; ++c) bad[0] += row[c] - row[c];
  }
  float nonfinite = 0;
  for (int l = 0; l < kLanes; ++l) nonfinite += bad[l];
  return nonfinite == 0;
}

struct CodeStats {
  float e_sum = 0, a_sum = 0, e_max = 0, a_max = 0;
};

// numpy: (x / scale).round() + zp, clipped: nearbyint rounds half to even in the default
// rounding mode, as numpy's round; SSE4.1's roundps does it 8 or 16 at a time (the AVX2 and
// AVX-512 clones; the baseline clone calls nearbyintf). The clamp to +-2^20 first changes no
// result (it clips anyway). Also the reconstruction error terms.
FASTOPT_VECTOR_CLONES CodeStats code_row(const float* __restrict x, const float* __restrict sc,
                                         const float* __restrict zp, int64_t n,
                                         int8_t* __restrict q) {
  for (int64_t c = 0; c < n; ++c) {
    float v = x[c] / sc[c];
    v = -1048576.0f < v ? v : -1048576.0f;  // std::max(-2^20, v)
    v = v < 1048576.0f ? v : 1048576.0f;    // std::min(2^20, v)
    v = std::nearbyint(v) + zp[c];
    v = -128.0f < v ? v : -128.0f;
    v = v < 127.0f ? v : 127.0f;
    q[c] = static_cast<int8_t>(static_cast<int32_t>(v));
  }
  // The error terms in a second loop over the row (in L1 by now): with the codes' int8 stores
  // in the same loop the compiler vectorized it 4 floats wide only.
  float e_sum[kLanes] = {}, a_sum[kLanes] = {}, e_max[kLanes] = {}, a_max[kLanes] = {};
  auto step = [&](int64_t c, int l) {
    const float e = std::fabs(x[c] - (static_cast<float>(q[c]) - zp[c]) * sc[c]);
    const float a = std::fabs(x[c]);
    e_sum[l] += e;
    a_sum[l] += a;
    e_max[l] = e > e_max[l] ? e : e_max[l];
    a_max[l] = a > a_max[l] ? a : a_max[l];
  };
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int l = 0; l < kLanes; ++l) step(c + l, l);
  }
  for (; c < n; ++c) step(c, 0);
  CodeStats r;
  for (int l = 0; l < kLanes; ++l) {
    r.e_sum += e_sum[l];
    r.a_sum += a_sum[l];
    r.e_max = std::max(r.e_max, e_max[l]);
    r.a_max = std::max(r.a_max, a_max[l]);
  }
  return r;
}

// Per-thread scratch.
struct Scratch {
  std::vector<float> block;  // rows copied out of the mapping (transposed or unaligned sources)
  std::vector<float> tmp;    // a transposed job's source block
  std::vector<int8_t> codes;
  std::vector<float> scale, zero;  // per column
};

// Rows [r0, r0 + n) of the weight to quantize as floats: where they lie in the mapping when
// they are float32 there, else copied into s.block.
const float* rows_of(const Int8Job& job, int64_t r0, int64_t n, Scratch& s) {
  if (!job.transposed) {
    if (const float* p = job.src.in_place()) return p + r0 * job.src.N;
  }
  s.block.resize(static_cast<size_t>(n * job.cols()));
  job.read_rows(r0, n, s.block.data(), s.tmp);
  return s.block.data();
}

// Rows [r0, r0 + n) were read for the last time.
void release_rows(const Int8Job& job, int64_t r0, int64_t n) {
  if (job.transposed) {
    job.src.release(0, job.src.K, r0, n);
  } else {
    job.src.release(r0, n, 0, job.src.N);
  }
}

Range range_of_rows(const Int8Job& job, const float* x, int64_t rows) {
  Range rg(static_cast<size_t>(job.channels()));
  if (job.channels() == 1) {
    const RangeStats r = range_of(x, rows * job.cols());
    rg.lo[0] = r.lo;
    rg.hi[0] = r.hi;
    rg.finite = r.finite;
  } else {
    rg.finite = column_ranges(x, rows, job.cols(), rg.lo.data(), rg.hi.data());
  }
  return rg;
}

void set_params(Int8Job& job, const Range& rg) {
  job.finite = rg.finite;
  job.params.resize(static_cast<size_t>(job.channels()));
  for (size_t k = 0; k < job.params.size(); ++k) {
    job.params[k] = int8_params(rg.lo[k], rg.hi[k], job.spec);
  }
}

// Codes of rows [r0, r0 + rows) (x: their floats) into the job's place in `out`.
ErrorSums write_codes(const Int8Job& job, int64_t r0, int64_t rows, const float* x, TempFile& out,
                      Scratch& s) {
  const int64_t N = job.cols();
  const bool per_channel = job.channels() > 1;
  s.scale.resize(static_cast<size_t>(N));
  s.zero.resize(static_cast<size_t>(N));
  for (int64_t c = 0; c < N; ++c) {
    const Int8Params& p = job.params[per_channel ? static_cast<size_t>(c) : 0];
    s.scale[static_cast<size_t>(c)] = p.scale;
    s.zero[static_cast<size_t>(c)] = static_cast<float>(p.zero_point);
  }
  s.codes.resize(static_cast<size_t>(rows * N));
  ErrorSums err;
  for (int64_t r = 0; r < rows; ++r) {
    const CodeStats st =
        code_row(x + r * N, s.scale.data(), s.zero.data(), N, s.codes.data() + r * N);
    err.abs_err += st.e_sum;
    err.abs += st.a_sum;
    err.max_err = std::max(err.max_err, st.e_max);
    err.max_abs = std::max(err.max_abs, st.a_max);
  }
  err.count = static_cast<uint64_t>(rows * N);
  out.write(job.data_offset + static_cast<uint64_t>(r0 * N), s.codes.data(), s.codes.size());
  return err;
}

int64_t tile_rows(const Int8Job& job) {
  return std::max<int64_t>(1, kTileFloats / std::max<int64_t>(1, job.cols()));
}

// A weight small enough to hold mapped: its range over all its rows, then its codes over the
// same pages, in tiles, each released once coded.
void quantize_whole(Int8Job& job, TempFile& out, Scratch& s) {
  const int64_t rows = job.rows();
  const float* x = rows_of(job, 0, rows, s);
  const Range rg = range_of_rows(job, x, rows);
  set_params(job, rg);
  if (!job.finite) {
    release_rows(job, 0, rows);
    return;
  }
  const int64_t step = tile_rows(job);
  for (int64_t r = 0; r < rows; r += step) {
    const int64_t n = std::min(step, rows - r);
    job.error.merge(write_codes(job, r, n, x + r * job.cols(), out, s));
    release_rows(job, r, n);
  }
}

struct Task {
  size_t job;
  int64_t r0, r1;
  bool whole;  // quantize_whole; else a tile of a large weight (its range, or its codes)
};

}  // namespace

Int8Params int8_params(float rmin, float rmax, const Int8Spec& spec) {
  int qmin = -128, qmax = 127;
  if (spec.reduce_range) {
    qmin = -64;
    qmax = 64;
  } else if (spec.symmetric) {
    qmin = -127;
  }
  rmin = std::min(rmin, 0.0f);
  rmax = std::max(rmax, 0.0f);
  if (spec.symmetric) {
    const float absmax = std::max(std::fabs(rmin), std::fabs(rmax));
    rmin = -absmax;
    rmax = absmax;
  }
  const double scale = (static_cast<double>(rmax) - static_cast<double>(rmin)) /
                       (static_cast<double>(qmax) - static_cast<double>(qmin));
  Int8Params p;
  if (scale < static_cast<double>(FLT_MIN)) return p;  // scale 1, zero point 0
  const double zp = spec.symmetric ? std::nearbyint((qmin + qmax) / 2.0)
                                   : std::nearbyint(qmin - static_cast<double>(rmin) / scale);
  p.zero_point = static_cast<int8_t>(zp);
  p.scale = static_cast<float>(scale);
  return p;
}

void Int8Job::read_rows(int64_t r0, int64_t n, float* dst, std::vector<float>& tmp) const {
  if (!transposed) {
    src.read(r0, n, 0, src.N, dst);
    return;
  }
  // Columns [r0, r0 + n) of the stored [src.K, src.N], transposed.
  tmp.resize(static_cast<size_t>(src.K * n));
  src.read(0, src.K, r0, n, tmp.data());
  for (int64_t k = 0; k < src.K; ++k) {
    for (int64_t i = 0; i < n; ++i) dst[i * src.K + k] = tmp[static_cast<size_t>(k * n + i)];
  }
}

void run_int8_jobs(std::vector<Int8Job>& jobs, TempFile& out, int threads,
                   const JobProgress& progress) {
  size_t max_tasks = 0;
  for (Int8Job& job : jobs) {
    job.src.check_readable();
    job.data_offset = out.reserve(job.data_bytes(), job.framing);
    max_tasks += static_cast<size_t>((job.rows() + tile_rows(job) - 1) / tile_rows(job));
  }
  const int n_threads = worker_count(threads, max_tasks);
  // The share of each thread asked for (not only of those this model's tasks keep busy).
  const uint64_t whole_limit =
      kMappedBudget / static_cast<uint64_t>(worker_count(threads, std::numeric_limits<int>::max()));
  // First: small weights whole, and the ranges of large ones in tiles; then the codes of the
  // large ones in tiles.
  std::vector<Task> first, codes;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Int8Job& job = jobs[j];
    // Whole only where it is read in place: a staged copy of it would be anonymous memory.
    if (!job.transposed && job.src.in_place() && job.data_bytes() * 4 <= whole_limit) {
      first.push_back({j, 0, job.rows(), true});
      continue;
    }
    for (int64_t r = 0; r < job.rows(); r += tile_rows(job)) {
      const Task t{j, r, std::min(job.rows(), r + tile_rows(job)), false};
      first.push_back(t);
      codes.push_back(t);
    }
  }
  auto work_of = [&](const Task& t) {
    return static_cast<uint64_t>((t.r1 - t.r0) * jobs[t.job].cols()) * 4;
  };
  // Largest first: the threads finish together.
  std::stable_sort(first.begin(), first.end(),
                   [&](const Task& a, const Task& b) { return work_of(a) > work_of(b); });
  std::vector<uint64_t> work;
  for (const Task& t : first) work.push_back(work_of(t));
  std::vector<Scratch> scratch(static_cast<size_t>(n_threads));
  std::vector<Range> ranges;
  ranges.reserve(jobs.size());
  for (const Int8Job& job : jobs) ranges.emplace_back(static_cast<size_t>(job.channels()));
  std::mutex mu;
  parallel_tasks(
      first.size(), work, n_threads,
      [&](size_t i, int w) {
        const Task& t = first[i];
        Int8Job& job = jobs[t.job];
        Scratch& s = scratch[static_cast<size_t>(w)];
        if (t.whole) return quantize_whole(job, out, s);  // the only task of its job
        const Range rg = range_of_rows(job, rows_of(job, t.r0, t.r1 - t.r0, s), t.r1 - t.r0);
        release_rows(job, t.r0, t.r1 - t.r0);
        std::lock_guard<std::mutex> lock(mu);
        ranges[t.job].merge(rg);
      },
      progress, [&](size_t i) { return jobs[first[i].job].name; });

  for (const Task& t : codes) {
    if (t.r0 == 0) set_params(jobs[t.job], ranges[t.job]);
  }
  work.clear();
  for (const Task& t : codes) work.push_back(work_of(t));
  parallel_tasks(
      codes.size(), work, n_threads,
      [&](size_t i, int w) {
        const Task& t = codes[i];
        Int8Job& job = jobs[t.job];
        if (!job.finite) return;
        Scratch& s = scratch[static_cast<size_t>(w)];
        const ErrorSums err =
            write_codes(job, t.r0, t.r1 - t.r0, rows_of(job, t.r0, t.r1 - t.r0, s), out, s);
        release_rows(job, t.r0, t.r1 - t.r0);
        std::lock_guard<std::mutex> lock(mu);
        job.error.merge(err);
      },
      progress, [&](size_t i) { return jobs[codes[i].job].name + " (codes)"; });
  if (progress) progress(1, 1, "");
}

}  // namespace fastopt::quant
