#pragma once
/// The CUDA backend's operations on device memory: each validates its shapes on the host
/// (InvalidArgument naming the bad value, nothing launched), launches on the caller's stream and
/// checks the launch (PD_CUDA_TRY(cudaGetLastError())). Failures of the queued work surface at
/// the stream's next synchronize(). Pointers are device pointers on the current device.
///
/// Private to the CUDA backend (engine/cuda) and its tests; nothing here is a public header.
/// Thread rules: functions are thread-safe; a workspace owner belongs to one thread (the engine's)
/// and its work must be ordered on one stream.

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "decode_step_plan.h"
#include "gpu_kernels.h"
#include "pd/common/dtype.h"
#include "pd/common/result.h"
#include "pd/cuda/cuda_handles.h"

namespace pd::gpu {

/// The current device's memory as cudaMemGetInfo reports it.
struct DeviceMemoryInfo {
  std::uint64_t free = 0;
  std::uint64_t total = 0;
};
[[nodiscard]] Result<DeviceMemoryInfo> deviceMemoryInfo();

/// Per row: h += delta (when delta is not null), out = RMSNorm(h) * weight; out may be h.
/// h, delta, out [rows, d]; weight [d].
Status rmsNormResidual(float* h, const float* delta, const float* weight, float* out, std::int64_t rows, std::int64_t d,
                       float eps, const cuda::Stream& stream);

/// Per row: out = RMSNorm(x[:d]) * weight, for the first d columns of rows x_stride apart, written
/// to rows out_stride apart (both strides >= d): one launch for a column block of a wider matrix
/// (the latent part of kv_a's output). Each row's values are rmsNormResidual's.
Status rmsNormRows(float* x, std::int64_t x_stride, const float* weight, float* out, std::int64_t out_stride,
                   std::int64_t rows, std::int64_t d, float eps, const cuda::Stream& stream);

/// DeepSeek's interleaved RoPE in place: for row r and head h, the pairs of
/// x[r * row_stride + h * head_stride + offset, + 2 * half) rotate by positions[r] * inv_freq[j]
/// (inv_freq [half] as model::ropeInvFreq gives it, positions [rows] RoPE positions).
struct RopeShape {
  std::int64_t rows = 0;
  std::int64_t heads = 1;
  std::int64_t row_stride = 0;
  std::int64_t head_stride = 0;
  std::int64_t offset = 0;
  std::int64_t half = 0;
};
Status ropeInterleaved(float* x, const RopeShape& shape, const float* inv_freq, const std::int64_t* positions,
                       const cuda::Stream& stream);

/// Absorbed MLA decode attention over one KV layer of the paged latent cache: for every query
/// token t and head h, out[t][h] = softmax(scale * L q_cat[t][h]) L over the latents L of
/// positions [0, ctx_len[t]) of t's sequence (found through its block table), computed in splits
/// of kMlaSplitPositions positions merged by log-sum-exp. Owns the split workspace, sized once.
class MlaDecodeAttention {
 public:
  struct Limits {
    std::int64_t max_tokens = 0;
    std::int64_t heads = 0;
    std::int64_t latent_dim = 0;  ///< <= kernels::kMlaMaxLatentDim
    std::int64_t max_context = 0;
  };
  /// InvalidArgument for non-positive or too large limits; ResourceExhausted when the device
  /// memory is not there.
  [[nodiscard]] static Result<MlaDecodeAttention> create(const Limits& limits);

  struct Batch {
    const float* q_cat = nullptr;  ///< [tokens, heads, latent_dim]
    std::int64_t tokens = 0;
    const void* cache_layer = nullptr;  ///< [num_blocks, block_size, latent_dim] of cache_dtype
    DType cache_dtype = DType::F32;     ///< F32, BF16 or F8E4M3 (kv_format.h tokens)
    std::int64_t block_size = 0;
    std::int64_t num_blocks = 0;
    const std::int32_t* block_tables = nullptr;  ///< concatenated
    const std::int64_t* table_begin = nullptr;   ///< [tokens]
    const std::int64_t* ctx_len = nullptr;       ///< [tokens], each in [1, max_context_in_batch]
    std::int64_t max_context_in_batch = 0;       ///< host-side bound of ctx_len, sizes the splits
    float scale = 1.0F;
    float* out = nullptr;  ///< [tokens, heads, latent_dim]
  };
  Status run(const Batch& batch, const cuda::Stream& stream);

  [[nodiscard]] const Limits& limits() const { return limits_; }

 private:
  MlaDecodeAttention(Limits limits, cuda::DeviceBuffer<math::SoftmaxPartial> parts, cuda::DeviceBuffer<float> part_o)
      : limits_(limits), parts_(std::move(parts)), part_o_(std::move(part_o)) {}
  Limits limits_;
  cuda::DeviceBuffer<math::SoftmaxPartial> parts_;
  cuda::DeviceBuffer<float> part_o_;
};

/// MLA prefill attention over one KV layer of the paged latent cache, the CPU engine's Prefill
/// path (keys and values up-projected, not absorbed): per PrefillSegment (rows of one sequence),
/// the latents of positions [0, context) are read in chunks of kernels::kMlaPrefillChunk,
/// up-projected once for all the segment's rows by kv_b (one SGEMM per chunk: k_nope ; v per
/// head), and each row t attends causally to positions [0, ctx_len[t]) with a running softmax
/// across the chunks (math::runningSoftmaxStep). out[t][h] = softmax(scale q[t][h] . [k_nope ;
/// k_pe]) v, [rows, heads, v]. The workspace is bounded by the chunk and the rows, not by the
/// context. A segment's host loop depends on its context, so steps on this path run eagerly
/// (never captured).
class MlaPrefillAttention {
 public:
  struct Limits {
    std::int64_t max_rows = 0;
    std::int64_t heads = 0;
    std::int64_t nope = 0;  ///< qk_nope_head_dim
    std::int64_t rope = 0;  ///< qk_rope_head_dim
    std::int64_t v = 0;     ///< v_head_dim
    std::int64_t rank = 0;  ///< kv_lora_rank (latent_dim = rank + rope)
  };
  /// InvalidArgument for non-positive or too large limits; ResourceExhausted when the device
  /// memory is not there.
  [[nodiscard]] static Result<MlaPrefillAttention> create(const Limits& limits);

  struct Batch {
    const float* q = nullptr;  ///< [rows, heads, nope + rope], RoPE applied
    std::int64_t rows = 0;
    const void* cache_layer = nullptr;  ///< [num_blocks, block_size, rank + rope] of cache_dtype
    DType cache_dtype = DType::F32;     ///< F32, BF16 or F8E4M3 (kv_format.h tokens)
    std::int64_t block_size = 0;
    std::int64_t num_blocks = 0;
    const std::int32_t* block_tables = nullptr;  ///< device, concatenated (DecodeStepPlan::block_tables)
    std::int64_t table_entries = 0;              ///< host: block_tables' length
    const std::int64_t* ctx_len = nullptr;       ///< device [rows], each in [1, its segment's context]
    std::span<const PrefillSegment> segments;    ///< host: cover rows [0, rows) in order
    const float* kv_b = nullptr;                 ///< device FP32 [heads * (nope + v), rank]
    float scale = 1.0F;
    float* out = nullptr;  ///< [rows, heads, v]
  };
  /// `blas` must already run on `stream` (cuda::BlasHandle::create(stream)): run() does not call
  /// cublasSetStream, which would also reset a workspace the caller set (cublasSetWorkspace).
  Status run(const Batch& batch, cublasHandle_t blas, const cuda::Stream& stream);

  [[nodiscard]] const Limits& limits() const { return limits_; }

 private:
  MlaPrefillAttention(Limits limits, cuda::DeviceBuffer<float> latents, cuda::DeviceBuffer<float> kv,
                      cuda::DeviceBuffer<math::RunningSoftmax> state, cuda::DeviceBuffer<float> acc)
      : limits_(limits),
        latents_(std::move(latents)),
        kv_(std::move(kv)),
        state_(std::move(state)),
        acc_(std::move(acc)) {}
  Limits limits_;
  cuda::DeviceBuffer<float> latents_;               // [chunk, rank + rope]
  cuda::DeviceBuffer<float> kv_;                    // [chunk, heads * (nope + v)]
  cuda::DeviceBuffer<math::RunningSoftmax> state_;  // [max_rows * heads]
  cuda::DeviceBuffer<float> acc_;                   // [max_rows * heads * v]
};

/// noaux_tc routing of `tokens` rows of router logits [tokens, experts] into idx / weight
/// [tokens, top_k] (descending biased score, lower expert id on ties); bias [experts] or null.
Status routeNoauxTc(const float* logits, const float* bias, const math::RoutingShape& shape, std::int64_t tokens,
                    std::int32_t* idx, float* weight, const cuda::Stream& stream);

/// y[t * y_stride + r] = W[r] . x[t * x_stride ...] for a block-scaled FP8 W and 1..64 tokens.
constexpr std::int64_t kFp8GemvMaxTokens = 64;
Status fp8Gemv(const kernels::Fp8GemvArgs& args, const cuda::Stream& stream);

/// The MoE experts of one layer in one launch each for gate, up and down (kernels::GroupedGemvArgs):
/// the groups' rows come from offsets on the device, which the host never reads, so x and y must
/// hold every row the grouping can produce (tokens * top_k). InvalidArgument for a bad shape.
constexpr std::int64_t kMaxGemvGroups = 65535;  // the grid's y dimension
Status groupedGemv(const kernels::GroupedGemvArgs& args, const cuda::Stream& stream);

/// One MoE layer's token grouping on the device (math::groupByExpert): chosen [tokens, top_k]
/// (routeNoauxTc's idx) -> offsets [experts + 1], slot_of [tokens * top_k]. *failed (device) is
/// set to 1 when a chosen id is outside [0, experts); nothing is grouped then. *used (device, may
/// be null) = the experts that got rows (what the layer's expert weights cost in bytes).
Status moeGroup(const std::int32_t* chosen, std::int64_t tokens, std::int64_t top_k, std::int64_t experts,
                std::int32_t* offsets, std::int32_t* slot_of, std::int32_t* failed, std::int32_t* used,
                const cuda::Stream& stream);

/// out[r] = table[ids[r]] (rows of width d) for r < rows, or zeros where zero[r] != 0 (zero may be
/// null). The ids are on the device and must lie in [0, table_rows): the caller checks them on
/// the host before they are uploaded (InvalidArgument here only for bad sizes or null pointers).
Status gatherRows(const float* table, std::int64_t table_rows, const std::int32_t* ids, const std::uint8_t* zero,
                  std::int64_t rows, std::int64_t d, float* out, const cuda::Stream& stream);
/// The embedding of a vocabulary shard: out[r] = table[ids[r] - first_id] where ids[r] lies in
/// [first_id, first_id + table_rows), zeros otherwise (and where zero[r] != 0). The ranks' partial
/// embeddings then sum (allreduce) to the whole one.
Status gatherShardRows(const float* table, std::int64_t first_id, std::int64_t table_rows, const std::int32_t* ids,
                       const std::uint8_t* zero, std::int64_t rows, std::int64_t d, float* out,
                       const cuda::Stream& stream);

/// x[i] = math::bf16Round(x[i]) for i < n (n >= 0): what a BF16 latent cache would hold.
Status roundToBf16(float* x, std::int64_t n, const cuda::Stream& stream);

/// dst[slots[r]] = src[r] (rows of width d) for r < rows. The slots are on the device, distinct and
/// in [0, dst_rows): the caller checks them on the host before they are uploaded.
Status scatterRows(const float* src, std::int64_t rows, const std::int64_t* slots, float* dst, std::int64_t dst_rows,
                   std::int64_t d, const cuda::Stream& stream);
/// The same into a BF16 cache: each value rounded to nearest even (math::bf16Encode).
Status scatterRowsBf16(const float* src, std::int64_t rows, const std::int64_t* slots, std::uint16_t* dst,
                       std::int64_t dst_rows, std::int64_t d, const cuda::Stream& stream);
/// The same into an FP8 cache (pd/common/kv_format.h): each row encoded as one token of
/// kvTokenBytes(F8E4M3, d) bytes (e4m3 codes, a float32 scale per 64 values), exactly the bytes
/// pd::encodeKvToken writes.
Status scatterRowsKvFp8(const float* src, std::int64_t rows, const std::int64_t* slots, std::uint8_t* dst,
                        std::int64_t dst_rows, std::int64_t d, const cuda::Stream& stream);

/// gx[slot_of[i]] = x[i / top_k] for the tokens * top_k slots (rows of width d).
Status moeGather(const float* x, const std::int32_t* slot_of, std::int64_t tokens, std::int64_t top_k, std::int64_t d,
                 float* gx, const cuda::Stream& stream);

/// out[t] = the weighted sum of token t's expert outputs gout[slot_of[t, k]] in ascending expert
/// id order, + shared[t] when shared is not null (math::moeCombine).
Status moeCombine(const std::int32_t* chosen, const float* weight, const std::int32_t* slot_of, std::int64_t tokens,
                  std::int64_t top_k, const float* gout, std::int64_t d, const float* shared, float* out,
                  const cuda::Stream& stream);

/// Samples one token per row of device logits (the CPU Sampler's rules: penalties, logit_bias,
/// temperature, top-k, top-p, min-p, a seeded draw; greedy when temperature is 0) and returns only
/// the ids, their logprobs and the top logprobs asked for to the host. Owns its workspace, sized
/// for max_rows x vocab once.
class DeviceSampler {
 public:
  [[nodiscard]] static Result<DeviceSampler> create(std::int64_t max_rows, std::int64_t vocab);

  struct Row {
    double temperature = 0.0;
    std::int64_t top_k = 0;
    double top_p = 1.0;
    double min_p = 0.0;
    double presence_penalty = 0.0;
    double frequency_penalty = 0.0;
    std::uint64_t seed = 0;
    std::uint64_t draw = 0;  ///< the request's non-greedy tokens sampled so far
    /// Tokens generated so far with their counts (distinct ids), for the penalties.
    std::span<const std::pair<std::int32_t, std::int64_t>> counts;
    /// Added after the penalties (distinct tokens; ids outside the vocabulary are ignored).
    std::span<const std::pair<std::int32_t, float>> logit_bias;
    std::int64_t top_logprobs = 0;  ///< 0..kernels::kMaxTopLogprobs alternatives to report
    /// Empty: every token. Else an allowed-token bitset (model::RowSample::allowed) of
    /// math::maskWords(vocab) words allowing at least one token below vocab.
    std::span<const std::uint64_t> allowed;
  };
  struct Sampled {
    std::int32_t token = 0;
    float logprob = 0.0F;
    /// The row's top_logprobs most likely tokens under the raw logits with their logprobs, best
    /// first (larger logit, then lower id), at most the vocabulary.
    std::vector<std::pair<std::int32_t, float>> top;
  };
  /// logits: [rows.size(), vocab] on the device. Blocks until the results are on the host.
  Result<std::vector<Sampled>> sample(const float* logits, std::span<const Row> rows, const cuda::Stream& stream);

 private:
  DeviceSampler() = default;
  std::int64_t max_rows_ = 0;
  std::int64_t vocab_ = 0;
  cuda::DeviceBuffer<float> work_;
  cuda::DeviceBuffer<float> sorted_;
  cuda::DeviceBuffer<std::int32_t> ids_;
  cuda::DeviceBuffer<std::int32_t> sorted_ids_;
  cuda::DeviceBuffer<int> offsets_;
  cuda::DeviceBuffer<std::uint8_t> sort_temp_;
  cuda::DeviceBuffer<kernels::RowSampling> params_;
  cuda::DeviceBuffer<std::int32_t> tokens_;
  cuda::DeviceBuffer<float> logprobs_;
  cuda::DeviceBuffer<double> lse_;
  cuda::DeviceBuffer<std::int32_t> top_ids_;
  cuda::DeviceBuffer<float> top_logprobs_;
};

}  // namespace pd::gpu
