#include "quant/quantize_job.h"

#include <algorithm>
#include <cstring>

#include "ir/constant.h"
#include "ir/error.h"
#include "quant/gptq.h"
#include "quant/pack.h"

namespace fastopt::quant {
namespace {

// Budget of one tile's staging, per thread, and of a MatMulNBits tile's output: wide enough that
// most tiles span the weight's whole width, so that each block of rows is one read.
constexpr uint64_t kTileBytes = 4u << 20;
constexpr uint64_t kTileOutputBytes = 16u << 20;
// Columns quantized together within a block: its rows stay in L1 between the two passes.
constexpr int64_t kChunk = 256;

struct Tile {
  size_t job;
  int64_t begin, end;  // columns (MatMulNBits) or rows (QDQ)
  uint64_t work;       // source bytes, for progress
};

// Per-thread scratch.
struct Scratch {
  std::vector<float> block;
  std::vector<uint8_t> data, scales, zps;
  std::vector<uint8_t> last_codes;  // per column: code of the previous block's last row
  std::vector<float> columns;       // transposed sources: the tile's columns, whole
  std::vector<uint8_t> pairs;       // pack_columns' staging
  std::vector<float> work, errors;  // GPTQ: the tile [K, cols] being rounded, block errors
  std::vector<BlockQuantizer> block_quantizers;  // GPTQ act order: one per block
};

// kQdqRows: the first K * bits / 8 bytes of each column's MatMulNBits blocks (no padding), as
// signed codes when symmetric (q - mid: the top bit of each code flipped).
void write_rows_layout(const WeightJob& job, int64_t c0, int64_t cols, TempFile& out, Scratch& s) {
  const int64_t col_bytes = job.k_blocks() * job.blob();
  const int64_t row_bytes = job.src.K * job.spec.bits / 8;
  const uint8_t flip = !job.spec.symmetric ? 0 : job.spec.bits == 8 ? 0x80 : 0x88;
  for (int64_t c = 0; c < cols; ++c) {
    const uint8_t* from = s.data.data() + c * col_bytes;
    uint8_t* to = s.data.data() + c * row_bytes;  // row_bytes <= col_bytes: in place
    for (int64_t i = 0; i < row_bytes; ++i) to[i] = static_cast<uint8_t>(from[i] ^ flip);
  }
  out.write(job.data_offset + static_cast<uint64_t>(c0 * row_bytes), s.data.data(),
            static_cast<size_t>(cols * row_bytes));
}

// The last block when K is not a block multiple (`rows` < block size), columns [cc, cc + w) of
// the tile: codes q[r * w + j] into each column's blob.
void pack_last_block(const uint8_t* q, int64_t rows, int64_t w, int64_t cc, int64_t kb,
                     const WeightJob& job, Scratch& s) {
  const int64_t K = job.src.K, bs = job.spec.block_size, kb_count = job.k_blocks();
  const int64_t blob = job.blob();
  for (int64_t j = 0; j < w; ++j) {
    const int64_t c = cc + j;
    uint8_t* dst = s.data.data() + (c * kb_count + kb) * blob;
    std::memset(dst, 0, static_cast<size_t>(blob));  // padding rows hold code 0
    if (job.spec.bits == 8) {
      for (int64_t r = 0; r < rows; ++r) dst[r] = q[r * w + j];
      continue;
    }
    const int64_t pairs = rows / 2;
    for (int64_t i = 0; i < pairs; ++i) {
      dst[i] = static_cast<uint8_t>(q[(2 * i) * w + j] | (q[(2 * i + 1) * w + j] << 4));
    }
    if (rows & 1) {
      // Odd K: onnxruntime leaves the last byte's high nibble holding the code it made before
      // (row K-2 when it falls in the same two-block unit, else 0). Copy that.
      const int64_t unit_start = (K - 1) / (2 * bs) * (2 * bs);
      uint8_t prev = 0;
      if (K - 2 >= unit_start) prev = rows >= 2 ? q[(rows - 2) * w + j] : s.last_codes[c];
      dst[pairs] = static_cast<uint8_t>(q[(rows - 1) * w + j] | (prev << 4));
    }
    s.last_codes[c] = q[(rows - 1) * w + j];
  }
}

// The codes, scales and zero points bq holds for block kb of columns [cc, cc + w) of the tile
// starting at column c0, into the tile's staging (zero points of kQdqRows into the job).
void store_block(WeightJob& job, const BlockQuantizer& bq, int64_t kb, int64_t rows, int64_t w,
                 int64_t cc, int64_t c0, Scratch& s) {
  const BlockwiseSpec& spec = job.spec;
  const int64_t bs = spec.block_size, kb_count = job.k_blocks(), blob = job.blob();
  const int64_t zp_cols = (kb_count * spec.bits + 7) / 8;
  const int sb = spec.scale_bytes();
  const uint8_t* q = bq.codes();
  if (rows == bs) {
    pack_columns(q, rows, w, spec.bits, s.data.data() + (cc * kb_count + kb) * blob,
                 kb_count * blob, s.pairs);
    if (spec.bits == 4) std::memcpy(s.last_codes.data() + cc, q + (rows - 1) * w, w);
  } else {
    pack_last_block(q, rows, w, cc, kb, job, s);
  }
  for (int64_t j = 0; j < w; ++j) {
    const int64_t c = cc + j;
    bq.store_scale(j, s.scales.data() + (c * kb_count + kb) * sb);
    if (!spec.symmetric && job.layout == Layout::kQdqRows) {  // packed flat at the end
      job.qdq_zero_points[static_cast<size_t>((c0 + c) * kb_count + kb)] = bq.zero_point(j);
    } else if (!spec.symmetric) {
      uint8_t* z = s.zps.data() + c * zp_cols;
      if (spec.bits == 8) {
        z[kb] = bq.zero_point(j);
      } else {
        // Low nibble first; a column's spare high nibble (odd block count) is 8.
        if (kb % 2 == 0) {
          z[kb / 2] = static_cast<uint8_t>(bq.zero_point(j) | (kb + 1 == kb_count ? 0x80 : 0));
        } else {
          z[kb / 2] = static_cast<uint8_t>(z[kb / 2] | (bq.zero_point(j) << 4));
        }
      }
    }
  }
}

// Sizes the staging of a MatMulNBits tile of `cols` columns (every byte is written).
void start_nbits_tile(const WeightJob& job, int64_t cols, Scratch& s) {
  const BlockwiseSpec& spec = job.spec;
  const int64_t kb_count = job.k_blocks();
  const int64_t zp_cols = (kb_count * spec.bits + 7) / 8;
  s.data.resize(static_cast<size_t>(cols * kb_count * job.blob()));
  s.scales.resize(static_cast<size_t>(cols * kb_count * spec.scale_bytes()));
  if (!spec.symmetric) s.zps.assign(static_cast<size_t>(cols * zp_cols), 0);
  s.last_codes.assign(static_cast<size_t>(cols), 0);
}

// Writes a MatMulNBits tile's staged parts (columns [c0, c0 + cols)) and merges its error.
void write_nbits_tile(WeightJob& job, int64_t c0, int64_t cols, const ErrorSums& err, TempFile& out,
                      Scratch& s) {
  const BlockwiseSpec& spec = job.spec;
  const int64_t kb_count = job.k_blocks();
  const int64_t zp_cols = (kb_count * spec.bits + 7) / 8;
  if (job.layout == Layout::kQdqRows) {
    write_rows_layout(job, c0, cols, out, s);
  } else {
    out.write(job.data_offset + static_cast<uint64_t>(c0 * kb_count * job.blob()), s.data.data(),
              s.data.size());
  }
  out.write(job.scale_offset + static_cast<uint64_t>(c0 * kb_count * spec.scale_bytes()),
            s.scales.data(), s.scales.size());
  if (!spec.symmetric && job.layout == Layout::kNBits) {
    out.write(job.zp_offset + static_cast<uint64_t>(c0 * zp_cols), s.zps.data(), s.zps.size());
  }
  std::lock_guard<std::mutex> lock(*job.mu);
  job.error.merge(err);
}

// MatMulNBits tile: columns [c0, c1), all of K. Its output is contiguous in each part.
void nbits_tile(WeightJob& job, int64_t c0, int64_t c1, TempFile& out, Scratch& s) {
  const BlockwiseSpec& spec = job.spec;
  const int64_t K = job.src.K, bs = spec.block_size, kb_count = job.k_blocks();
  const int64_t cols = c1 - c0;
  start_nbits_tile(job, cols, s);
  // float32 weights are quantized where they lie in the mapping (rows N floats apart).
  const float* in_place = job.src.in_place();
  if (!in_place || job.src.transposed) s.block.resize(static_cast<size_t>(bs * cols));
  const float* columns = nullptr;  // transposed: the tile's columns, [cols, K]
  if (job.src.transposed) {
    if (in_place) {
      columns = in_place + c0 * K;
    } else {
      s.columns.resize(static_cast<size_t>(cols * K));
      job.src.read_columns(c0, cols, s.columns.data());
      columns = s.columns.data();
    }
  }
  BlockQuantizer bq(spec);
  ErrorSums err;
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    const int64_t r0 = kb * bs, rows = std::min(bs, K - r0);
    const float* block = s.block.data();
    int64_t ld = cols;
    if (job.src.transposed) {
      for (int64_t c = 0; c < cols; ++c) {
        const float* from = columns + c * K + r0;
        for (int64_t r = 0; r < rows; ++r) s.block[static_cast<size_t>(r * cols + c)] = from[r];
      }
    } else if (in_place) {
      block = in_place + r0 * job.src.N + c0;
      ld = job.src.N;
    } else {
      job.src.read(r0, rows, c0, cols, s.block.data());
    }
    // Column chunks small enough for the block's rows to stay in L1 between the two passes.
    for (int64_t cc = 0; cc < cols; cc += kChunk) {
      const int64_t w = std::min(kChunk, cols - cc);
      bq.run(block + cc, ld, rows, w, err, job.importance ? job.importance + r0 : nullptr);
      store_block(job, bq, kb, rows, w, cc, c0, s);
    }
    // Whole rows, though the tile read some of their columns: consecutive blocks' releases
    // then cover the weight without gaps, whatever the faults mapped around the bytes read
    // (weight_source.h); a tile reading the other columns faults its pages in again.
    if (!job.src.transposed) job.src.release(r0, rows, 0, job.src.N, kb + 1 < kb_count);
  }
  if (job.src.transposed) job.src.release(c0, cols, 0, K);
  write_nbits_tile(job, c0, cols, err, out, s);
}

// The tile's columns [c0, c0 + cols), all of K, as floats into dst [K, cols].
void read_tile(const WeightJob& job, int64_t c0, int64_t cols, float* dst, Scratch& s) {
  const int64_t K = job.src.K, N = job.src.N;
  const float* in_place = job.src.in_place();
  if (job.src.transposed) {
    const float* columns = in_place ? in_place + c0 * K : nullptr;
    if (!columns) {
      s.columns.resize(static_cast<size_t>(cols * K));
      job.src.read_columns(c0, cols, s.columns.data());
      columns = s.columns.data();
    }
    for (int64_t c = 0; c < cols; ++c) {
      for (int64_t r = 0; r < K; ++r) dst[r * cols + c] = columns[c * K + r];
    }
    job.src.release(c0, cols, 0, K);
    return;
  }
  if (in_place) {
    for (int64_t r = 0; r < K; ++r) {
      std::memcpy(dst + r * cols, in_place + r * N + c0, static_cast<size_t>(cols) * 4);
    }
  } else {
    job.src.read(0, K, c0, cols, dst);
  }
  job.src.release(0, K, 0, N);
}

// MatMulNBits tile rounded by GPTQ (quant/gptq.h): the tile's columns read whole along K into
// staging (K x cols floats, and the originals beside them for the error sums).
void gptq_tile(WeightJob& job, int64_t c0, int64_t c1, TempFile& out, Scratch& s) {
  const int64_t K = job.src.K, cols = c1 - c0;
  start_nbits_tile(job, cols, s);
  const size_t n = static_cast<size_t>(K * cols);
  s.work.resize(2 * n);
  float* w = s.work.data();
  float* original = w + n;
  read_tile(job, c0, cols, original, s);
  std::memcpy(w, original, n * 4);
  BlockQuantizer bq(job.spec);
  ErrorSums err;
  const float* imp = job.importance;
  auto emit = [&](int64_t kb, int64_t rows) {
    const BlockQuantizer& b = job.gptq_order ? s.block_quantizers[static_cast<size_t>(kb)] : bq;
    const int64_t r0 = kb * job.spec.block_size;
    b.add_error(original + r0 * cols, cols, rows, err, imp ? imp + r0 : nullptr);
    store_block(job, b, kb, rows, cols, 0, c0, s);
  };
  if (job.gptq_order) {
    gptq_columns_act_order(w, K, cols, job.gptq_factor, job.gptq_order, job.spec, imp,
                           s.block_quantizers, s.errors, emit);
  } else {
    gptq_columns(w, K, cols, job.gptq_factor, job.spec, imp, bq, s.errors, emit);
  }
  write_nbits_tile(job, c0, cols, err, out, s);
}

// QDQ tile: rows [r0, r1) (whole blocks), all of N, in column chunks.
void qdq_tile(WeightJob& job, int64_t r0, int64_t r1, TempFile& out, Scratch& s) {
  const BlockwiseSpec& spec = job.spec;
  const int64_t N = job.src.N, bs = spec.block_size;
  const int sb = spec.scale_bytes();
  const int64_t elems = (r1 - r0) * N;
  s.data.assign(static_cast<size_t>(spec.bits == 8 ? elems : (elems + 1) / 2), 0);
  const int64_t kb0 = r0 / bs, kb1 = (r1 + bs - 1) / bs;
  s.scales.resize(static_cast<size_t>((kb1 - kb0) * N * sb));
  const int64_t chunk =
      std::max<int64_t>(16, std::min<int64_t>(N, static_cast<int64_t>(kTileBytes / 4) / bs));
  s.block.resize(static_cast<size_t>(bs * chunk));
  // Signed types store q - mid: flipping the top bit does it for 4 and 8 bits.
  const uint8_t flip = spec.symmetric ? static_cast<uint8_t>(spec.mid_code()) : 0;
  BlockQuantizer bq(spec);
  ErrorSums err;
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    const int64_t br = kb * bs, rows = std::min(bs, r1 - br);
    for (int64_t c0 = 0; c0 < N; c0 += chunk) {
      const int64_t cols = std::min(chunk, N - c0);
      const float* in_place = job.src.in_place();
      const float* imp = job.importance ? job.importance + br : nullptr;
      if (in_place) {
        bq.run(in_place + br * N + c0, N, rows, cols, err, imp);
      } else {
        job.src.read(br, rows, c0, cols, s.block.data());
        bq.run(s.block.data(), cols, rows, cols, err, imp);
      }
      const uint8_t* q = bq.codes();
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t e0 = (br - r0 + r) * N + c0;
        for (int64_t c = 0; c < cols; ++c) {
          const uint8_t v = static_cast<uint8_t>(q[r * cols + c] ^ flip);
          const int64_t e = e0 + c;
          if (spec.bits == 8) {
            s.data[static_cast<size_t>(e)] = v;
          } else {
            s.data[static_cast<size_t>(e / 2)] |= static_cast<uint8_t>(v << ((e & 1) * 4));
          }
        }
      }
      for (int64_t c = 0; c < cols; ++c) {
        bq.store_scale(c, s.scales.data() + ((kb - kb0) * N + c0 + c) * sb);
        if (!spec.symmetric)
          job.qdq_zero_points[static_cast<size_t>(kb * N + c0 + c)] = bq.zero_point(c);
      }
    }
    job.src.release(br, rows, 0, N, kb + 1 < kb1);
  }
  const uint64_t data_start = static_cast<uint64_t>(r0 * N) * static_cast<uint64_t>(spec.bits) / 8;
  out.write(job.data_offset + data_start, s.data.data(), s.data.size());
  out.write(job.scale_offset + static_cast<uint64_t>(kb0 * N * sb), s.scales.data(),
            s.scales.size());
  std::lock_guard<std::mutex> lock(*job.mu);
  job.error.merge(err);
}

}  // namespace

uint64_t WeightJob::data_bytes() const {
  if (layout == Layout::kNBits) return static_cast<uint64_t>(src.N * k_blocks() * blob());
  if (layout == Layout::kQdqRows) return static_cast<uint64_t>(src.N * src.K * spec.bits / 8);
  const uint64_t e = static_cast<uint64_t>(src.K * src.N);
  return spec.bits == 8 ? e : (e + 1) / 2;
}

uint64_t WeightJob::scale_bytes() const {
  return static_cast<uint64_t>(src.N * k_blocks() * spec.scale_bytes());
}

uint64_t WeightJob::zp_bytes() const {
  if (spec.symmetric) return 0;
  if (layout == Layout::kNBits) {
    return static_cast<uint64_t>(src.N * ((k_blocks() * spec.bits + 7) / 8));
  }
  const uint64_t e = static_cast<uint64_t>(src.N * k_blocks());
  return spec.bits == 8 ? e : (e + 1) / 2;
}

void run_jobs(std::vector<WeightJob>& jobs, TempFile& out, int threads,
              const JobProgress& progress) {
  std::vector<Tile> tiles;
  int64_t total = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    WeightJob& job = jobs[j];
    job.src.check_readable();
    job.data_offset = out.reserve(job.data_bytes(), job.data_framing);
    job.scale_offset = out.reserve(job.scale_bytes(), job.scale_framing);
    if (job.zp_bytes() > 0) job.zp_offset = out.reserve(job.zp_bytes(), job.zp_framing);
    const int64_t K = job.src.K, N = job.src.N, bs = job.spec.block_size;
    const uint64_t es = job.src.dtype == 1 ? 4 : 2;
    if (job.layout == Layout::kQdqRows && !job.spec.symmetric)
      job.qdq_zero_points.assign(static_cast<size_t>(N * job.k_blocks()), 0);
    if (job.layout != Layout::kQdq) {
      const uint64_t per_col = job.data_bytes() / static_cast<uint64_t>(N) +
                               job.scale_bytes() / static_cast<uint64_t>(N) +
                               job.zp_bytes() / static_cast<uint64_t>(N) + 1;
      int64_t width = static_cast<int64_t>(kTileOutputBytes / per_col);
      // Staged (converted) blocks are bounded too; float32 read in place needs no staging, and
      // wide tiles keep each row's part of a wide weight (an lm_head) many pages long.
      if (!job.src.in_place())
        width = std::min<int64_t>(width, static_cast<int64_t>(kTileBytes / 4) / bs);
      // A transposed tile, and GPTQ's, stages its columns whole.
      if (job.src.transposed || job.gptq_factor)
        width = std::min<int64_t>(width, static_cast<int64_t>(kTileBytes / 4) / K);
      width = std::max<int64_t>(16, std::min(width, N));
      for (int64_t c = 0; c < N; c += width) {
        const int64_t e = std::min(N, c + width);
        tiles.push_back({j, c, e, static_cast<uint64_t>(K * (e - c)) * es});
      }
    } else {
      if (!job.spec.symmetric)
        job.qdq_zero_points.assign(static_cast<size_t>(N * job.k_blocks()), 0);
      const uint64_t per_block =
          static_cast<uint64_t>(bs * N) * static_cast<uint64_t>(job.spec.bits) / 8 + 1;
      const int64_t blocks = std::max<int64_t>(1, static_cast<int64_t>(kTileBytes / per_block));
      for (int64_t r = 0; r < K; r += blocks * bs) {
        const int64_t e = std::min(K, r + blocks * bs);
        tiles.push_back({j, r, e, static_cast<uint64_t>((e - r) * N) * es});
      }
    }
    total += static_cast<int64_t>(static_cast<uint64_t>(K * N) * es);
  }
  // Largest tiles first: the threads finish together.
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.work > b.work; });

  std::vector<uint64_t> work;
  for (const Tile& t : tiles) work.push_back(t.work);
  std::vector<Scratch> scratch(static_cast<size_t>(worker_count(threads, tiles.size())));
  parallel_tasks(
      tiles.size(), work, threads,
      [&](size_t i, int w) {
        const Tile& t = tiles[i];
        WeightJob& job = jobs[t.job];
        Scratch& s = scratch[static_cast<size_t>(w)];
        if (job.gptq_factor) {
          gptq_tile(job, t.begin, t.end, out, s);
        } else if (job.layout != Layout::kQdq) {
          nbits_tile(job, t.begin, t.end, out, s);
        } else {
          qdq_tile(job, t.begin, t.end, out, s);
        }
      },
      progress, [&](size_t i) { return jobs[tiles[i].job].name; });

  // QDQ zero points: packed once all tiles are done (4-bit neighbours share bytes).
  for (WeightJob& job : jobs) {
    if (job.layout == Layout::kNBits || job.spec.symmetric) continue;
    std::vector<uint8_t> packed(static_cast<size_t>(job.zp_bytes()), 0);
    for (size_t e = 0; e < job.qdq_zero_points.size(); ++e) {
      if (job.spec.bits == 8) {
        packed[e] = job.qdq_zero_points[e];
      } else {
        packed[e / 2] |= static_cast<uint8_t>(job.qdq_zero_points[e] << ((e & 1) * 4));
      }
    }
    out.write(job.zp_offset, packed.data(), packed.size());
    std::vector<uint8_t>().swap(job.qdq_zero_points);
  }
  if (progress) progress(total, total, "");
}

}  // namespace fastopt::quant
