#include "quant/pack.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace fastopt::quant {
namespace {

// dst + c * stride + r = src[r * w + c] for r < rows, c < w.
void transpose_scalar(const uint8_t* src, int64_t rows, int64_t w, int64_t c0, uint8_t* dst,
                      int64_t stride) {
  for (int64_t c = c0; c < w; ++c) {
    uint8_t* to = dst + c * stride;
    for (int64_t r = 0; r < rows; ++r) to[r] = src[r * w + c];
  }
}

#if defined(__SSE2__)
// 16 rows x 16 columns: four rounds of interleaving row i with row i + 8 transpose the tile.
void transpose16(const uint8_t* src, int64_t ld, uint8_t* dst, int64_t stride) {
  __m128i r[16], t[16];
  for (int i = 0; i < 16; ++i)
    r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ld));
  for (int round = 0; round < 4; ++round) {
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm_unpacklo_epi8(r[i], r[i + 8]);
      t[2 * i + 1] = _mm_unpackhi_epi8(r[i], r[i + 8]);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
  }
  for (int i = 0; i < 16; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i * stride), r[i]);
}
#endif

void transpose(const uint8_t* src, int64_t rows, int64_t w, uint8_t* dst, int64_t stride) {
  int64_t c0 = 0;
#if defined(__SSE2__)
  if (rows % 16 == 0) {
    for (; c0 + 16 <= w; c0 += 16) {
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        transpose16(src + r0 * w + c0, w, dst + c0 * stride + r0, stride);
      }
    }
  }
#endif
  transpose_scalar(src, rows, w, c0, dst, stride);
}

}  // namespace

void pack_columns(const uint8_t* q, int64_t rows, int64_t w, int bits, uint8_t* dst, int64_t stride,
                  std::vector<uint8_t>& tmp) {
  if (bits == 8) return transpose(q, rows, w, dst, stride);
  // Row pairs into bytes first (across columns: vectorizes), then one byte transpose.
  const int64_t pairs = rows / 2;
  tmp.resize(static_cast<size_t>(pairs * w));
  for (int64_t i = 0; i < pairs; ++i) {
    const uint8_t* lo = q + 2 * i * w;
    const uint8_t* hi = lo + w;
    uint8_t* to = tmp.data() + i * w;
    for (int64_t c = 0; c < w; ++c) to[c] = static_cast<uint8_t>(lo[c] | (hi[c] << 4));
  }
  transpose(tmp.data(), pairs, w, dst, stride);
}

}  // namespace fastopt::quant
