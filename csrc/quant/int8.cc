#include "quant/int8.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <mutex>

namespace fastopt::quant {
namespace {

// Floats per tile: 4 MB of staging per thread.
constexpr int64_t kTileFloats = 1 << 20;
// 1.5 * 2^23: (v + m) - m rounds |v| < 2^22 to an integer, half to even (float32, no FMA).
constexpr float kRoundMagic = 12582912.0f;

struct Range {
  std::vector<float> lo, hi;
  bool finite = true;
};

struct Tile {
  size_t job;
  int64_t r0, r1;
};

// The row loops keep kLanes partial results (min, max, sums) side by side and combine them at
// the end: a float reduction into one variable does not vectorize without -ffast-math, which
// made these loops scalar (measured: int8 weights took 3.8x int4's time, 2.4 GB export).
constexpr int kLanes = 16;

struct Lanes {
  float lo[kLanes], hi[kLanes], bad[kLanes];  // bad: v - v, NaN for NaN and infinities
  float e_sum[kLanes], a_sum[kLanes], e_max[kLanes], a_max[kLanes];
  Lanes() {
    for (int l = 0; l < kLanes; ++l) {
      lo[l] = INFINITY;
      hi[l] = -INFINITY;
      bad[l] = e_sum[l] = a_sum[l] = e_max[l] = a_max[l] = 0;
    }
  }
};

// min / max as std::min(l, v) / std::max(h, v): a NaN v leaves them unchanged.
inline void range_step(Lanes& s, int l, float v) {
  s.lo[l] = v < s.lo[l] ? v : s.lo[l];
  s.hi[l] = v > s.hi[l] ? v : s.hi[l];
  s.bad[l] += v - v;
}

// One row's range (per tensor) and finiteness.
void range_row(const float* __restrict x, int64_t n, Lanes& s) {
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int l = 0; l < kLanes; ++l) range_step(s, l, x[c + l]);
  }
  for (; c < n; ++c) range_step(s, 0, x[c]);
}

// One row's finiteness only (per channel: the ranges are per column).
void finite_row(const float* __restrict x, int64_t n, Lanes& s) {
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int l = 0; l < kLanes; ++l) s.bad[l] += x[c + l] - x[c + l];
  }
  for (; c < n; ++c) s.bad[0] += x[c] - x[c];
}

// numpy: (x / scale).round() + zp, clipped. The clamp to +-2^20 first changes no result (it
// clips anyway) and keeps the add-and-subtract of 1.5 * 2^23 an exact round half to even in
// float32 (vectorizes, unlike nearbyint).
inline void code_step(Lanes& s, int l, float x, float sc, float zp, int8_t& q) {
  float v = std::min(1048576.0f, std::max(-1048576.0f, x / sc));
  v = (v + kRoundMagic) - kRoundMagic;
  v = std::min(127.0f, std::max(-128.0f, v + zp));
  q = static_cast<int8_t>(v);
  const float e = std::fabs(x - (v - zp) * sc), a = std::fabs(x);
  s.e_sum[l] += e;
  s.a_sum[l] += a;
  s.e_max[l] = e > s.e_max[l] ? e : s.e_max[l];
  s.a_max[l] = a > s.a_max[l] ? a : s.a_max[l];
}

void code_row(const float* __restrict x, const float* __restrict sc, const float* __restrict zp,
              int64_t n, int8_t* __restrict q, Lanes& s) {
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int l = 0; l < kLanes; ++l) code_step(s, l, x[c + l], sc[c + l], zp[c + l], q[c + l]);
  }
  for (; c < n; ++c) code_step(s, 0, x[c], sc[c], zp[c], q[c]);
}

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

void Int8Job::read_rows(int64_t r0, int64_t n, float* dst, std::vector<float>& tmp,
                        std::vector<uint8_t>& raw) const {
  if (!transposed) {
    src.read(r0, n, 0, src.N, dst, raw);
    return;
  }
  // Columns [r0, r0 + n) of the stored [src.K, src.N], transposed.
  tmp.resize(static_cast<size_t>(src.K * n));
  src.read(0, src.K, r0, n, tmp.data(), raw);
  for (int64_t k = 0; k < src.K; ++k) {
    for (int64_t i = 0; i < n; ++i) dst[i * src.K + k] = tmp[static_cast<size_t>(k * n + i)];
  }
}

void run_int8_jobs(std::vector<Int8Job>& jobs, TempFile& out, int threads,
                   const JobProgress& progress) {
  std::vector<Tile> tiles;
  std::vector<uint64_t> work;
  for (size_t j = 0; j < jobs.size(); ++j) {
    Int8Job& job = jobs[j];
    job.data_offset = out.reserve(job.data_bytes());
    const int64_t rows = std::max<int64_t>(1, kTileFloats / std::max<int64_t>(1, job.cols()));
    for (int64_t r = 0; r < job.rows(); r += rows) {
      tiles.push_back({j, r, std::min(job.rows(), r + rows)});
      work.push_back(static_cast<uint64_t>((tiles.back().r1 - r) * job.cols()) * 4);
    }
  }
  const int n_threads = worker_count(threads, tiles.size());
  struct Scratch {
    std::vector<float> block;
    std::vector<uint8_t> raw;
    std::vector<int8_t> codes;
    std::vector<float> scale, zero;  // per column of the tile
    std::vector<float> tmp;          // a transposed job's source block
  };
  std::vector<Scratch> scratch(static_cast<size_t>(n_threads));

  // Pass 1: ranges, per tile, merged under the job's lock.
  std::vector<Range> ranges(jobs.size());
  for (size_t j = 0; j < jobs.size(); ++j) {
    ranges[j].lo.assign(static_cast<size_t>(jobs[j].channels()), INFINITY);
    ranges[j].hi.assign(static_cast<size_t>(jobs[j].channels()), -INFINITY);
  }
  std::mutex mu;
  parallel_tasks(
      tiles.size(), work, n_threads,
      [&](size_t i, int w) {
        const Tile& t = tiles[i];
        const Int8Job& job = jobs[t.job];
        Scratch& s = scratch[static_cast<size_t>(w)];
        const int64_t N = job.cols(), rows = t.r1 - t.r0;
        s.block.resize(static_cast<size_t>(rows * N));
        job.read_rows(t.r0, rows, s.block.data(), s.tmp, s.raw);
        const size_t ch = static_cast<size_t>(job.channels());
        std::vector<float> lo(ch, INFINITY), hi(ch, -INFINITY);
        Lanes lanes;
        for (int64_t r = 0; r < rows; ++r) {
          const float* x = s.block.data() + r * N;
          if (ch == 1) {
            range_row(x, N, lanes);
          } else {
            for (int64_t c = 0; c < N; ++c) {
              lo[c] = std::min(lo[c], x[c]);
              hi[c] = std::max(hi[c], x[c]);
            }
            finite_row(x, N, lanes);
          }
        }
        float nonfinite = 0;
        for (int l = 0; l < kLanes; ++l) {
          nonfinite += lanes.bad[l];
          if (ch == 1) {
            lo[0] = std::min(lo[0], lanes.lo[l]);
            hi[0] = std::max(hi[0], lanes.hi[l]);
          }
        }
        const bool finite = nonfinite == 0;
        std::lock_guard<std::mutex> lock(mu);
        Range& rg = ranges[t.job];
        rg.finite &= finite;
        for (size_t k = 0; k < ch; ++k) {
          rg.lo[k] = std::min(rg.lo[k], lo[k]);
          rg.hi[k] = std::max(rg.hi[k], hi[k]);
        }
      },
      progress, "int8 ranges");

  for (size_t j = 0; j < jobs.size(); ++j) {
    Int8Job& job = jobs[j];
    job.finite = ranges[j].finite;
    job.params.resize(static_cast<size_t>(job.channels()));
    for (size_t k = 0; k < job.params.size(); ++k) {
      job.params[k] = int8_params(ranges[j].lo[k], ranges[j].hi[k], job.spec);
    }
  }

  // Pass 2: codes.
  parallel_tasks(
      tiles.size(), work, n_threads,
      [&](size_t i, int w) {
        const Tile& t = tiles[i];
        Int8Job& job = jobs[t.job];
        if (!job.finite) return;
        Scratch& s = scratch[static_cast<size_t>(w)];
        const int64_t N = job.cols(), rows = t.r1 - t.r0;
        s.block.resize(static_cast<size_t>(rows * N));
        s.codes.resize(static_cast<size_t>(rows * N));
        job.read_rows(t.r0, rows, s.block.data(), s.tmp, s.raw);
        const bool per_channel = job.channels() > 1;
        s.scale.resize(static_cast<size_t>(N));
        s.zero.resize(static_cast<size_t>(N));
        for (int64_t c = 0; c < N; ++c) {
          const Int8Params& p = job.params[per_channel ? static_cast<size_t>(c) : 0];
          s.scale[static_cast<size_t>(c)] = p.scale;
          s.zero[static_cast<size_t>(c)] = static_cast<float>(p.zero_point);
        }
        const float* sc = s.scale.data();
        const float* zp = s.zero.data();
        ErrorSums err;
        for (int64_t r = 0; r < rows; ++r) {
          Lanes lanes;
          code_row(s.block.data() + r * N, sc, zp, N, s.codes.data() + r * N, lanes);
          float e_sum = 0, a_sum = 0;
          for (int l = 0; l < kLanes; ++l) {
            e_sum += lanes.e_sum[l];
            a_sum += lanes.a_sum[l];
            err.max_err = std::max(err.max_err, lanes.e_max[l]);
            err.max_abs = std::max(err.max_abs, lanes.a_max[l]);
          }
          err.abs_err += e_sum;
          err.abs += a_sum;
        }
        err.count = static_cast<uint64_t>(rows * N);
        out.write(job.data_offset + static_cast<uint64_t>(t.r0 * N), s.codes.data(),
                  s.codes.size());
        std::lock_guard<std::mutex> lock(mu);
        job.error.merge(err);
      },
      progress, "int8 codes");
  if (progress) progress(1, 1, "");
}

}  // namespace fastopt::quant
