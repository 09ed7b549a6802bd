#pragma once
/// The host side of one device decode step (device_decode_step.h): a batch of sequences, one new
/// token each, checked against the model and the device latent cache's geometry before anything
/// is launched, and laid out as the device step's per-token arrays. Host arithmetic only, in every
/// build (CPU-only builds and their unit tests included).
///
/// Private to the CUDA backend (engine/cuda) and its tests.
/// Thread rules: free functions, thread-safe; a plan is a value.

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "pd/common/dtype.h"
#include "pd/common/result.h"
#include "pd/engine/model_config.h"

namespace pd::gpu {

/// Sequences one decode step takes at most: the FP8 GEMV's token limit (kFp8GemvMaxTokens).
constexpr std::int64_t kMaxDecodeBatch = 64;
/// Widest latent the decode attention kernel takes (kernels::kMlaMaxLatentDim).
constexpr std::int64_t kMaxDecodeLatentDim = 1024;

/// The device latent cache's geometry: [kv_layers, num_blocks, block_size, latent_dim] of dtype,
/// F32 or BF16 (the latents rounded to nearest even as they are written, as a BF16 host cache
/// holds them; the attention kernels decode them to FP32).
struct DecodeCacheShape {
  std::int64_t num_blocks = 0;
  std::int64_t block_size = 0;
  DType dtype = DType::F32;
  friend bool operator==(const DecodeCacheShape&, const DecodeCacheShape&) = default;
};

/// InvalidArgument naming the value unless num_blocks, block_size > 0, num_blocks * block_size
/// <= 2^31 and dtype is F32 or BF16.
[[nodiscard]] Status checkCacheShape(const DecodeCacheShape& shape);

/// One sequence of a decode step (or one row of a prefill chunk): `token` goes to cache position
/// `position`; positions [0, position) are already in the cache (or written by earlier rows of the
/// same step: every row's latent is written before attention reads); block_table holds positions
/// [0, position]. RoPE position = position + rope_offset (SequenceChunk::rope_offset).
struct DecodeSequence {
  std::int32_t token = 0;
  std::int64_t position = 0;
  std::span<const std::int32_t> block_table;
  std::int64_t rope_offset = 0;
};

/// A validated step, laid out for the device (index t = the t-th sequence).
struct DecodeStepPlan {
  std::int64_t tokens = 0;
  std::vector<std::int32_t> token_ids;     ///< [tokens]
  std::vector<std::int64_t> positions;     ///< [tokens]: RoPE positions (cache position + rope_offset)
  std::vector<std::int64_t> ctx_len;       ///< [tokens]: position + 1 (causal)
  std::vector<std::int32_t> block_tables;  ///< the blocks each sequence needs, concatenated
  std::vector<std::int64_t> table_begin;   ///< [tokens]: where sequence t's blocks start
  std::vector<std::int64_t> write_slot;    ///< [tokens]: block id * block_size + offset of the new latent
  std::int64_t max_context = 0;            ///< max ctx_len
};

/// A run of consecutive rows of a step that read one sequence's cache: each row's table is a
/// prefix of the next row's, and contexts do not decrease (the rows of a prefill chunk, or one
/// decode row alone). The prefill attention path up-projects the segment's context once for all
/// its rows.
struct PrefillSegment {
  std::int64_t row_begin = 0;
  std::int64_t row_end = 0;      ///< exclusive
  std::int64_t table_begin = 0;  ///< the last row's table in DecodeStepPlan::block_tables
  std::int64_t context = 0;      ///< the last row's ctx_len: positions [0, context) are read
};

/// The plan's rows cut into PrefillSegments, in row order; together they cover every row once.
[[nodiscard]] std::vector<PrefillSegment> prefillSegments(const DecodeStepPlan& plan);

/// Whether the model is one the device decode step runs: DeepSeek-V3 MLA + MoE within the
/// kernels' limits (latent_dim, routed experts, groups, top-k). InvalidArgument / Unsupported
/// naming the value otherwise.
[[nodiscard]] Status checkDecodeModel(const ModelConfig& config);

/// Checks a step's batch (1..kMaxDecodeBatch sequences; token ids in the vocabulary; RoPE positions
/// (position + rope_offset, rope_offset >= 0) in [0, max_position_embeddings); tables long enough, block ids in [0,
/// num_blocks); no two sequences writing the same cache slot) and lays it out. InvalidArgument naming the sequence and
/// value.
[[nodiscard]] Result<DecodeStepPlan> planDecodeStep(const ModelConfig& config, const DecodeCacheShape& cache,
                                                    std::span<const DecodeSequence> batch);

/// The attention context a captured (CUDA graph) step is built for: `max_context` raised so that
/// its split count, ceil(context / split_positions), is the next power of two, at most `limit`
/// (the attention workspace's max_context, which bounds it). A step whose longest context is
/// `max_context` computes the same values with this context: the extra splits are empty, and an
/// empty split adds exact zeros to the merge (math::mergeFactor). So one graph serves the
/// contexts of a whole power-of-two band instead of one per 256 positions.
[[nodiscard]] std::int64_t graphAttentionContext(std::int64_t max_context, std::int64_t split_positions,
                                                 std::int64_t limit);

/// Multiply-adds x 2 of a step's attention on each path (the linears they share left out):
/// absorbed, per row, W_UK into the query and W_UV out of the latent (2 heads (nope + v) rank)
/// plus its scores and weighted latents (2 ctx heads (latent_dim + rank)); prefill, per segment,
/// the up-projection of its context (2 context heads (nope + v) rank) plus, per row, the scores
/// and weighted values (2 ctx heads (nope + rope + v)).
struct AttentionCost {
  double absorbed = 0.0;
  double prefill = 0.0;
};
[[nodiscard]] AttentionCost attentionCost(const ModelConfig& config, const DecodeStepPlan& plan);

/// The CUDA engine's AttentionPath::Auto for one step: the prefill path when it costs fewer
/// operations than the absorbed one (attentionCost). With 64-row steps the prefill path pays off
/// only while the rows are a large part of their context (a prompt's first steps): re-projecting
/// a long context for 64 rows costs more than absorbing it (DeepSeek-V3: 64 rows at context 4096,
/// 137 against 75 GFLOP per layer).
[[nodiscard]] bool preferPrefillAttention(const ModelConfig& config, const DecodeStepPlan& plan);

/// The row counts captured steps are padded to, so that a decode batch whose size changes every
/// step reuses a few graphs rather than warming and capturing one per count: 1, 2, 4, 8, then
/// multiples of 8 up to kMaxDecodeBatch (the smallest at least `rows`; rows in [1, 64]).
[[nodiscard]] std::int64_t graphRowBucket(std::int64_t rows);

/// Device cache blocks kept past the caller's num_blocks for padded rows: enough that each of up
/// to kMaxDecodeBatch - 1 padded rows writes a slot of its own.
[[nodiscard]] std::int64_t paddingBlocks(std::int64_t block_size);

/// `plan` (made for `cache`) grown to `rows` rows (plan.tokens <= rows <= kMaxDecodeBatch): padded
/// row i is token 0 at position 0 with context 1, writing and reading slot i of the padding blocks
/// [cache.num_blocks, cache.num_blocks + paddingBlocks) that no real row's table names. A row's
/// computation reads only its own inputs, so the real rows compute what they would alone (up to
/// the summation order cuBLAS picks for the padded row count).
[[nodiscard]] DecodeStepPlan padDecodeStep(const DecodeStepPlan& plan, std::int64_t rows,
                                           const DecodeCacheShape& cache);

/// What a captured decode step's work depends on besides the contents of its buffers.
struct DecodeGraphKey {
  std::int64_t tokens = 0;
  std::int64_t attention_context = 0;  ///< graphAttentionContext of the step
  bool mtp = false;
  bool zero_embedding = false;   ///< MTP rows with a zeroed embedding flag list
  bool collect_latents = false;  ///< each layer's latents copied to the host
  bool round_latents = false;    ///< latents rounded to BF16 before the cache
  bool operator==(const DecodeGraphKey&) const = default;
  friend bool operator<(const DecodeGraphKey& a, const DecodeGraphKey& b) {
    return std::tie(a.tokens, a.attention_context, a.mtp, a.zero_embedding, a.collect_latents, a.round_latents) <
           std::tie(b.tokens, b.attention_context, b.mtp, b.zero_embedding, b.collect_latents, b.round_latents);
  }
};

/// The captured steps by key, at most `capacity` (the least recently used goes first), and what
/// to do with a step: a key's first step runs eagerly (its warm-up: cuBLAS chooses and loads its
/// kernels outside any capture), its second is captured and launched, later ones replay. A key
/// whose capture failed stays eager. Host logic, G is the graph type (cuda::Graph on a device).
template <class G>
class DecodeGraphCache {
 public:
  enum class Action { Eager, Capture, Replay };
  struct Entry {
    int steps = 0;
    bool eager_only = false;
    std::optional<G> graph;
    std::uint64_t last_use = 0;
  };

  explicit DecodeGraphCache(std::size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}

  /// The key's entry (made when new, after evicting the least recently used when full) and the
  /// action for this step. The pointer is valid until the next use() or clear().
  [[nodiscard]] std::pair<Entry*, Action> use(const DecodeGraphKey& key) {
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      if (entries_.size() >= capacity_) {
        auto oldest = entries_.begin();
        for (auto e = entries_.begin(); e != entries_.end(); ++e) {
          if (e->second.last_use < oldest->second.last_use) oldest = e;
        }
        entries_.erase(oldest);
        ++evicted_;
      }
      it = entries_.emplace(key, Entry{}).first;
    }
    Entry& e = it->second;
    e.last_use = ++clock_;
    ++e.steps;
    if (e.graph) return {&e, Action::Replay};
    if (e.eager_only || e.steps < 2) return {&e, Action::Eager};
    return {&e, Action::Capture};
  }
  void clear() { entries_.clear(); }
  [[nodiscard]] std::size_t size() const { return entries_.size(); }
  [[nodiscard]] std::size_t evicted() const { return evicted_; }

 private:
  std::size_t capacity_;
  std::map<DecodeGraphKey, Entry> entries_;
  std::uint64_t clock_ = 0;
  std::size_t evicted_ = 0;
};

/// One column-major strided-batched SGEMM as cuBLAS takes it (cublasSgemmStridedBatched): for
/// b < batch, C_b[m, n] = op(A_b) op(B_b) with A_b = A + a_offset + b * stride_a (and likewise B, C),
/// op(X) = X^T when trans_* is set, element (i, j) of a matrix at X[i + j * ld]. The device step's
/// products are described by these values so that host tests check their indexing everywhere.
struct BatchedGemm {
  bool trans_a = false;
  bool trans_b = false;
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  std::int64_t a_offset = 0;
  std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  std::int64_t batch = 1;
};

/// y[t * y_stride + r] = W[r] . x[t * x_stride ...], W row-major [rows, cols]: A = W, B = x, C = y.
[[nodiscard]] BatchedGemm linearGemm(std::int64_t rows, std::int64_t cols, std::int64_t tokens, std::int64_t x_stride,
                                     std::int64_t y_stride);
/// The absorbed query, per head h: q_cat[t][h][c] = sum_j kv_b[h * (nope + v) + j][c] q[t][h][j]
/// for c < kv_lora_rank, j < nope: A = kv_b, B = q [tokens, heads, qk], C = q_cat
/// [tokens, heads, latent_dim].
[[nodiscard]] BatchedGemm absorbQueryGemm(const ModelConfig& config, std::int64_t tokens);
/// The value up-projection, per head h: o[t][h][i] = sum_c kv_b[h * (nope + v) + nope + i][c]
/// o_lat[t][h][c] for i < v, c < kv_lora_rank: A = kv_b, B = o_lat [tokens, heads, latent_dim],
/// C = o [tokens, heads, v].
[[nodiscard]] BatchedGemm valueUpGemm(const ModelConfig& config, std::int64_t tokens);
/// The product on the host, in the plain loop order (alpha 1, beta 0): for tests.
void referenceGemm(const BatchedGemm& g, const float* a, const float* b, float* c);

}  // namespace pd::gpu
