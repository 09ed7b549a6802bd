#pragma once
/// CPU kernels of the model engine: matrix products on weights kept in their checkpoint dtype
/// (F32, BF16, F16, or FP8 e4m3 with block scales), dequantized in registers to float32 and
/// accumulated in float32; float32 activations throughout.
///
/// One build runs on any x86-64 machine: each instruction set has its own kernel table,
/// compiled with its own flags, and the table is chosen at run time (detectCpuIsa()).
/// Thread rules: kernels are pure functions of their arguments; call them from any thread.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "pd/common/dtype.h"

namespace pd::model {

/// A row-major [rows, cols] weight matrix referenced in place (usually in the mmap'd
/// checkpoint). Linear layers compute y = W x, i.e. `x @ W^T` with W [out_features, in_features].
struct WeightMatrix {
  DType dtype = DType::F32;  ///< F32, BF16, F16 or F8E4M3
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  const void* data = nullptr;  ///< rows * cols elements
  /// F8E4M3 only: float32 multipliers [ceil(rows / block_rows), ceil(cols / block_cols)];
  /// W[i][j] = e4m3(q[i][j]) * scale_inv[i / block_rows][j / block_cols].
  const float* scale_inv = nullptr;
  std::int64_t block_rows = 128;
  std::int64_t block_cols = 128;

  [[nodiscard]] std::int64_t scaleCols() const { return (cols + block_cols - 1) / block_cols; }
  [[nodiscard]] std::int64_t scaleRows() const { return (rows + block_rows - 1) / block_rows; }
  /// Bytes a full pass over the matrix reads (data plus scales).
  [[nodiscard]] std::uint64_t bytes() const;
};

/// Writes row `row` of `w` as float32 into out[0, cols): exactly float32(q) * scale for FP8
/// (one rounding), exact for BF16/F16/F32.
void dequantizeRow(const WeightMatrix& w, std::int64_t row, float* out);

enum class CpuIsa { Generic, Avx2, Avx512 };

[[nodiscard]] std::string_view cpuIsaName(CpuIsa isa);
/// The best kernel set this CPU runs (AVX-512 F/BW/VL/DQ, else AVX2+FMA+F16C, else generic).
[[nodiscard]] CpuIsa detectCpuIsa();
/// Whether this CPU can run kernels of `isa`.
[[nodiscard]] bool cpuSupports(CpuIsa isa);

/// One instruction set's kernels. All pointers are non-null.
struct KernelTable {
  CpuIsa isa = CpuIsa::Generic;
  /// y[t * y_stride + (r - row_begin)] = sum_c W[r][c] * x[t * x_stride + c]
  /// for t in [0, n_tokens), r in [row_begin, row_end). Weights are read once per 4 tokens.
  void (*matmul)(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end, const float* x,
                 std::int64_t x_stride, std::int64_t n_tokens, float* y, std::int64_t y_stride) = nullptr;
  /// y[t * y_stride + c] += sum_{r in [row_begin, row_end)} x[t * x_stride + (r - row_begin)] * W[r][c]
  /// for every column c: products with the transpose of a row range (absorbed attention).
  void (*matmulTransposed)(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end, const float* x,
                           std::int64_t x_stride, std::int64_t n_tokens, float* y, std::int64_t y_stride) = nullptr;
  float (*dot)(const float* a, const float* b, std::int64_t n) = nullptr;
  /// y[i] += a * x[i]
  void (*axpy)(float a, const float* x, float* y, std::int64_t n) = nullptr;
  /// Runs `iterations` rounds of independent register FMAs (the FLOP ceiling probe of `pdserve
  /// bench engine`); returns a value that depends on all of them. Flops = iterations x
  /// fma_loop_flops_per_iteration.
  float (*fmaLoop)(std::int64_t iterations) = nullptr;
  std::int64_t fma_loop_flops_per_iteration = 0;
  /// `matmul` computing every output element the same way whatever `n_tokens` is (and whatever
  /// rows or tokens share its call), so a token's result does not depend on its batch; slower
  /// for one token. The batch-invariant engine mode (CpuEngineOptions::batch_invariant) uses it.
  void (*matmul_batch_invariant)(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end, const float* x,
                                 std::int64_t x_stride, std::int64_t n_tokens, float* y,
                                 std::int64_t y_stride) = nullptr;
};

/// The kernel table of `isa`; PD_CHECKs that this CPU supports it.
[[nodiscard]] const KernelTable& kernelTable(CpuIsa isa);

}  // namespace pd::model
