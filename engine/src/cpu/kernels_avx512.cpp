// AVX-512 (F, BW, VL, DQ) kernels; this file alone is compiled with -mavx512*. Only intrinsics,
// helpers local to this file and the shared tile driver instantiated with this file's traits
// (see kernels_isa.h for why).
// GCC 12's masked-load and reduce intrinsics start from _mm512_undefined_*(), which trips
// -Wuninitialized inside its own header once inlined here.
#pragma GCC diagnostic ignored "-Wuninitialized"
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

#include "kernels_isa.h"
#include "kernels_tile_driver.h"

namespace pd::model::detail {
namespace {

struct Avx512;

// e4m3 -> fp16 bit pattern with the same sign, exponent and mantissa bits: the fp16 value is
// exactly 2^-8 times the e4m3 value (normals and subnormals alike), so the conversion is one
// shift pair plus vcvtph2ps, and the 2^8 goes into the block scale.
inline __m512 fp8ToHalfScaled(__m128i bytes) {
  __m256i w = _mm256_cvtepu8_epi16(bytes);
  w = _mm256_slli_epi16(w, 8);
  w = _mm256_srai_epi16(w, 1);
  w = _mm256_and_si256(w, _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm512_cvtph_ps(w);
}

template <DType D>
inline __m512 load16(const std::uint8_t* p) {
  if constexpr (D == DType::F32) {
    return _mm512_loadu_ps(p);
  } else if constexpr (D == DType::BF16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (D == DType::F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    return fp8ToHalfScaled(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

template <DType D>
inline __m512 load16Masked(const std::uint8_t* p, __mmask16 m) {
  if constexpr (D == DType::F32) {
    return _mm512_maskz_loadu_ps(m, p);
  } else if constexpr (D == DType::BF16) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (D == DType::F16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  } else {
    return fp8ToHalfScaled(_mm_maskz_loadu_epi8(m, p));
  }
}

// R rows x T tokens of y: every weight vector is loaded and converted once and used T times.
template <DType D, int R, int T>
void avx512MatmulTile(const WeightMatrix& w, i64 row, const float* x, i64 x_stride, float* y, i64 y_stride) {
  constexpr i64 kB = kElemBytes<D>;
  const i64 cols = w.cols;
  const std::uint8_t* rp[R];
  rowPointers<D>(w, row, rp);
  __m512 acc[R][T];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const i64 block = D == DType::F8E4M3 ? w.block_cols : cols;
  const i64 scale_cols = D == DType::F8E4M3 ? (cols + block - 1) / block : 1;
  i64 cb = 0;
  for (i64 c0 = 0; c0 < cols; c0 += block, ++cb) {
    const i64 c1 = minI(cols, c0 + block);
    __m512 s[R];
    if constexpr (D == DType::F8E4M3) {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) s[r] = _mm512_set1_ps(fp8Scale(w, row + r, cb, scale_cols));
    }
    i64 c = c0;
    for (; c + 16 <= c1; c += 16) {
      __m512 xv[T];
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_ps(x + t * x_stride + c);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        __m512 wv = load16<D>(rp[r] + c * kB);
        if constexpr (D == DType::F8E4M3) wv = _mm512_mul_ps(wv, s[r]);
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
      }
    }
    if (c < c1) {
      const auto m = static_cast<__mmask16>((1U << (c1 - c)) - 1U);
      __m512 xv[T];
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) xv[t] = _mm512_maskz_loadu_ps(m, x + t * x_stride + c);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        __m512 wv = load16Masked<D>(rp[r] + c * kB, m);
        if constexpr (D == DType::F8E4M3) wv = _mm512_mul_ps(wv, s[r]);
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) y[t * y_stride + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// --- eight or more tokens (prefill, batched decode): dequantize once, reuse ---
//
// Four rows are dequantized into a float32 panel (exactly the values dequantizeRow gives) that
// stays in L2, then 4 x 6 register tiles run over it: a weight is converted once per call, not
// once per token tile. Below 8 tokens the conversion in the tile itself is cheaper.

constexpr i64 kPanelMaxCols = 32768;
constexpr int kPanelTokens = 6;

template <DType D>
void dequantizePanel(const WeightMatrix& w, i64 row, int rows, float* panel) {
  constexpr i64 kB = kElemBytes<D>;
  const i64 cols = w.cols;
  const auto* base = static_cast<const std::uint8_t*>(w.data);
  const i64 block = D == DType::F8E4M3 ? w.block_cols : cols;
  const i64 scale_cols = D == DType::F8E4M3 ? (cols + block - 1) / block : 1;
  for (int r = 0; r < rows; ++r) {
    const std::uint8_t* src = base + (row + r) * cols * kB;
    float* dst = panel + r * cols;
    i64 cb = 0;
    for (i64 c0 = 0; c0 < cols; c0 += block, ++cb) {
      const i64 c1 = minI(cols, c0 + block);
      __m512 s = _mm512_set1_ps(1.0F);
      if constexpr (D == DType::F8E4M3) s = _mm512_set1_ps(fp8Scale(w, row + r, cb, scale_cols));
      for (i64 c = c0; c < c1; c += 16) {
        const i64 n = minI(16, c1 - c);
        const auto m = static_cast<__mmask16>(n == 16 ? 0xFFFFU : (1U << n) - 1U);
        __m512 v = n == 16 ? load16<D>(src + c * kB) : load16Masked<D>(src + c * kB, m);
        if constexpr (D == DType::F8E4M3) v = _mm512_mul_ps(v, s);
        _mm512_mask_storeu_ps(dst + c, m, v);
      }
    }
  }
}

template <int R>
void panelTiles(const WeightMatrix& panel, const float* x, i64 x_stride, i64 n_tokens, float* y, i64 y_stride) {
  i64 t0 = 0;
  for (; t0 + kPanelTokens <= n_tokens; t0 += kPanelTokens) {
    avx512MatmulTile<DType::F32, R, kPanelTokens>(panel, 0, x + t0 * x_stride, x_stride, y + t0 * y_stride, y_stride);
  }
  const float* xt = x + t0 * x_stride;
  float* yt = y + t0 * y_stride;
  switch (n_tokens - t0) {
    case 0:
      break;
    case 5:
      avx512MatmulTile<DType::F32, R, 5>(panel, 0, xt, x_stride, yt, y_stride);
      break;
    default:
      matmulTileAnyT<Avx512, DType::F32, R>(n_tokens - t0, panel, 0, xt, x_stride, yt, y_stride);
      break;
  }
}

template <DType D>
void matmulPanels(const WeightMatrix& w, i64 row_begin, i64 row_end, const float* x, i64 x_stride, i64 n_tokens,
                  float* y, i64 y_stride) {
  alignas(64) static thread_local float panel[4 * kPanelMaxCols];
  for (i64 r = row_begin; r < row_end; r += 4) {
    const int rows = static_cast<int>(minI(4, row_end - r));
    dequantizePanel<D>(w, r, rows, panel);
    const WeightMatrix view{DType::F32, rows, w.cols, panel};
    float* yr = y + (r - row_begin);
    if (rows == 4) {
      panelTiles<4>(view, x, x_stride, n_tokens, yr, y_stride);
    } else {
      for (int i = 0; i < rows; ++i) {
        const WeightMatrix one{DType::F32, 1, w.cols, panel + i * w.cols};
        panelTiles<1>(one, x, x_stride, n_tokens, yr + i, y_stride);
      }
    }
  }
}

// --- one token (a decode step): 4 rows at a time, wide loads split into even/odd elements ---
//
// A 64-byte load holds 32 BF16 or 64 FP8 weights. Instead of widening them element by element,
// the even and odd elements are decoded in place with a shift or a mask, and x is permuted to
// match (once per column chunk, shared by the 4 rows).

// Software prefetch of the next 4-row group at the same column: hardware prefetchers stop at
// 4 KiB page boundaries, and a BF16 row of 2048 columns is exactly one page.
inline i64 prefetchAhead(i64 row_bytes) {
  return 4 * row_bytes;
}

inline __m512i evenIndex() {
  return _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
}
inline __m512i oddIndex() {
  return _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Adds the masked 16-wide tail [c, c1) of 4 rows to acc (weights already scaled by `scale`).
template <DType D>
inline void gemvTail16(const std::uint8_t* const* rp, const float* x, i64 c, i64 c1, const __m512* scale, __m512* acc) {
  constexpr i64 kB = kElemBytes<D>;
  for (; c < c1; c += 16) {
    const i64 n = minI(16, c1 - c);
    const auto m = static_cast<__mmask16>(n == 16 ? 0xFFFFU : (1U << n) - 1U);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + c);
#pragma GCC unroll 16
    for (int r = 0; r < 4; ++r) {
      __m512 wv = load16Masked<D>(rp[r] + c * kB, m);
      if (scale != nullptr) wv = _mm512_mul_ps(wv, scale[r]);
      acc[r] = _mm512_fmadd_ps(wv, xv, acc[r]);
    }
  }
}

void gemvBf16x4(const WeightMatrix& w, i64 row, const float* x, float* y) {
  const i64 cols = w.cols;
  const auto* base = static_cast<const std::uint8_t*>(w.data);
  const std::uint8_t* rp[4];
#pragma GCC unroll 16
  for (int r = 0; r < 4; ++r) rp[r] = base + (row + r) * cols * 2;
  __m512 acc_e[4], acc_o[4];
#pragma GCC unroll 16
  for (int r = 0; r < 4; ++r) acc_e[r] = acc_o[r] = _mm512_setzero_ps();
  const __m512i ie = evenIndex(), io = oddIndex();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000U));
  const i64 ahead = prefetchAhead(cols * 2);
  i64 c = 0;
  for (; c + 32 <= cols; c += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
    const __m512 xe = _mm512_permutex2var_ps(x0, ie, x1);
    const __m512 xo = _mm512_permutex2var_ps(x0, io, x1);
#pragma GCC unroll 16
    for (int r = 0; r < 4; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(rp[r] + c * 2 + ahead), _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512(rp[r] + c * 2);
      acc_e[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wv, 16)), xe, acc_e[r]);
      acc_o[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(wv, high)), xo, acc_o[r]);
    }
  }
  gemvTail16<DType::BF16>(rp, x, c, cols, nullptr, acc_e);
#pragma GCC unroll 16
  for (int r = 0; r < 4; ++r) y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc_e[r], acc_o[r]));
}

// FP8 e4m3 with block scales: each 128-column block is summed unscaled, then scaled once.
void gemvFp8x4(const WeightMatrix& w, i64 row, const float* x, float* y) {
  const i64 cols = w.cols;
  const auto* base = static_cast<const std::uint8_t*>(w.data);
  const std::uint8_t* rp[4];
#pragma GCC unroll 16
  for (int r = 0; r < 4; ++r) rp[r] = base + (row + r) * cols;
  const i64 block = w.block_cols;
  const i64 scale_cols = (cols + block - 1) / block;
  const __m512i ie = evenIndex(), io = oddIndex();
  const __m512i low_byte_mask = _mm512_set1_epi16(static_cast<short>(0xFF00));
  const __m512i clear14 = _mm512_set1_epi16(static_cast<short>(0xBFFF));
  const i64 ahead = prefetchAhead(cols);
  __m512 total[4];
#pragma GCC unroll 16
  for (int r = 0; r < 4; ++r) total[r] = _mm512_setzero_ps();
  i64 cb = 0;
  for (i64 c0 = 0; c0 < cols; c0 += block, ++cb) {
    const i64 c1 = minI(cols, c0 + block);
    __m512 acc_e[4], acc_o[4];
#pragma GCC unroll 16
    for (int r = 0; r < 4; ++r) acc_e[r] = acc_o[r] = _mm512_setzero_ps();
    i64 c = c0;
    for (; c + 64 <= c1; c += 64) {
      const __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
      const __m512 x2 = _mm512_loadu_ps(x + c + 32), x3 = _mm512_loadu_ps(x + c + 48);
      const __m512 xe_lo = _mm512_permutex2var_ps(x0, ie, x1), xo_lo = _mm512_permutex2var_ps(x0, io, x1);
      const __m512 xe_hi = _mm512_permutex2var_ps(x2, ie, x3), xo_hi = _mm512_permutex2var_ps(x2, io, x3);
#pragma GCC unroll 16
      for (int r = 0; r < 4; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(rp[r] + c + ahead), _MM_HINT_T0);
        const __m512i wv = _mm512_loadu_si512(rp[r] + c);
        // Word j holds elements 2j (low byte) and 2j+1 (high byte); see fp8ToHalfScaled.
        const __m512i ev = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(wv, 8), 1), clear14);
        const __m512i od = _mm512_and_si512(_mm512_srai_epi16(_mm512_and_si512(wv, low_byte_mask), 1), clear14);
        acc_e[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(ev)), xe_lo, acc_e[r]);
        acc_o[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(od)), xo_lo, acc_o[r]);
        acc_e[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(ev, 1)), xe_hi, acc_e[r]);
        acc_o[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(od, 1)), xo_hi, acc_o[r]);
      }
    }
    gemvTail16<DType::F8E4M3>(rp, x, c, c1, nullptr, acc_e);
#pragma GCC unroll 16
    for (int r = 0; r < 4; ++r) {
      total[r] = _mm512_fmadd_ps(_mm512_add_ps(acc_e[r], acc_o[r]),
                                 _mm512_set1_ps(fp8Scale(w, row + r, cb, scale_cols)), total[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < 4; ++r) y[r] = _mm512_reduce_add_ps(total[r]);
}

// The paths faster than the shared row panels: 4-row GEMV for one BF16 or FP8 token, and
// dequantized panels from eight tokens on. True when one of them ran.
template <DType D>
bool avx512MatmulSpecial(const WeightMatrix& w, i64 row_begin, i64 row_end, const float* x, i64 x_stride, i64 n_tokens,
                         float* y, i64 y_stride) {
  if constexpr (D == DType::BF16 || D == DType::F8E4M3) {
    if (n_tokens == 1 && (D == DType::BF16 || w.block_cols % 64 == 0)) {
      i64 r = row_begin;
      for (; r + 4 <= row_end; r += 4) {
        if constexpr (D == DType::BF16) {
          gemvBf16x4(w, r, x, y + (r - row_begin));
        } else {
          gemvFp8x4(w, r, x, y + (r - row_begin));
        }
      }
      for (; r < row_end; ++r) avx512MatmulTile<D, 1, 1>(w, r, x, x_stride, y + (r - row_begin), y_stride);
      return true;
    }
  }
  if constexpr (D != DType::F32) {
    if (n_tokens >= 8 && w.cols <= kPanelMaxCols) {
      matmulPanels<D>(w, row_begin, row_end, x, x_stride, n_tokens, y, y_stride);
      return true;
    }
  }
  return false;
}

// y[t][c..c+16) += sum_r x[t][r] * W[r][c..c+16), T tokens at a time, columns outermost so the
// accumulators stay in registers.
template <DType D, int T>
void avx512TransposedTile(const WeightMatrix& w, i64 row_begin, i64 row_end, const float* x, i64 x_stride, float* y,
                          i64 y_stride) {
  constexpr i64 kB = kElemBytes<D>;
  const i64 cols = w.cols;
  const auto* base = static_cast<const std::uint8_t*>(w.data);
  const i64 scale_cols = D == DType::F8E4M3 ? (cols + w.block_cols - 1) / w.block_cols : 1;
  for (i64 c = 0; c < cols; c += 16) {
    const i64 n = minI(16, cols - c);
    const auto m = static_cast<__mmask16>(n == 16 ? 0xFFFFU : (1U << n) - 1U);
    __m512 acc[T];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) acc[t] = _mm512_maskz_loadu_ps(m, y + t * y_stride + c);
    for (i64 r = row_begin; r < row_end; ++r) {
      __m512 wv = n == 16 ? load16<D>(base + (r * cols + c) * kB) : load16Masked<D>(base + (r * cols + c) * kB, m);
      if constexpr (D == DType::F8E4M3)
        wv = _mm512_mul_ps(wv, _mm512_set1_ps(fp8Scale(w, r, c / w.block_cols, scale_cols)));
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t)
        acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(x[t * x_stride + (r - row_begin)]), wv, acc[t]);
    }
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + t * y_stride + c, m, acc[t]);
  }
}

float avx512Dot(const float* a, const float* b, i64 n) {
  __m512 acc0 = _mm512_setzero_ps();
  __m512 acc1 = _mm512_setzero_ps();
  i64 i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i < n; i += 16) {
    const i64 k = minI(16, n - i);
    const auto m = static_cast<__mmask16>(k == 16 ? 0xFFFFU : (1U << k) - 1U);
    acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

void avx512Axpy(float a, const float* x, float* y, i64 n) {
  const __m512 av = _mm512_set1_ps(a);
  for (i64 i = 0; i < n; i += 16) {
    const i64 k = minI(16, n - i);
    const auto m = static_cast<__mmask16>(k == 16 ? 0xFFFFU : (1U << k) - 1U);
    const __m512 yv = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
    _mm512_mask_storeu_ps(y + i, m, yv);
  }
}

// The traits the shared tile driver (kernels_tile_driver.h) runs on.
struct Avx512 {
  static constexpr CpuIsa kIsa = CpuIsa::Avx512;
  static constexpr int kLanes = 16;
  // 32 zmm registers: 4 rows x up to 4 tokens.
  static constexpr int kRowsOneToken = 4;
  static constexpr int kRowsManyTokens = 4;
  using Vec = __m512;
  static Vec set1(float v) { return _mm512_set1_ps(v); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }

  template <DType D, int R, int T>
  static void matmulTile(const WeightMatrix& w, i64 row, const float* x, i64 xs, float* y, i64 ys) {
    avx512MatmulTile<D, R, T>(w, row, x, xs, y, ys);
  }
  template <DType D, int T>
  static void transposedTile(const WeightMatrix& w, i64 row_begin, i64 row_end, const float* x, i64 xs, float* y,
                             i64 ys) {
    avx512TransposedTile<D, T>(w, row_begin, row_end, x, xs, y, ys);
  }
  template <DType D>
  static bool matmulSpecial(const WeightMatrix& w, i64 row_begin, i64 row_end, const float* x, i64 xs, i64 n_tokens,
                            float* y, i64 ys) {
    return avx512MatmulSpecial<D>(w, row_begin, row_end, x, xs, n_tokens, y, ys);
  }
  static float dot(const float* a, const float* b, i64 n) { return avx512Dot(a, b, n); }
  static void axpy(float a, const float* x, float* y, i64 n) { avx512Axpy(a, x, y, n); }
};

}  // namespace

const KernelTable& avx512Kernels() {
  return kernelTableOf<Avx512>();
}

}  // namespace pd::model::detail
