#include "quant/float_convert.h"

#include <algorithm>
#include <cmath>
#include <mutex>

#include "ir/constant.h"
#include "quant/int8.h"

namespace fastopt::quant {
namespace {

constexpr uint64_t kTileFloats = 1 << 20;
constexpr float kHalfMax = 65504.0f;
constexpr uint16_t kBf16Max = 0x7f7f;

float back_to_float(uint16_t bits, int32_t to) {
  return to == 10 ? half_to_float(bits) : bfloat16_to_float(bits);
}

}  // namespace

uint16_t convert_float(float f, int32_t to, bool& clamped) {
  clamped = false;
  if (to == 10) {
    if (std::isfinite(f) && std::fabs(f) > kHalfMax) {
      clamped = true;
      f = f < 0 ? -kHalfMax : kHalfMax;
    }
    return float_to_half(f);
  }
  const uint16_t b = float_to_bfloat16(f);
  if (std::isfinite(f) && (b & 0x7fff) == 0x7f80) {
    clamped = true;
    return static_cast<uint16_t>((b & 0x8000) | kBf16Max);
  }
  return b;
}

void run_convert_jobs(std::vector<ConvertJob>& jobs, TempFile& out, int threads,
                      const JobProgress& progress) {
  struct Tile {
    size_t job;
    uint64_t begin, end;
  };
  std::vector<Tile> tiles;
  std::vector<uint64_t> work;
  std::vector<WeightSource> sources;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const uint64_t row = jobs[j].row_elems;
    sources.emplace_back(jobs[j].src, 1, static_cast<int64_t>(jobs[j].numel / row),
                         static_cast<int64_t>(row));
    sources.back().check_readable();
    jobs[j].offset = out.reserve(jobs[j].data_bytes(), jobs[j].framing);
    // Tiles of whole rows (elements when flat).
    const uint64_t step = std::max<uint64_t>(1, kTileFloats / row) * row;
    for (uint64_t b = 0; b < jobs[j].numel; b += step) {
      tiles.push_back({j, b, std::min(jobs[j].numel, b + step)});
      work.push_back((tiles.back().end - b) * 4);
    }
  }
  const int n_threads = worker_count(threads, tiles.size());
  struct Scratch {
    std::vector<float> x;
    std::vector<uint16_t> y;
  };
  std::vector<Scratch> scratch(static_cast<size_t>(n_threads));
  std::mutex mu;
  parallel_tasks(
      tiles.size(), work, n_threads,
      [&](size_t i, int w) {
        const Tile& t = tiles[i];
        ConvertJob& job = jobs[t.job];
        Scratch& s = scratch[static_cast<size_t>(w)];
        const int64_t n = static_cast<int64_t>(t.end - t.begin);
        const WeightSource& src = sources[t.job];
        const auto row = static_cast<int64_t>(job.row_elems);
        const int64_t r0 = static_cast<int64_t>(t.begin) / row, rows = n / row;
        s.y.resize(static_cast<size_t>(n));
        const float* x = src.in_place();
        if (x) {
          x += t.begin;
        } else {
          s.x.resize(static_cast<size_t>(n));
          src.read(r0, rows, 0, row, s.x.data());
          x = s.x.data();
        }
        uint64_t clamped = 0;
        ErrorSums err;
        for (int64_t k = 0; k < n; ++k) {
          bool c;
          const float v = x[k];
          const uint16_t b = convert_float(v, job.to, c);
          s.y[static_cast<size_t>(k)] = b;
          clamped += c;
          if (std::isfinite(v)) {
            const float e = std::fabs(v - back_to_float(b, job.to)), a = std::fabs(v);
            err.abs_err += e;
            err.abs += a;
            err.max_err = std::max(err.max_err, e);
            err.max_abs = std::max(err.max_abs, a);
          }
        }
        err.count = static_cast<uint64_t>(n);
        src.release(r0, rows, 0, row);
        out.write(job.offset + t.begin * 2, s.y.data(), static_cast<uint64_t>(n) * 2);
        std::lock_guard<std::mutex> lock(mu);
        job.clamped += clamped;
        job.error.merge(err);
      },
      progress, "converting weights");
  if (progress) progress(1, 1, "");
}

}  // namespace fastopt::quant
