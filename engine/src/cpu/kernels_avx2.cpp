// AVX2 + FMA + F16C kernels; this file alone is compiled with -mavx2 -mfma -mf16c. Only
// intrinsics, helpers local to this file and the shared tile driver instantiated with this
// file's traits (see kernels_isa.h for why).
#include <immintrin.h>

#include <cstdint>

#include "kernels_isa.h"
#include "kernels_tile_driver.h"

namespace pd::model::detail {
namespace {

// e4m3 -> fp16 bits whose value is 2^-8 times the e4m3 value (see kernels_avx512.cpp).
inline __m256 fp8ToHalfScaled(__m128i bytes8) {
  __m128i w = _mm_cvtepu8_epi16(bytes8);
  w = _mm_slli_epi16(w, 8);
  w = _mm_srai_epi16(w, 1);
  w = _mm_and_si128(w, _mm_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm256_cvtph_ps(w);
}

template <DType D>
inline __m256 load8(const std::uint8_t* p) {
  if constexpr (D == DType::F32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (D == DType::BF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (D == DType::F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    return fp8ToHalfScaled(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
}

// One element, with the same value the vector path produces (FP8: still 2^-8 scaled).
template <DType D>
inline float load1(const std::uint8_t* p) {
  if constexpr (D == DType::F32) {
    float v;
    __builtin_memcpy(&v, p, sizeof(v));
    return v;
  } else if constexpr (D == DType::BF16) {
    std::uint16_t h;
    __builtin_memcpy(&h, p, sizeof(h));
    const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
    float v;
    __builtin_memcpy(&v, &bits, sizeof(v));
    return v;
  } else if constexpr (D == DType::F16) {
    std::uint16_t h;
    __builtin_memcpy(&h, p, sizeof(h));
    return _cvtsh_ss(h);
  } else {
    const auto shifted = static_cast<std::int16_t>(static_cast<std::uint16_t>(*p) << 8);
    const auto half = static_cast<std::uint16_t>(static_cast<std::uint16_t>(shifted >> 1) & 0xBFFFU);
    return _cvtsh_ss(half);
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <DType D, int R, int T>
void avx2MatmulTile(const WeightMatrix& w, i64 row, const float* x, i64 x_stride, float* y, i64 y_stride) {
  constexpr i64 kB = kElemBytes<D>;
  const i64 cols = w.cols;
  const std::uint8_t* rp[R];
  rowPointers<D>(w, row, rp);
  __m256 acc[R][T];
  float tail[R][T];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      acc[r][t] = _mm256_setzero_ps();
      tail[r][t] = 0.0F;
    }
  }
  const i64 block = D == DType::F8E4M3 ? w.block_cols : cols;
  const i64 scale_cols = D == DType::F8E4M3 ? (cols + block - 1) / block : 1;
  i64 cb = 0;
  for (i64 c0 = 0; c0 < cols; c0 += block, ++cb) {
    const i64 c1 = minI(cols, c0 + block);
    float sf[R];
    __m256 s[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      sf[r] = D == DType::F8E4M3 ? fp8Scale(w, row + r, cb, scale_cols) : 1.0F;
      s[r] = _mm256_set1_ps(sf[r]);
    }
    i64 c = c0;
    for (; c + 8 <= c1; c += 8) {
      __m256 xv[T];
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(x + t * x_stride + c);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        // A decode step streams each row once: prefetch the next row group at the same column
        // (hardware prefetchers stop at 4 KiB page boundaries).
        if constexpr (T == 1) {
          if ((c & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(rp[r] + (R * cols + c) * kB), _MM_HINT_T0);
        }
        __m256 wv = load8<D>(rp[r] + c * kB);
        if constexpr (D == DType::F8E4M3) wv = _mm256_mul_ps(wv, s[r]);
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
      }
    }
    for (; c < c1; ++c) {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        float wv = load1<D>(rp[r] + c * kB);
        if constexpr (D == DType::F8E4M3) wv *= sf[r];
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) tail[r][t] = __builtin_fmaf(wv, x[t * x_stride + c], tail[r][t]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) y[t * y_stride + r] = hsum(acc[r][t]) + tail[r][t];
}

template <DType D, int T>
void avx2TransposedTile(const WeightMatrix& w, i64 row_begin, i64 row_end, const float* x, i64 x_stride, float* y,
                        i64 y_stride) {
  constexpr i64 kB = kElemBytes<D>;
  const i64 cols = w.cols;
  const auto* base = static_cast<const std::uint8_t*>(w.data);
  const i64 scale_cols = D == DType::F8E4M3 ? (cols + w.block_cols - 1) / w.block_cols : 1;
  i64 c = 0;
  for (; c + 8 <= cols; c += 8) {
    __m256 acc[T];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) acc[t] = _mm256_loadu_ps(y + t * y_stride + c);
    for (i64 r = row_begin; r < row_end; ++r) {
      __m256 wv = load8<D>(base + (r * cols + c) * kB);
      if constexpr (D == DType::F8E4M3)
        wv = _mm256_mul_ps(wv, _mm256_set1_ps(fp8Scale(w, r, c / w.block_cols, scale_cols)));
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t)
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(x[t * x_stride + (r - row_begin)]), wv, acc[t]);
    }
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(y + t * y_stride + c, acc[t]);
  }
  for (; c < cols; ++c) {
    for (i64 r = row_begin; r < row_end; ++r) {
      float wv = load1<D>(base + (r * cols + c) * kB);
      if constexpr (D == DType::F8E4M3) wv *= fp8Scale(w, r, c / w.block_cols, scale_cols);
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        y[t * y_stride + c] = __builtin_fmaf(x[t * x_stride + (r - row_begin)], wv, y[t * y_stride + c]);
      }
    }
  }
}

float avx2Dot(const float* a, const float* b, i64 n) {
  __m256 acc0 = _mm256_setzero_ps();
  __m256 acc1 = _mm256_setzero_ps();
  i64 i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void avx2Axpy(float a, const float* x, float* y, i64 n) {
  const __m256 av = _mm256_set1_ps(a);
  i64 i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// The traits the shared tile driver (kernels_tile_driver.h) runs on.
struct Avx2 {
  static constexpr CpuIsa kIsa = CpuIsa::Avx2;
  static constexpr int kLanes = 8;
  // 16 ymm registers: 4 rows x 1 token for a decode step, 2 rows x up to 4 tokens otherwise.
  static constexpr int kRowsOneToken = 4;
  static constexpr int kRowsManyTokens = 2;
  using Vec = __m256;
  static Vec set1(float v) { return _mm256_set1_ps(v); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }

  template <DType D, int R, int T>
  static void matmulTile(const WeightMatrix& w, i64 row, const float* x, i64 xs, float* y, i64 ys) {
    avx2MatmulTile<D, R, T>(w, row, x, xs, y, ys);
  }
  template <DType D, int T>
  static void transposedTile(const WeightMatrix& w, i64 row_begin, i64 row_end, const float* x, i64 xs, float* y,
                             i64 ys) {
    avx2TransposedTile<D, T>(w, row_begin, row_end, x, xs, y, ys);
  }
  template <DType D>
  static bool matmulSpecial(const WeightMatrix& /*w*/, i64 /*row_begin*/, i64 /*row_end*/, const float* /*x*/,
                            i64 /*xs*/, i64 /*n_tokens*/, float* /*y*/, i64 /*ys*/) {
    return false;
  }
  static float dot(const float* a, const float* b, i64 n) { return avx2Dot(a, b, n); }
  static void axpy(float a, const float* x, float* y, i64 n) { avx2Axpy(a, x, y, n); }
};

}  // namespace

const KernelTable& avx2Kernels() {
  return kernelTableOf<Avx2>();
}

}  // namespace pd::model::detail
