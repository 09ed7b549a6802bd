// Kernel dispatch, dequantization and the portable (generic) kernel set.
#include "pd/engine/kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels_isa.h"
#include "pd/common/check.h"

namespace pd::model {

std::uint64_t WeightMatrix::bytes() const {
  std::uint64_t total = static_cast<std::uint64_t>(rows) * static_cast<std::uint64_t>(cols) * dtypeSize(dtype);
  if (dtype == DType::F8E4M3) total += static_cast<std::uint64_t>(scaleRows() * scaleCols()) * sizeof(float);
  return total;
}

void dequantizeRow(const WeightMatrix& w, std::int64_t row, float* out) {
  const auto* base = static_cast<const std::uint8_t*>(w.data);
  const std::int64_t cols = w.cols;
  switch (w.dtype) {
    case DType::F32:
      std::memcpy(out, base + static_cast<std::size_t>(row * cols) * sizeof(float),
                  static_cast<std::size_t>(cols) * sizeof(float));
      return;
    case DType::BF16: {
      const auto* p = reinterpret_cast<const std::uint16_t*>(base) + row * cols;
      for (std::int64_t c = 0; c < cols; ++c) out[c] = bf16ToFloat(p[c]);
      return;
    }
    case DType::F16: {
      const auto* p = reinterpret_cast<const std::uint16_t*>(base) + row * cols;
      for (std::int64_t c = 0; c < cols; ++c) out[c] = f16ToFloat(p[c]);
      return;
    }
    case DType::F8E4M3: {
      const float* table = fp8e4m3Table();
      const std::uint8_t* p = base + row * cols;
      const float* scales = w.scale_inv + (row / w.block_rows) * w.scaleCols();
      for (std::int64_t c = 0; c < cols; ++c) out[c] = table[p[c]] * scales[c / w.block_cols];
      return;
    }
    default:
      PD_CHECK_MSG(false, "dequantizeRow: unsupported weight dtype");
  }
}

std::string_view cpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Generic:
      return "generic";
    case CpuIsa::Avx2:
      return "avx2";
    case CpuIsa::Avx512:
      return "avx512";
  }
  return "?";
}

#if defined(__x86_64__) || defined(__i386__)
namespace {
// CPUID leaf 1, ECX bit 29. Read directly because clang's __builtin_cpu_supports does not know
// "f16c"; the AVX2 check next to it already covers the OS's saving of the AVX state.
bool cpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
}  // namespace
#endif

bool cpuSupports(CpuIsa isa) {
#if defined(__x86_64__) || defined(__i386__)
  switch (isa) {
    case CpuIsa::Generic:
      return true;
    case CpuIsa::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpuHasF16c();
    case CpuIsa::Avx512:
      return cpuSupports(CpuIsa::Avx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  return false;
#else
  return isa == CpuIsa::Generic;
#endif
}

CpuIsa detectCpuIsa() {
  if (cpuSupports(CpuIsa::Avx512)) return CpuIsa::Avx512;
  if (cpuSupports(CpuIsa::Avx2)) return CpuIsa::Avx2;
  return CpuIsa::Generic;
}

const KernelTable& kernelTable(CpuIsa isa) {
  PD_CHECK_MSG(cpuSupports(isa), "kernelTable: this CPU does not support the requested instruction set");
  switch (isa) {
    case CpuIsa::Avx512:
      return detail::avx512Kernels();
    case CpuIsa::Avx2:
      return detail::avx2Kernels();
    case CpuIsa::Generic:
      break;
  }
  return detail::genericKernels();
}

namespace detail {
namespace {

// Portable kernels: dequantize a row, then plain float32 dot products. Correct everywhere,
// used when no vector ISA is available and as the reference the ISA kernels are tested against.
void genericMatmul(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end, const float* x,
                   std::int64_t x_stride, std::int64_t n_tokens, float* y, std::int64_t y_stride) {
  std::vector<float> row(static_cast<std::size_t>(w.cols));
  for (std::int64_t r = row_begin; r < row_end; ++r) {
    dequantizeRow(w, r, row.data());
    for (std::int64_t t = 0; t < n_tokens; ++t) {
      const float* xt = x + t * x_stride;
      float s0 = 0.0F, s1 = 0.0F, s2 = 0.0F, s3 = 0.0F;
      std::int64_t c = 0;
      for (; c + 4 <= w.cols; c += 4) {
        s0 += row[static_cast<std::size_t>(c)] * xt[c];
        s1 += row[static_cast<std::size_t>(c + 1)] * xt[c + 1];
        s2 += row[static_cast<std::size_t>(c + 2)] * xt[c + 2];
        s3 += row[static_cast<std::size_t>(c + 3)] * xt[c + 3];
      }
      for (; c < w.cols; ++c) s0 += row[static_cast<std::size_t>(c)] * xt[c];
      y[t * y_stride + (r - row_begin)] = (s0 + s1) + (s2 + s3);
    }
  }
}

void genericMatmulTransposed(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end, const float* x,
                             std::int64_t x_stride, std::int64_t n_tokens, float* y, std::int64_t y_stride) {
  std::vector<float> row(static_cast<std::size_t>(w.cols));
  for (std::int64_t r = row_begin; r < row_end; ++r) {
    dequantizeRow(w, r, row.data());
    for (std::int64_t t = 0; t < n_tokens; ++t) {
      const float a = x[t * x_stride + (r - row_begin)];
      float* yt = y + t * y_stride;
      for (std::int64_t c = 0; c < w.cols; ++c) yt[c] += a * row[static_cast<std::size_t>(c)];
    }
  }
}

float genericDot(const float* a, const float* b, std::int64_t n) {
  float s0 = 0.0F, s1 = 0.0F, s2 = 0.0F, s3 = 0.0F;
  std::int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

void genericAxpy(float a, const float* x, float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

float genericFmaLoop(std::int64_t iterations) {
  float a[8] = {1.0F, 1.1F, 1.2F, 1.3F, 1.4F, 1.5F, 1.6F, 1.7F};
  for (std::int64_t i = 0; i < iterations; ++i) {
    for (float& v : a) v = v * 0.999999F + 1e-7F;
  }
  return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

}  // namespace

const KernelTable& genericKernels() {
  // The portable matmul computes every output alike whatever the token count: it is its own
  // batch-invariant variant.
  static const KernelTable table{
      CpuIsa::Generic, genericMatmul, genericMatmulTransposed, genericDot, genericAxpy, genericFmaLoop, 16,
      genericMatmul};
  return table;
}

}  // namespace detail
}  // namespace pd::model
