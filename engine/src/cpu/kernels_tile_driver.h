#pragma once
// The tile drivers the AVX2 and AVX-512 kernel files share, templated on an ISA traits struct:
// the dtype dispatch, the row panels that keep about 256 KiB of weights in L2 while every
// token tile streams over them, the token tiles of the transposed product, the FMA ceiling
// probe and the kernel table. The ISA files supply the register tiles and vector operations.
//
// Included only by kernels_avx2.cpp and kernels_avx512.cpp. Everything here sits in an unnamed
// namespace and is a template instantiated with that file's traits, so each file compiles its
// own copy with its own ISA flags and nothing is shared at link time (see kernels_isa.h).
//
// An ISA traits struct `Isa` provides:
//   kIsa, kLanes (floats per vector), Vec and set1/fmadd/add/store on it;
//   kRowsOneToken / kRowsManyTokens: the rows of a matmul tile for one token and for 2-4 tokens;
//   matmulTile<D, R, T>(w, row, x, x_stride, y, y_stride): R rows x T tokens of y;
//   transposedTile<D, T>(w, row_begin, row_end, x, x_stride, y, y_stride): T tokens of y += x W;
//   matmulSpecial<D>(w, row_begin, row_end, x, x_stride, n_tokens, y, y_stride) -> bool: a
//     faster path for this call (true: done), else the row panels run;
//   dot(a, b, n) and axpy(a, x, y, n).

#include <cstdint>

#include "kernels_isa.h"

namespace pd::model::detail {
namespace {  // NOLINT(cert-dcl59-cpp,google-build-namespaces): one private copy per ISA file, by design

using i64 = std::int64_t;

template <DType D>
constexpr i64 kElemBytes = D == DType::F32 ? 4 : (D == DType::F8E4M3 ? 1 : 2);

inline i64 minI(i64 a, i64 b) {
  return a < b ? a : b;
}

// Multiplier that turns a loaded FP8 vector (2^-8 scaled, see the ISA files' fp8ToHalfScaled)
// into the dequantized weight.
inline float fp8Scale(const WeightMatrix& w, i64 row, i64 col_block, i64 scale_cols) {
  return 256.0F * w.scale_inv[(row / w.block_rows) * scale_cols + col_block];
}

// rp[r] = the first byte of row `row + r` of `w`, for the R rows of a tile.
template <DType D, int R>
inline void rowPointers(const WeightMatrix& w, i64 row, const std::uint8_t* (&rp)[R]) {
  const auto* base = static_cast<const std::uint8_t*>(w.data);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) rp[r] = base + (row + r) * w.cols * kElemBytes<D>;
}

template <class Isa, DType D, int R>
void matmulTileAnyT(i64 tokens, const WeightMatrix& w, i64 row, const float* x, i64 xs, float* y, i64 ys) {
  switch (tokens) {
    case 1:
      Isa::template matmulTile<D, R, 1>(w, row, x, xs, y, ys);
      break;
    case 2:
      Isa::template matmulTile<D, R, 2>(w, row, x, xs, y, ys);
      break;
    case 3:
      Isa::template matmulTile<D, R, 3>(w, row, x, xs, y, ys);
      break;
    default:
      Isa::template matmulTile<D, R, 4>(w, row, x, xs, y, ys);
      break;
  }
}

// kInvariant: no path of its own for one token (the ISA's one-token GEMV sums in another order),
// so that every output is computed the same way whatever n_tokens is (KernelTable's
// matmul_batch_invariant). The other special paths and the tiles sum each output alike.
template <class Isa, DType D, bool kInvariant>
void matmulTyped(const WeightMatrix& w, i64 row_begin, i64 row_end, const float* x, i64 x_stride, i64 n_tokens,
                 float* y, i64 y_stride) {
  if ((!kInvariant || n_tokens > 1) &&
      Isa::template matmulSpecial<D>(w, row_begin, row_end, x, x_stride, n_tokens, y, y_stride)) {
    return;
  }
  // Rows in panels of about 256 KiB of weights, so that a panel stays in L2 while every token
  // tile streams over it (prefill); a decode step (one token) is a single pass.
  const i64 row_bytes = w.cols * kElemBytes<D>;
  i64 panel = (i64{256} * 1024) / (row_bytes > 0 ? row_bytes : 1);
  panel = panel < 4 ? 4 : (panel / 4) * 4;
  constexpr int kOne = Isa::kRowsOneToken;
  constexpr int kMany = Isa::kRowsManyTokens;
  for (i64 p0 = row_begin; p0 < row_end; p0 += panel) {
    const i64 p1 = minI(row_end, p0 + panel);
    for (i64 t0 = 0; t0 < n_tokens; t0 += 4) {
      const i64 tn = minI(4, n_tokens - t0);
      const float* xt = x + t0 * x_stride;
      float* yt = y + t0 * y_stride;
      i64 r = p0;
      if (tn == 1) {
        for (; r + kOne <= p1; r += kOne)
          Isa::template matmulTile<D, kOne, 1>(w, r, xt, x_stride, yt + (r - row_begin), y_stride);
      } else {
        for (; r + kMany <= p1; r += kMany)
          matmulTileAnyT<Isa, D, kMany>(tn, w, r, xt, x_stride, yt + (r - row_begin), y_stride);
      }
      for (; r < p1; ++r) matmulTileAnyT<Isa, D, 1>(tn, w, r, xt, x_stride, yt + (r - row_begin), y_stride);
    }
  }
}

template <class Isa, bool kInvariant = false>
void matmul(const WeightMatrix& w, i64 row_begin, i64 row_end, const float* x, i64 x_stride, i64 n_tokens, float* y,
            i64 y_stride) {
  switch (w.dtype) {
    case DType::F32:
      matmulTyped<Isa, DType::F32, kInvariant>(w, row_begin, row_end, x, x_stride, n_tokens, y, y_stride);
      return;
    case DType::BF16:
      matmulTyped<Isa, DType::BF16, kInvariant>(w, row_begin, row_end, x, x_stride, n_tokens, y, y_stride);
      return;
    case DType::F16:
      matmulTyped<Isa, DType::F16, kInvariant>(w, row_begin, row_end, x, x_stride, n_tokens, y, y_stride);
      return;
    case DType::F8E4M3:
      matmulTyped<Isa, DType::F8E4M3, kInvariant>(w, row_begin, row_end, x, x_stride, n_tokens, y, y_stride);
      return;
    default:
      genericKernels().matmul(w, row_begin, row_end, x, x_stride, n_tokens, y, y_stride);
      return;
  }
}

template <class Isa, DType D>
void transposedTyped(const WeightMatrix& w, i64 row_begin, i64 row_end, const float* x, i64 x_stride, i64 n_tokens,
                     float* y, i64 y_stride) {
  for (i64 t0 = 0; t0 < n_tokens; t0 += 4) {
    const i64 tn = minI(4, n_tokens - t0);
    const float* xt = x + t0 * x_stride;
    float* yt = y + t0 * y_stride;
    switch (tn) {
      case 1:
        Isa::template transposedTile<D, 1>(w, row_begin, row_end, xt, x_stride, yt, y_stride);
        break;
      case 2:
        Isa::template transposedTile<D, 2>(w, row_begin, row_end, xt, x_stride, yt, y_stride);
        break;
      case 3:
        Isa::template transposedTile<D, 3>(w, row_begin, row_end, xt, x_stride, yt, y_stride);
        break;
      default:
        Isa::template transposedTile<D, 4>(w, row_begin, row_end, xt, x_stride, yt, y_stride);
        break;
    }
  }
}

template <class Isa>
void matmulTransposed(const WeightMatrix& w, i64 row_begin, i64 row_end, const float* x, i64 x_stride, i64 n_tokens,
                      float* y, i64 y_stride) {
  switch (w.dtype) {
    case DType::F32:
      transposedTyped<Isa, DType::F32>(w, row_begin, row_end, x, x_stride, n_tokens, y, y_stride);
      return;
    case DType::BF16:
      transposedTyped<Isa, DType::BF16>(w, row_begin, row_end, x, x_stride, n_tokens, y, y_stride);
      return;
    case DType::F16:
      transposedTyped<Isa, DType::F16>(w, row_begin, row_end, x, x_stride, n_tokens, y, y_stride);
      return;
    case DType::F8E4M3:
      // A vector of columns must not straddle two scale blocks.
      if (w.block_cols % Isa::kLanes == 0) {
        transposedTyped<Isa, DType::F8E4M3>(w, row_begin, row_end, x, x_stride, n_tokens, y, y_stride);
        return;
      }
      break;
    default:
      break;
  }
  genericKernels().matmulTransposed(w, row_begin, row_end, x, x_stride, n_tokens, y, y_stride);
}

// 12 independent FMA chains: enough to cover FMA latency x throughput on current cores.
constexpr int kFmaChains = 12;

template <class Isa>
float fmaLoop(i64 iterations) {
  using Vec = typename Isa::Vec;
  Vec acc[kFmaChains];
#pragma GCC unroll 16
  for (int j = 0; j < kFmaChains; ++j) acc[j] = Isa::set1(1.0F + 0.01F * static_cast<float>(j));
  const Vec m = Isa::set1(0.999999F);
  const Vec a = Isa::set1(1e-7F);
  for (i64 i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kFmaChains; ++j) acc[j] = Isa::fmadd(acc[j], m, a);
  }
  Vec s = acc[0];
#pragma GCC unroll 16
  for (int j = 1; j < kFmaChains; ++j) s = Isa::add(s, acc[j]);
  float out[Isa::kLanes];
  Isa::store(out, s);
  return out[0];
}

template <class Isa>
const KernelTable& kernelTableOf() {
  static const KernelTable table{Isa::kIsa, matmul<Isa>,  matmulTransposed<Isa>,        Isa::dot,
                                 Isa::axpy, fmaLoop<Isa>, kFmaChains * Isa::kLanes * 2, matmul<Isa, true>};
  return table;
}

}  // namespace
}  // namespace pd::model::detail
