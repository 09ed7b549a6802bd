// Host side of the CUDA backend's operations: shape checks, workspace owners, checked launches.
#include "device_ops.h"

#include <cublas_v2.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace pd::gpu {
namespace {

constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();

Error invalid(std::string message) {
  return makeError(ErrorCode::InvalidArgument, std::move(message));
}

// `value` in [lo, hi], else InvalidArgument "<what>: <name> = <value> is outside [lo, hi]".
Status inRange(std::string_view what, std::string_view name, std::int64_t value, std::int64_t lo, std::int64_t hi) {
  if (value < lo || value > hi)
    return invalid(fmt::format("{}: {} = {} is outside [{}, {}]", what, name, value, lo, hi));
  return okStatus();
}

}  // namespace

Result<DeviceMemoryInfo> deviceMemoryInfo() {
  std::size_t free = 0;
  std::size_t total = 0;
  PD_CUDA_TRY(cudaMemGetInfo(&free, &total));
  return DeviceMemoryInfo{free, total};
}

Status rmsNormResidual(float* h, const float* delta, const float* weight, float* out, std::int64_t rows, std::int64_t d,
                       float eps, const cuda::Stream& stream) {
  PD_TRY(inRange("rmsNormResidual", "rows", rows, 0, kIntMax));
  PD_TRY(inRange("rmsNormResidual", "d", d, 1, kIntMax));
  if (!(eps > 0.0F)) return invalid("rmsNormResidual: eps must be positive");
  if (rows > 0 && (h == nullptr || weight == nullptr || out == nullptr))
    return invalid("rmsNormResidual: null pointer");
  PD_CUDA_TRY(kernels::launchRmsNormResidual(h, delta, weight, out, static_cast<int>(rows), static_cast<int>(d), d, d,
                                             eps, stream.get()));
  return okStatus();
}

Status rmsNormRows(float* x, std::int64_t x_stride, const float* weight, float* out, std::int64_t out_stride,
                   std::int64_t rows, std::int64_t d, float eps, const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "rmsNormRows";
  PD_TRY(inRange(kWhat, "rows", rows, 0, kIntMax));
  PD_TRY(inRange(kWhat, "d", d, 1, kIntMax));
  PD_TRY(inRange(kWhat, "x_stride", x_stride, d, kIntMax));
  PD_TRY(inRange(kWhat, "out_stride", out_stride, d, kIntMax));
  if (!(eps > 0.0F)) return invalid("rmsNormRows: eps must be positive");
  if (rows > 0 && (x == nullptr || weight == nullptr || out == nullptr)) return invalid("rmsNormRows: null pointer");
  PD_CUDA_TRY(kernels::launchRmsNormResidual(x, nullptr, weight, out, static_cast<int>(rows), static_cast<int>(d),
                                             x_stride, out_stride, eps, stream.get()));
  return okStatus();
}

Status ropeInterleaved(float* x, const RopeShape& s, const float* inv_freq, const std::int64_t* positions,
                       const cuda::Stream& stream) {
  PD_TRY(inRange("ropeInterleaved", "rows", s.rows, 0, kIntMax));
  PD_TRY(inRange("ropeInterleaved", "heads", s.heads, 1, kIntMax));
  PD_TRY(inRange("ropeInterleaved", "rows * heads", s.rows * s.heads, 0, kIntMax));
  PD_TRY(inRange("ropeInterleaved", "half", s.half, 1, kIntMax));
  PD_TRY(inRange("ropeInterleaved", "offset", s.offset, 0, s.head_stride - 2 * s.half));
  if (s.heads > 1 && s.head_stride * s.heads > s.row_stride) {
    return invalid("ropeInterleaved: heads * head_stride exceeds row_stride");
  }
  if (s.rows > 0 && (x == nullptr || inv_freq == nullptr || positions == nullptr)) {
    return invalid("ropeInterleaved: null pointer");
  }
  PD_CUDA_TRY(kernels::launchRopeInterleaved(x, static_cast<int>(s.rows), static_cast<int>(s.heads), s.row_stride,
                                             s.head_stride, s.offset, inv_freq, static_cast<int>(s.half), positions,
                                             stream.get()));
  return okStatus();
}

Result<MlaDecodeAttention> MlaDecodeAttention::create(const Limits& l) {
  PD_TRY(inRange("MlaDecodeAttention", "max_tokens", l.max_tokens, 1, kIntMax));
  PD_TRY(inRange("MlaDecodeAttention", "heads", l.heads, 1, 1024));
  PD_TRY(inRange("MlaDecodeAttention", "latent_dim", l.latent_dim, 1, kernels::kMlaMaxLatentDim));
  PD_TRY(inRange("MlaDecodeAttention", "max_context", l.max_context, 1, std::int64_t{1} << 23));  // splits fit grid.y
  const std::int64_t bh = l.max_tokens * l.heads;
  PD_TRY(inRange("MlaDecodeAttention", "max_tokens * heads", bh, 1, kIntMax));
  const std::int64_t splits = (l.max_context + kernels::kMlaSplitPositions - 1) / kernels::kMlaSplitPositions;
  PD_ASSIGN_OR_RETURN(auto parts,
                      cuda::DeviceBuffer<math::SoftmaxPartial>::create(static_cast<std::size_t>(bh * splits)));
  PD_ASSIGN_OR_RETURN(auto part_o,
                      cuda::DeviceBuffer<float>::create(static_cast<std::size_t>(bh * splits * l.latent_dim)));
  return MlaDecodeAttention(l, std::move(parts), std::move(part_o));
}

Status MlaDecodeAttention::run(const Batch& b, const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "MlaDecodeAttention::run";
  PD_TRY(inRange(kWhat, "tokens", b.tokens, 0, limits_.max_tokens));
  if (b.tokens == 0) return okStatus();
  PD_TRY(inRange(kWhat, "max_context_in_batch", b.max_context_in_batch, 1, limits_.max_context));
  PD_TRY(inRange(kWhat, "block_size", b.block_size, 1, kIntMax));
  PD_TRY(inRange(kWhat, "num_blocks", b.num_blocks, 1, kIntMax));
  if (b.cache_dtype != DType::F32 && b.cache_dtype != DType::BF16 && b.cache_dtype != DType::F8E4M3) {
    return invalid(fmt::format("{}: cache dtype {} (only F32, BF16 and F8_E4M3)", kWhat, dtypeName(b.cache_dtype)));
  }
  if (b.q_cat == nullptr || b.cache_layer == nullptr || b.block_tables == nullptr || b.table_begin == nullptr ||
      b.ctx_len == nullptr || b.out == nullptr) {
    return invalid(fmt::format("{}: null pointer", kWhat));
  }
  if (!(b.scale > 0.0F)) return invalid(fmt::format("{}: scale must be positive", kWhat));
  kernels::MlaDecodeArgs a;
  a.q_cat = b.q_cat;
  a.tokens = static_cast<int>(b.tokens);
  a.heads = static_cast<int>(limits_.heads);
  a.latent_dim = static_cast<int>(limits_.latent_dim);
  a.cache_layer = b.cache_layer;
  a.cache_bf16 = b.cache_dtype == DType::BF16;
  a.cache_fp8 = b.cache_dtype == DType::F8E4M3;
  a.block_size = static_cast<int>(b.block_size);
  a.num_blocks = static_cast<int>(b.num_blocks);
  a.block_tables = b.block_tables;
  a.table_begin = b.table_begin;
  a.ctx_len = b.ctx_len;
  a.scale = b.scale;
  a.splits = static_cast<int>((b.max_context_in_batch + kernels::kMlaSplitPositions - 1) / kernels::kMlaSplitPositions);
  a.parts = parts_.data();
  a.part_o = part_o_.data();
  a.out = b.out;
  PD_CUDA_TRY(kernels::launchMlaDecode(a, stream.get()));
  return okStatus();
}

Result<MlaPrefillAttention> MlaPrefillAttention::create(const Limits& l) {
  constexpr std::string_view kWhat = "MlaPrefillAttention";
  PD_TRY(inRange(kWhat, "max_rows", l.max_rows, 1, 65535));  // grid.x
  PD_TRY(inRange(kWhat, "heads", l.heads, 1, 65535));        // grid.y
  PD_TRY(inRange(kWhat, "nope", l.nope, 1, kernels::kMlaPrefillMaxHeadDim));
  PD_TRY(inRange(kWhat, "rope", l.rope, 0, kernels::kMlaPrefillMaxHeadDim - l.nope));
  PD_TRY(inRange(kWhat, "v", l.v, 1, kernels::kMlaPrefillMaxHeadDim));
  PD_TRY(inRange(kWhat, "rank", l.rank, 1, kIntMax));
  const std::int64_t kvw = l.heads * (l.nope + l.v);
  PD_TRY(inRange(kWhat, "heads * (nope + v)", kvw, 1, kIntMax / kernels::kMlaPrefillChunk));
  PD_TRY(inRange(kWhat, "max_rows * heads * v", l.max_rows * l.heads * l.v, 1, kIntMax));
  constexpr auto kChunk = static_cast<std::size_t>(kernels::kMlaPrefillChunk);
  PD_ASSIGN_OR_RETURN(auto latents,
                      cuda::DeviceBuffer<float>::create(kChunk * static_cast<std::size_t>(l.rank + l.rope)));
  PD_ASSIGN_OR_RETURN(auto kv, cuda::DeviceBuffer<float>::create(kChunk * static_cast<std::size_t>(kvw)));
  PD_ASSIGN_OR_RETURN(auto state,
                      cuda::DeviceBuffer<math::RunningSoftmax>::create(static_cast<std::size_t>(l.max_rows * l.heads)));
  PD_ASSIGN_OR_RETURN(auto acc,
                      cuda::DeviceBuffer<float>::create(static_cast<std::size_t>(l.max_rows * l.heads * l.v)));
  return MlaPrefillAttention(l, std::move(latents), std::move(kv), std::move(state), std::move(acc));
}

Status MlaPrefillAttention::run(const Batch& b, cublasHandle_t blas, const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "MlaPrefillAttention::run";
  const Limits& l = limits_;
  PD_TRY(inRange(kWhat, "rows", b.rows, 0, l.max_rows));
  if (b.rows == 0) return okStatus();
  PD_TRY(inRange(kWhat, "block_size", b.block_size, 1, kIntMax));
  PD_TRY(inRange(kWhat, "num_blocks", b.num_blocks, 1, kIntMax));
  PD_TRY(inRange(kWhat, "table_entries", b.table_entries, 1, kIntMax));
  if (b.cache_dtype != DType::F32 && b.cache_dtype != DType::BF16 && b.cache_dtype != DType::F8E4M3) {
    return invalid(fmt::format("{}: cache dtype {} (only F32, BF16 and F8_E4M3)", kWhat, dtypeName(b.cache_dtype)));
  }
  if (b.q == nullptr || b.cache_layer == nullptr || b.block_tables == nullptr || b.ctx_len == nullptr ||
      b.kv_b == nullptr || b.out == nullptr || blas == nullptr) {
    return invalid(fmt::format("{}: null pointer", kWhat));
  }
  if (!(b.scale > 0.0F)) return invalid(fmt::format("{}: scale must be positive", kWhat));
  // The segments cover [0, rows) in order, and each one's table holds its context.
  std::int64_t next = 0;
  for (std::size_t i = 0; i < b.segments.size(); ++i) {
    const PrefillSegment& s = b.segments[i];
    if (s.row_begin != next || s.row_end <= s.row_begin || s.row_end > b.rows) {
      return invalid(fmt::format("{}: segment {} rows [{}, {}) do not continue at row {} within {} rows", kWhat, i,
                                 s.row_begin, s.row_end, next, b.rows));
    }
    PD_TRY(inRange(kWhat, "segment context", s.context, 1, b.num_blocks * b.block_size));
    const std::int64_t blocks = (s.context + b.block_size - 1) / b.block_size;
    PD_TRY(inRange(kWhat, "segment table_begin", s.table_begin, 0, b.table_entries - blocks));
    next = s.row_end;
  }
  if (next != b.rows) return invalid(fmt::format("{}: the segments cover {} of {} rows", kWhat, next, b.rows));

  const cudaStream_t st = stream.get();
  const std::int64_t qk = l.nope + l.rope;
  const std::int64_t ld = l.rank + l.rope;
  const std::int64_t kvw = l.heads * (l.nope + l.v);
  PD_CUDA_TRY(kernels::launchMlaPrefillReset(state_.data(), acc_.data(), b.rows * l.heads, static_cast<int>(l.v), st));
  const float one = 1.0F;
  const float zero = 0.0F;
  for (const PrefillSegment& s : b.segments) {
    const std::int64_t rows = s.row_end - s.row_begin;
    for (std::int64_t first = 0; first < s.context; first += kernels::kMlaPrefillChunk) {
      const std::int64_t count = std::min<std::int64_t>(kernels::kMlaPrefillChunk, s.context - first);
      kernels::GatherLatentsArgs g;
      g.cache_layer = b.cache_layer;
      g.cache_bf16 = b.cache_dtype == DType::BF16;
      g.cache_fp8 = b.cache_dtype == DType::F8E4M3;
      g.block_size = static_cast<int>(b.block_size);
      g.num_blocks = static_cast<int>(b.num_blocks);
      g.latent_dim = static_cast<int>(ld);
      g.table = b.block_tables + s.table_begin;
      g.first = first;
      g.count = static_cast<int>(count);
      g.out = latents_.data();
      PD_CUDA_TRY(kernels::launchGatherLatents(g, st));
      // kv[p][j] = sum_c kv_b[j][c] latents[p][c], c < rank: kv_b row-major [kvw, rank] is
      // column-major [rank, kvw] (transposed); the latents are column-major [rank, count], ld ld.
      PD_CUDA_TRY(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(kvw), static_cast<int>(count),
                              static_cast<int>(l.rank), &one, b.kv_b, static_cast<int>(l.rank), latents_.data(),
                              static_cast<int>(ld), &zero, kv_.data(), static_cast<int>(kvw)));
      kernels::MlaPrefillChunkArgs a;
      a.q = b.q + s.row_begin * l.heads * qk;
      a.rows = static_cast<int>(rows);
      a.heads = static_cast<int>(l.heads);
      a.nope = static_cast<int>(l.nope);
      a.rope = static_cast<int>(l.rope);
      a.v = static_cast<int>(l.v);
      a.kv = kv_.data();
      a.latents = latents_.data();
      a.latent_dim = static_cast<int>(ld);
      a.rank = static_cast<int>(l.rank);
      a.first = first;
      a.count = static_cast<int>(count);
      a.ctx_len = b.ctx_len + s.row_begin;
      a.scale = b.scale;
      a.state = state_.data() + s.row_begin * l.heads;
      a.acc = acc_.data() + s.row_begin * l.heads * l.v;
      PD_CUDA_TRY(kernels::launchMlaPrefillChunk(a, st));
    }
  }
  PD_CUDA_TRY(
      kernels::launchMlaPrefillFinish(state_.data(), acc_.data(), b.rows * l.heads, static_cast<int>(l.v), b.out, st));
  return okStatus();
}

Status routeNoauxTc(const float* logits, const float* bias, const math::RoutingShape& s, std::int64_t tokens,
                    std::int32_t* idx, float* weight, const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "routeNoauxTc";
  PD_TRY(inRange(kWhat, "tokens", tokens, 0, kIntMax));
  PD_TRY(inRange(kWhat, "experts", s.experts, 1, math::kMaxRoutedExperts));
  PD_TRY(inRange(kWhat, "groups", s.groups, 1, math::kMaxExpertGroups));
  if (s.experts % s.groups != 0)
    return invalid(fmt::format("{}: {} experts do not split into {} groups", kWhat, s.experts, s.groups));
  PD_TRY(inRange(kWhat, "topk_group", s.topk_group, 1, s.groups));
  PD_TRY(inRange(kWhat, "top_k", s.top_k, 1, s.topk_group * (s.experts / s.groups)));
  if (tokens > 0 && (logits == nullptr || idx == nullptr || weight == nullptr))
    return invalid(fmt::format("{}: null pointer", kWhat));
  PD_CUDA_TRY(kernels::launchRouteNoauxTc(logits, bias, s, static_cast<int>(tokens), idx, weight, stream.get()));
  return okStatus();
}

Status fp8Gemv(const kernels::Fp8GemvArgs& a, const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "fp8Gemv";
  PD_TRY(inRange(kWhat, "rows", a.rows, 1, kIntMax));
  PD_TRY(inRange(kWhat, "cols", a.cols, 1, kIntMax));
  PD_TRY(inRange(kWhat, "tokens", a.tokens, 1, kFp8GemvMaxTokens));
  PD_TRY(inRange(kWhat, "block_rows", a.block_rows, 1, kIntMax));
  PD_TRY(inRange(kWhat, "block_cols", a.block_cols, 1, kIntMax));
  const std::int64_t scale_cols = (static_cast<std::int64_t>(a.cols) + a.block_cols - 1) / a.block_cols;
  PD_TRY(inRange(kWhat, "scale_cols", a.scale_cols, scale_cols, scale_cols));
  PD_TRY(inRange(kWhat, "x_stride", a.x_stride, a.cols, std::numeric_limits<std::int64_t>::max()));
  PD_TRY(inRange(kWhat, "y_stride", a.y_stride, a.rows, std::numeric_limits<std::int64_t>::max()));
  if (a.q == nullptr || a.scale_inv == nullptr || a.x == nullptr || a.y == nullptr)
    return invalid(fmt::format("{}: null pointer", kWhat));
  PD_CUDA_TRY(kernels::launchFp8Gemv(a, stream.get()));
  return okStatus();
}

Status groupedGemv(const kernels::GroupedGemvArgs& a, const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "groupedGemv";
  PD_TRY(inRange(kWhat, "groups", a.groups, 1, kMaxGemvGroups));
  PD_TRY(inRange(kWhat, "rows", a.rows, 1, kIntMax));
  PD_TRY(inRange(kWhat, "cols", a.cols, 1, kIntMax));
  PD_TRY(inRange(kWhat, "x_stride", a.x_stride, a.cols, std::numeric_limits<std::int64_t>::max()));
  PD_TRY(inRange(kWhat, "y_stride", a.y_stride, a.rows, std::numeric_limits<std::int64_t>::max()));
  if (a.weights == nullptr || a.offsets == nullptr || a.x == nullptr || a.y == nullptr)
    return invalid(fmt::format("{}: null pointer", kWhat));
  if (a.kind == math::GemvWeights::Fp8) {
    PD_TRY(inRange(kWhat, "block_rows", a.block_rows, 1, kIntMax));
    PD_TRY(inRange(kWhat, "block_cols", a.block_cols, 1, kIntMax));
    const std::int64_t scale_cols = (static_cast<std::int64_t>(a.cols) + a.block_cols - 1) / a.block_cols;
    PD_TRY(inRange(kWhat, "scale_cols", a.scale_cols, scale_cols, scale_cols));
    if (a.scales == nullptr) return invalid(fmt::format("{}: FP8 weights without scales", kWhat));
  } else if (a.kind != math::GemvWeights::F32 && a.kind != math::GemvWeights::Bf16) {
    return invalid(fmt::format("{}: unknown weight kind {}", kWhat, static_cast<int>(a.kind)));
  }
  PD_CUDA_TRY(kernels::launchGroupedGemv(a, stream.get()));
  return okStatus();
}

Status moeGroup(const std::int32_t* chosen, std::int64_t tokens, std::int64_t top_k, std::int64_t experts,
                std::int32_t* offsets, std::int32_t* slot_of, std::int32_t* failed, std::int32_t* used,
                const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "moeGroup";
  PD_TRY(inRange(kWhat, "tokens", tokens, 1, kIntMax));
  PD_TRY(inRange(kWhat, "top_k", top_k, 1, math::kMaxRoutedExperts));
  PD_TRY(inRange(kWhat, "tokens * top_k", tokens * top_k, 1, kIntMax));
  PD_TRY(inRange(kWhat, "experts", experts, 1, math::kMaxRoutedExperts));
  if (chosen == nullptr || offsets == nullptr || slot_of == nullptr || failed == nullptr)
    return invalid(fmt::format("{}: null pointer", kWhat));
  PD_CUDA_TRY(kernels::launchMoeGroup(chosen, static_cast<int>(tokens * top_k), static_cast<int>(experts), offsets,
                                      slot_of, failed, used, stream.get()));
  return okStatus();
}

Status gatherRows(const float* table, std::int64_t table_rows, const std::int32_t* ids, const std::uint8_t* zero,
                  std::int64_t rows, std::int64_t d, float* out, const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "gatherRows";
  PD_TRY(inRange(kWhat, "rows", rows, 1, kIntMax));
  PD_TRY(inRange(kWhat, "d", d, 1, kIntMax));
  PD_TRY(inRange(kWhat, "table_rows", table_rows, 1, kIntMax));
  if (table == nullptr || ids == nullptr || out == nullptr) return invalid(fmt::format("{}: null pointer", kWhat));
  PD_CUDA_TRY(kernels::launchGatherRows(table, 0, table_rows, ids, zero, static_cast<int>(rows), static_cast<int>(d),
                                        out, stream.get()));
  return okStatus();
}

Status gatherShardRows(const float* table, std::int64_t first_id, std::int64_t table_rows, const std::int32_t* ids,
                       const std::uint8_t* zero, std::int64_t rows, std::int64_t d, float* out,
                       const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "gatherShardRows";
  PD_TRY(inRange(kWhat, "rows", rows, 1, kIntMax));
  PD_TRY(inRange(kWhat, "d", d, 1, kIntMax));
  PD_TRY(inRange(kWhat, "table_rows", table_rows, 1, kIntMax));
  PD_TRY(inRange(kWhat, "first_id", first_id, 0, kIntMax));
  if (table == nullptr || ids == nullptr || out == nullptr) return invalid(fmt::format("{}: null pointer", kWhat));
  PD_CUDA_TRY(kernels::launchGatherRows(table, first_id, table_rows, ids, zero, static_cast<int>(rows),
                                        static_cast<int>(d), out, stream.get()));
  return okStatus();
}

Status roundToBf16(float* x, std::int64_t n, const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "roundToBf16";
  PD_TRY(inRange(kWhat, "n", n, 0, std::numeric_limits<std::int64_t>::max()));
  if (n > 0 && x == nullptr) return invalid(fmt::format("{}: null pointer", kWhat));
  PD_CUDA_TRY(kernels::launchRoundToBf16(x, n, stream.get()));
  return okStatus();
}

Status scatterRows(const float* src, std::int64_t rows, const std::int64_t* slots, float* dst, std::int64_t dst_rows,
                   std::int64_t d, const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "scatterRows";
  PD_TRY(inRange(kWhat, "rows", rows, 1, kIntMax));
  PD_TRY(inRange(kWhat, "d", d, 1, kIntMax));
  PD_TRY(inRange(kWhat, "dst_rows", dst_rows, rows, std::numeric_limits<std::int64_t>::max()));
  if (src == nullptr || slots == nullptr || dst == nullptr) return invalid(fmt::format("{}: null pointer", kWhat));
  PD_CUDA_TRY(kernels::launchScatterRows(src, slots, static_cast<int>(rows), static_cast<int>(d), dst, stream.get()));
  return okStatus();
}

Status scatterRowsBf16(const float* src, std::int64_t rows, const std::int64_t* slots, std::uint16_t* dst,
                       std::int64_t dst_rows, std::int64_t d, const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "scatterRowsBf16";
  PD_TRY(inRange(kWhat, "rows", rows, 1, kIntMax));
  PD_TRY(inRange(kWhat, "d", d, 1, kIntMax));
  PD_TRY(inRange(kWhat, "dst_rows", dst_rows, rows, std::numeric_limits<std::int64_t>::max()));
  if (src == nullptr || slots == nullptr || dst == nullptr) return invalid(fmt::format("{}: null pointer", kWhat));
  PD_CUDA_TRY(
      kernels::launchScatterRowsBf16(src, slots, static_cast<int>(rows), static_cast<int>(d), dst, stream.get()));
  return okStatus();
}

Status scatterRowsKvFp8(const float* src, std::int64_t rows, const std::int64_t* slots, std::uint8_t* dst,
                        std::int64_t dst_rows, std::int64_t d, const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "scatterRowsKvFp8";
  PD_TRY(inRange(kWhat, "rows", rows, 1, kIntMax));
  PD_TRY(inRange(kWhat, "d", d, 1, kIntMax / 2));
  PD_TRY(inRange(kWhat, "dst_rows", dst_rows, rows, std::numeric_limits<std::int64_t>::max()));
  if (src == nullptr || slots == nullptr || dst == nullptr) return invalid(fmt::format("{}: null pointer", kWhat));
  PD_CUDA_TRY(kernels::launchScatterRowsKvFp8(src, rows, slots, dst, static_cast<int>(d), stream.get()));
  return okStatus();
}

Status moeGather(const float* x, const std::int32_t* slot_of, std::int64_t tokens, std::int64_t top_k, std::int64_t d,
                 float* gx, const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "moeGather";
  PD_TRY(inRange(kWhat, "tokens", tokens, 1, kIntMax));
  PD_TRY(inRange(kWhat, "top_k", top_k, 1, math::kMaxRoutedExperts));
  PD_TRY(inRange(kWhat, "tokens * top_k", tokens * top_k, 1, kIntMax));
  PD_TRY(inRange(kWhat, "d", d, 1, kIntMax));
  if (x == nullptr || slot_of == nullptr || gx == nullptr) return invalid(fmt::format("{}: null pointer", kWhat));
  PD_CUDA_TRY(kernels::launchMoeGather(x, slot_of, static_cast<int>(tokens), static_cast<int>(top_k),
                                       static_cast<int>(d), gx, stream.get()));
  return okStatus();
}

Status moeCombine(const std::int32_t* chosen, const float* weight, const std::int32_t* slot_of, std::int64_t tokens,
                  std::int64_t top_k, const float* gout, std::int64_t d, const float* shared, float* out,
                  const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "moeCombine";
  PD_TRY(inRange(kWhat, "tokens", tokens, 1, kIntMax));
  PD_TRY(inRange(kWhat, "top_k", top_k, 1, math::kMaxRoutedExperts));
  PD_TRY(inRange(kWhat, "tokens * top_k", tokens * top_k, 1, kIntMax));
  PD_TRY(inRange(kWhat, "d", d, 1, kIntMax));
  if (chosen == nullptr || weight == nullptr || slot_of == nullptr || gout == nullptr || out == nullptr)
    return invalid(fmt::format("{}: null pointer", kWhat));
  PD_CUDA_TRY(kernels::launchMoeCombine(chosen, weight, slot_of, static_cast<int>(tokens), static_cast<int>(top_k),
                                        gout, static_cast<int>(d), shared, out, stream.get()));
  return okStatus();
}

Result<DeviceSampler> DeviceSampler::create(std::int64_t max_rows, std::int64_t vocab) {
  PD_TRY(inRange("DeviceSampler", "max_rows", max_rows, 1, 4096));
  PD_TRY(inRange("DeviceSampler", "vocab", vocab, 1, kIntMax));
  PD_TRY(inRange("DeviceSampler", "max_rows * vocab", max_rows * vocab, 1, kIntMax));
  DeviceSampler s;
  s.max_rows_ = max_rows;
  s.vocab_ = vocab;
  const auto n = static_cast<std::size_t>(max_rows * vocab);
  PD_ASSIGN_OR_RETURN(s.work_, cuda::DeviceBuffer<float>::create(n));
  PD_ASSIGN_OR_RETURN(s.sorted_, cuda::DeviceBuffer<float>::create(n));
  PD_ASSIGN_OR_RETURN(s.ids_, cuda::DeviceBuffer<std::int32_t>::create(n));
  PD_ASSIGN_OR_RETURN(s.sorted_ids_, cuda::DeviceBuffer<std::int32_t>::create(n));
  PD_ASSIGN_OR_RETURN(s.offsets_, cuda::DeviceBuffer<int>::create(static_cast<std::size_t>(max_rows + 1)));
  std::size_t temp = 0;
  PD_CUDA_TRY(kernels::sampleSortTempBytes(static_cast<int>(max_rows), static_cast<int>(vocab), temp));
  PD_ASSIGN_OR_RETURN(s.sort_temp_, cuda::DeviceBuffer<std::uint8_t>::create(temp));
  PD_ASSIGN_OR_RETURN(s.params_, cuda::DeviceBuffer<kernels::RowSampling>::create(static_cast<std::size_t>(max_rows)));
  PD_ASSIGN_OR_RETURN(s.tokens_, cuda::DeviceBuffer<std::int32_t>::create(static_cast<std::size_t>(max_rows)));
  PD_ASSIGN_OR_RETURN(s.logprobs_, cuda::DeviceBuffer<float>::create(static_cast<std::size_t>(max_rows)));
  PD_ASSIGN_OR_RETURN(s.lse_, cuda::DeviceBuffer<double>::create(static_cast<std::size_t>(max_rows)));
  const auto top = static_cast<std::size_t>(max_rows * kernels::kMaxTopLogprobs);
  PD_ASSIGN_OR_RETURN(s.top_ids_, cuda::DeviceBuffer<std::int32_t>::create(top));
  PD_ASSIGN_OR_RETURN(s.top_logprobs_, cuda::DeviceBuffer<float>::create(top));
  return s;
}

Result<std::vector<DeviceSampler::Sampled>> DeviceSampler::sample(const float* logits, std::span<const Row> rows,
                                                                  const cuda::Stream& stream) {
  constexpr std::string_view kWhat = "DeviceSampler::sample";
  const auto n_rows = static_cast<std::int64_t>(rows.size());
  PD_TRY(inRange(kWhat, "rows", n_rows, 0, max_rows_));
  if (n_rows == 0) return std::vector<Sampled>{};
  if (logits == nullptr) return invalid(fmt::format("{}: null logits", kWhat));
  std::vector<kernels::RowSampling> params(rows.size());
  std::vector<std::int64_t> begin{0};
  std::vector<std::int32_t> tok;
  std::vector<std::int64_t> cnt;
  std::vector<std::int64_t> bias_begin{0};
  std::vector<std::int32_t> bias_tok;
  std::vector<float> bias_val;
  std::vector<std::uint64_t> masks;
  const std::int64_t words = math::maskWords(vocab_);
  bool any_filtered = false;
  bool any_top = false;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    if (!r.allowed.empty()) {
      if (static_cast<std::int64_t>(r.allowed.size()) != words) {
        return invalid(fmt::format("{}: row {} has an allowed-token mask of {} words for a vocabulary of {} ({} words)",
                                   kWhat, i, r.allowed.size(), vocab_, words));
      }
      if (!math::maskAllowsSome(r.allowed.data(), vocab_)) {
        return invalid(fmt::format("{}: row {} has an allowed-token mask that allows no token", kWhat, i));
      }
    }
    if (!(r.temperature >= 0.0) || r.top_k < 0 || !(r.top_p > 0.0 && r.top_p <= 1.0) ||
        !(r.min_p >= 0.0 && r.min_p <= 1.0) || r.top_logprobs < 0 || r.top_logprobs > kernels::kMaxTopLogprobs) {
      return invalid(fmt::format("{}: row {} has sampling parameters out of range", kWhat, i));
    }
    auto& p = params[i];
    p.greedy = r.temperature == 0.0 ? 1 : 0;
    p.transform = math::SamplingTransform{p.greedy != 0 ? 1.0 : 1.0 / r.temperature, r.top_k, r.top_p, r.min_p};
    p.seed = r.seed;
    p.draw = r.draw;
    p.presence = r.presence_penalty;
    p.frequency = r.frequency_penalty;
    p.top_n = static_cast<int>(std::min<std::int64_t>(r.top_logprobs, vocab_));  // as the CPU Sampler: at most vocab
    if (!r.allowed.empty()) {
      p.mask = static_cast<int>(masks.size() / static_cast<std::size_t>(words));
      masks.insert(masks.end(), r.allowed.begin(), r.allowed.end());
    }
    any_filtered = any_filtered || (p.greedy == 0 && p.transform.filtered());
    any_top = any_top || p.top_n > 0;
    for (const auto& [token, count] : r.counts) {
      tok.push_back(token);
      cnt.push_back(count);
    }
    begin.push_back(static_cast<std::int64_t>(tok.size()));
    for (const auto& [token, bias] : r.logit_bias) {
      if (!std::isfinite(bias)) return invalid(fmt::format("{}: row {} has a logit_bias that is not finite", kWhat, i));
      bias_tok.push_back(token);
      bias_val.push_back(bias);
    }
    bias_begin.push_back(static_cast<std::int64_t>(bias_tok.size()));
  }
  // The penalty lists vary per call; this first version uploads them through fresh buffers.
  PD_ASSIGN_OR_RETURN(auto d_begin, cuda::DeviceBuffer<std::int64_t>::create(begin.size()));
  PD_ASSIGN_OR_RETURN(auto d_tok, cuda::DeviceBuffer<std::int32_t>::create(std::max<std::size_t>(tok.size(), 1)));
  PD_ASSIGN_OR_RETURN(auto d_cnt, cuda::DeviceBuffer<std::int64_t>::create(std::max<std::size_t>(cnt.size(), 1)));
  PD_TRY(d_begin.copyFromHost(std::span<const std::int64_t>(begin), stream));
  PD_TRY(d_tok.copyFromHost(std::span<const std::int32_t>(tok), stream));
  PD_TRY(d_cnt.copyFromHost(std::span<const std::int64_t>(cnt), stream));
  PD_ASSIGN_OR_RETURN(auto d_bias_begin, cuda::DeviceBuffer<std::int64_t>::create(bias_begin.size()));
  PD_ASSIGN_OR_RETURN(auto d_bias_tok,
                      cuda::DeviceBuffer<std::int32_t>::create(std::max<std::size_t>(bias_tok.size(), 1)));
  PD_ASSIGN_OR_RETURN(auto d_bias_val, cuda::DeviceBuffer<float>::create(std::max<std::size_t>(bias_val.size(), 1)));
  PD_TRY(d_bias_begin.copyFromHost(std::span<const std::int64_t>(bias_begin), stream));
  PD_TRY(d_bias_tok.copyFromHost(std::span<const std::int32_t>(bias_tok), stream));
  PD_TRY(d_bias_val.copyFromHost(std::span<const float>(bias_val), stream));
  PD_ASSIGN_OR_RETURN(auto d_masks, cuda::DeviceBuffer<std::uint64_t>::create(std::max<std::size_t>(masks.size(), 1)));
  PD_TRY(d_masks.copyFromHost(std::span<const std::uint64_t>(masks), stream));
  PD_TRY(params_.copyFromHost(std::span<const kernels::RowSampling>(params), stream));
  kernels::SampleArgs a;
  a.logits = logits;
  a.rows = static_cast<int>(n_rows);
  a.vocab = static_cast<int>(vocab_);
  a.params = params_.data();
  a.penalty_begin = d_begin.data();
  a.penalty_token = d_tok.data();
  a.penalty_count = d_cnt.data();
  a.bias_begin = d_bias_begin.data();
  a.bias_token = d_bias_tok.data();
  a.bias_value = d_bias_val.data();
  a.masks = d_masks.data();
  a.any_masked = !masks.empty();
  a.any_filtered = any_filtered;
  a.any_top = any_top;
  a.lse = lse_.data();
  a.top_ids = top_ids_.data();
  a.top_logprobs = top_logprobs_.data();
  a.work = work_.data();
  a.sorted = sorted_.data();
  a.ids = ids_.data();
  a.sorted_ids = sorted_ids_.data();
  a.offsets = offsets_.data();
  a.sort_temp = sort_temp_.data();
  a.sort_temp_bytes = sort_temp_.size();
  a.token = tokens_.data();
  a.logprob = logprobs_.data();
  PD_CUDA_TRY(kernels::launchSample(a, stream.get()));
  std::vector<std::int32_t> out_tok(rows.size());
  std::vector<float> out_lp(rows.size());
  PD_TRY(tokens_.copyToHost(std::span<std::int32_t>(out_tok), stream));
  PD_TRY(logprobs_.copyToHost(std::span<float>(out_lp), stream));
  const std::size_t top_slots = rows.size() * static_cast<std::size_t>(kernels::kMaxTopLogprobs);
  std::vector<std::int32_t> top_ids(any_top ? top_slots : 0);
  std::vector<float> top_lp(any_top ? top_slots : 0);
  PD_TRY(top_ids_.copyToHost(std::span<std::int32_t>(top_ids), stream));
  PD_TRY(top_logprobs_.copyToHost(std::span<float>(top_lp), stream));
  PD_TRY(stream.synchronize());  // the uploads' host vectors and the outputs are done with here
  std::vector<Sampled> out(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    out[i].token = out_tok[i];
    out[i].logprob = out_lp[i];
    for (int k = 0; k < params[i].top_n; ++k) {
      const std::size_t at = i * static_cast<std::size_t>(kernels::kMaxTopLogprobs) + static_cast<std::size_t>(k);
      if (top_ids[at] < 0 || top_ids[at] >= vocab_) {
        return makeError(ErrorCode::Internal,
                         fmt::format("{}: row {}'s top logprob {} is token {}", kWhat, i, k, top_ids[at]));
      }
      out[i].top.emplace_back(top_ids[at], top_lp[at]);
    }
  }
  return out;
}

}  // namespace pd::gpu
