#pragma once
// The boundary between C++20 host code (gpu_cuda.cpp, device_ops.cpp: owners, shape checks,
// copies) and the nvcc-compiled kernels (*.cu, C++17): launches only, each returning the launch's
// status (cudaGetLastError) for the caller to check. Arguments are trusted here: the callers
// validate every shape on the host first (device_ops.cpp).
// Thread rules: launches may come from any thread; the work is ordered by the stream given.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "device_math.h"

namespace pd::gpu::kernels {

/// Queues y[i] += a * x[i] for i < n on `stream` (device pointers).
cudaError_t launchAxpy(float a, const float* x, float* y, int n, cudaStream_t stream);

/// out[r * cols + c] = bf16Encode(x[r * x_stride + c]) for r < rows, c < cols: a linear's input
/// rounded to BF16, packed, for the bf16 numerics mode's GEMMs.
cudaError_t launchRowsToBf16(const float* x, std::int64_t x_stride, std::int64_t rows, std::int64_t cols,
                             std::uint16_t* out, cudaStream_t stream);

/// x[i] = math::bf16Round(x[i]) for i < n: values rounded as a BF16 latent cache stores them.
cudaError_t launchRoundToBf16(float* x, std::int64_t n, cudaStream_t stream);
/// Row r of src [rows, d] encoded as an FP8 KV token (math::kvFp8EncodeTile) into token slots[r]
/// of dst (kvFp8TokenBytes(d) bytes a token).
cudaError_t launchScatterRowsKvFp8(const float* src, std::int64_t rows, const std::int64_t* slots, std::uint8_t* dst,
                                   int d, cudaStream_t stream);

/// gate[i] = silu(gate[i]) * up[i] for i < n (the SwiGLU activation, math::siluMul).
cudaError_t launchSiluMul(float* gate, const float* up, std::int64_t n, cudaStream_t stream);

/// Per row r < rows of width d (h and delta rows h_stride apart, out rows out_stride apart): if
/// delta, h[r] += delta[r]; then out[r] = RMSNorm(h[r]) * weight. out may equal h.
cudaError_t launchRmsNormResidual(float* h, const float* delta, const float* weight, float* out, int rows, int d,
                                  std::int64_t h_stride, std::int64_t out_stride, float eps, cudaStream_t stream);

/// Rotates pairs [offset, offset + 2 half) of each head slot of each row:
/// x[r * row_stride + head * head_stride + offset + 2 j ...] by positions[r] * inv_freq[j].
cudaError_t launchRopeInterleaved(float* x, int rows, int heads, std::int64_t row_stride, std::int64_t head_stride,
                                  std::int64_t offset, const float* inv_freq, int half, const std::int64_t* positions,
                                  cudaStream_t stream);

/// Absorbed MLA decode attention over the paged latent cache (see device_ops.h).
struct MlaDecodeArgs {
  const float* q_cat = nullptr;  ///< [tokens, heads, latent_dim]
  int tokens = 0;
  int heads = 0;
  int latent_dim = 0;
  const void* cache_layer = nullptr;  ///< one KV layer: [num_blocks, block_size] tokens
  bool cache_bf16 = false;
  bool cache_fp8 = false;  ///< tokens of kv_format.h's FP8 layout
  int block_size = 0;
  int num_blocks = 0;
  const std::int32_t* block_tables = nullptr;  ///< concatenated tables
  const std::int64_t* table_begin = nullptr;   ///< [tokens]: where token t's table starts
  const std::int64_t* ctx_len = nullptr;       ///< [tokens]: positions [0, ctx_len) attended
  float scale = 1.0F;
  int splits = 1;                         ///< ceil(max ctx_len / kMlaSplitPositions)
  math::SoftmaxPartial* parts = nullptr;  ///< workspace [tokens * heads, splits]
  float* part_o = nullptr;                ///< workspace [tokens * heads, splits, latent_dim]
  float* out = nullptr;                   ///< [tokens, heads, latent_dim]
};
constexpr int kMlaSplitPositions = 256;
constexpr int kMlaMaxLatentDim = 1024;
cudaError_t launchMlaDecode(const MlaDecodeArgs& args, cudaStream_t stream);

/// Prefill attention (see device_ops.h, MlaPrefillAttention): positions [first, first + count)
/// of one sequence's latents, read through its block table, into out [count, latent_dim] (FP32).
struct GatherLatentsArgs {
  const void* cache_layer = nullptr;  ///< one KV layer: [num_blocks, block_size] tokens
  bool cache_bf16 = false;
  bool cache_fp8 = false;  ///< tokens of kv_format.h's FP8 layout
  int block_size = 0;
  int num_blocks = 0;
  int latent_dim = 0;
  const std::int32_t* table = nullptr;  ///< the sequence's block table (device)
  std::int64_t first = 0;
  int count = 0;
  float* out = nullptr;
};
cudaError_t launchGatherLatents(const GatherLatentsArgs& args, cudaStream_t stream);

/// One context chunk of prefill attention for the rows of one sequence: for row t < rows and head
/// h, the scores q[t][h] . [k_nope[p][h] ; k_pe[p]] of the chunk's positions p < ctx_len[t]
/// (causal), folded into the running softmax state[t][h] and output acc[t][h][:]
/// (math::runningSoftmaxStep, runningOutputStep).
struct MlaPrefillChunkArgs {
  const float* q = nullptr;  ///< [rows, heads, nope + rope]: q_nope ; q_pe after RoPE
  int rows = 0;
  int heads = 0;
  int nope = 0;
  int rope = 0;
  int v = 0;
  const float* kv = nullptr;       ///< [count, heads, nope + v]: the chunk's k_nope ; v per head
  const float* latents = nullptr;  ///< [count, latent_dim]: the chunk's latents (k_pe at `rank`)
  int latent_dim = 0;
  int rank = 0;
  std::int64_t first = 0;                 ///< the chunk's first position
  int count = 0;                          ///< its positions, at most kMlaPrefillChunk
  const std::int64_t* ctx_len = nullptr;  ///< [rows]: row t attends positions [0, ctx_len[t])
  float scale = 1.0F;
  math::RunningSoftmax* state = nullptr;  ///< [rows, heads]
  float* acc = nullptr;                   ///< [rows, heads, v]
};
constexpr int kMlaPrefillChunk = 256;
constexpr int kMlaPrefillMaxHeadDim = 1024;  ///< nope + rope and v, each
cudaError_t launchMlaPrefillChunk(const MlaPrefillChunkArgs& args, cudaStream_t stream);
/// state[i] = {-inf, 0} for i < n and acc[j] = 0 for j < n * v: before a sequence's first chunk.
cudaError_t launchMlaPrefillReset(math::RunningSoftmax* state, float* acc, std::int64_t n, int v, cudaStream_t stream);
/// out[i * v + j] = math::runningOutputFinal(acc[i * v + j], state[i]) for i < n, j < v.
cudaError_t launchMlaPrefillFinish(const math::RunningSoftmax* state, const float* acc, std::int64_t n, int v,
                                   float* out, cudaStream_t stream);

/// noaux_tc routing of `tokens` rows of router logits [tokens, experts] into idx / weight
/// [tokens, top_k]. bias [experts] or null.
cudaError_t launchRouteNoauxTc(const float* logits, const float* bias, const math::RoutingShape& shape, int tokens,
                               std::int32_t* idx, float* weight, cudaStream_t stream);

/// y[t * y_stride + r] = sum_c W[r][c] x[t * x_stride + c] for a block-scaled FP8 W [rows, cols],
/// t < tokens.
struct Fp8GemvArgs {
  const std::uint8_t* q = nullptr;
  const float* scale_inv = nullptr;  ///< [ceil(rows / block_rows), scale_cols]
  int rows = 0;
  int cols = 0;
  int block_rows = 128;
  int block_cols = 128;
  int scale_cols = 0;
  const float* x = nullptr;
  std::int64_t x_stride = 0;
  int tokens = 0;
  float* y = nullptr;
  std::int64_t y_stride = 0;
};
cudaError_t launchFp8Gemv(const Fp8GemvArgs& args, cudaStream_t stream);

/// The MoE experts of one layer as one launch: y[t * y_stride + r] = W_g[r] . x[t * x_stride ...]
/// for every group g and t in [offsets[g], offsets[g + 1]) (offsets on the device: the routing's
/// grouping, never read by the host). All groups share kind, rows and cols.
struct GroupedGemvArgs {
  math::GemvWeights kind = math::GemvWeights::F32;
  const void* const* weights = nullptr;  ///< device array [groups] of device matrices [rows, cols]
  const float* const* scales = nullptr;  ///< Fp8: device array [groups] of scales [., scale_cols]
  int groups = 0;
  int rows = 0;
  int cols = 0;
  int block_rows = 128;
  int block_cols = 128;
  int scale_cols = 0;
  const std::int32_t* offsets = nullptr;  ///< device [groups + 1]
  const float* x = nullptr;
  std::int64_t x_stride = 0;
  float* y = nullptr;
  std::int64_t y_stride = 0;
};
cudaError_t launchGroupedGemv(const GroupedGemvArgs& args, cudaStream_t stream);

/// MoE grouping on the device (math::groupByExpert, one thread): chosen [slots] -> offsets
/// [experts + 1], slot_of [slots]; *failed is set to 1 (and never cleared) when a chosen id is
/// outside [0, experts); *used (when not null) = the experts with at least one row.
cudaError_t launchMoeGroup(const std::int32_t* chosen, int slots, int experts, std::int32_t* offsets,
                           std::int32_t* slot_of, std::int32_t* failed, std::int32_t* used, cudaStream_t stream);

/// out[r * d + j] = table[(ids[r] - first_id) * d + j] for r < rows, j < d, or 0 where zero (may
/// be null) has zero[r] != 0 or ids[r] - first_id lies outside [0, table_rows) (another tensor
/// parallel rank's vocabulary rows). ids on the device (a step's token ids or chosen rows), so
/// the copies need no host-known index: one launch instead of one copy per row.
cudaError_t launchGatherRows(const float* table, std::int64_t first_id, std::int64_t table_rows,
                             const std::int32_t* ids, const std::uint8_t* zero, int rows, int d, float* out,
                             cudaStream_t stream);

/// dst[slots[r] * d + j] = src[r * d + j] for r < rows, j < d: each new latent written to its
/// cache slot (slots on the device, distinct: the plan checks it).
cudaError_t launchScatterRows(const float* src, const std::int64_t* slots, int rows, int d, float* dst,
                              cudaStream_t stream);
/// The same into a BF16 cache: dst[slots[r] * d + j] = math::bf16Encode(src[r * d + j]).
cudaError_t launchScatterRowsBf16(const float* src, const std::int64_t* slots, int rows, int d, std::uint16_t* dst,
                                  cudaStream_t stream);

/// gx[slot_of[i] * d + j] = x[(i / top_k) * d + j] for i < tokens * top_k with slot_of[i] >= 0.
cudaError_t launchMoeGather(const float* x, const std::int32_t* slot_of, int tokens, int top_k, int d, float* gx,
                            cudaStream_t stream);

/// out[t * d + j] = math::moeCombine of token t (chosen / weight / slot_of [tokens, top_k], gout
/// [., d], shared [tokens, d] or null).
cudaError_t launchMoeCombine(const std::int32_t* chosen, const float* weight, const std::int32_t* slot_of, int tokens,
                             int top_k, const float* gout, int d, const float* shared, float* out, cudaStream_t stream);

/// Most top logprobs a row may ask for (SamplingParams::top_logprobs' limit).
constexpr int kMaxTopLogprobs = 20;

/// One row's sampling request on the device.
struct RowSampling {
  math::SamplingTransform transform;
  std::uint64_t seed = 0;
  std::uint64_t draw = 0;  ///< which draw of the request's generator (counter)
  int greedy = 0;
  double presence = 0.0;
  double frequency = 0.0;
  int top_n = 0;  ///< top logprobs to report, 0..kMaxTopLogprobs
  int mask = -1;  ///< the row's allowed-token mask in SampleArgs::masks; -1: every token
};
struct SampleArgs {
  const float* logits = nullptr;  ///< [rows, vocab] raw
  int rows = 0;
  int vocab = 0;
  const RowSampling* params = nullptr;          ///< [rows]
  const std::int64_t* penalty_begin = nullptr;  ///< [rows + 1] CSR over the two arrays below
  const std::int32_t* penalty_token = nullptr;  ///< distinct per row
  const std::int64_t* penalty_count = nullptr;
  const std::int64_t* bias_begin = nullptr;  ///< [rows + 1] CSR of logit_bias over the two below
  const std::int32_t* bias_token = nullptr;  ///< distinct per row; ids outside the vocabulary ignored
  const float* bias_value = nullptr;
  /// [masked rows, maskWords(vocab)]: allowed-token bitsets (math::tokenAllowed) that
  /// RowSampling::mask indexes; tokens outside a row's get -inf after logit_bias.
  const std::uint64_t* masks = nullptr;
  bool any_masked = false;
  bool any_filtered = false;  ///< sort the rows (top-k / top-p / min-p)
  bool any_top = false;       ///< some row asks for top logprobs
  // Workspace (SampleWorkspace sizes it):
  float* work = nullptr;               ///< [rows, vocab]
  float* sorted = nullptr;             ///< [rows, vocab]
  std::int32_t* ids = nullptr;         ///< [rows, vocab]
  std::int32_t* sorted_ids = nullptr;  ///< [rows, vocab]
  int* offsets = nullptr;              ///< [rows + 1]
  void* sort_temp = nullptr;
  std::size_t sort_temp_bytes = 0;
  double* lse = nullptr;  ///< [rows]: the raw logits' log-sum-exp
  // Out:
  std::int32_t* token = nullptr;    ///< [rows]
  float* logprob = nullptr;         ///< [rows]: under the raw distribution
  std::int32_t* top_ids = nullptr;  ///< [rows, kMaxTopLogprobs]: the first top_n of each row
  float* top_logprobs = nullptr;    ///< [rows, kMaxTopLogprobs]
};
/// CUB's scratch bytes for sorting rows x vocab keys.
cudaError_t sampleSortTempBytes(int rows, int vocab, std::size_t& bytes);
cudaError_t launchSample(const SampleArgs& args, cudaStream_t stream);

// Benchmark kernels (`pdserve bench engine --device cuda`, device_bench.cpp).

/// Reads `count` 16-byte words of `data` once each (grid-stride, one load per word per thread)
/// and writes one XOR of what each block read to sink[block], so the loads cannot be dropped.
/// sink holds kStreamReadBlocks words.
constexpr int kStreamReadBlocks = 4096;
cudaError_t launchStreamRead(const uint4* data, std::size_t count, unsigned int* sink, cudaStream_t stream);

/// Fills `count` BF16 values with a fixed pseudo-random pattern in [-1, 1) keyed by `seed` (the
/// GEMM ceiling's operands: not zeros, which would flatter the tensor cores' power draw).
cudaError_t launchFillBf16(std::uint16_t* data, std::size_t count, std::uint32_t seed, cudaStream_t stream);

}  // namespace pd::gpu::kernels
