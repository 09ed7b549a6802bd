#pragma once
/// The model engine: the DeepSeek-V3 forward pass that prefill and decode workers run, behind a
/// small interface so that backends (CPU now, CUDA later) can be swapped and compared.
///
/// One call forwards a batch of sequence chunks. Each chunk is some new tokens of one sequence
/// at cache positions [start_pos, start_pos + n); positions before start_pos are already in the
/// paged latent cache (latent_cache.h) and are attended to. The engine writes each new token's
/// latent KV into the cache as it computes it, and hands it to an optional sink layer by layer
/// (a prefill worker streams it to a decode worker).
///
///  - forward(): the main model. A prefill chunk and a decode step are the same call with
///    different options (attention path, which rows of logits / hidden states to return).
///  - forwardMtp(): the MTP layer. Input row i is (token t[i+1], main-model final hidden state
///    h[i]) at cache position i of the MTP's own KV layer (kv layer num_hidden_layers); output
///    row i is the draft distribution for t[i+2]. Every position runs, position 0 included, with
///    nothing zeroed (SGLang's convention; golden `mtp_logits_nozero`). Its `hidden` rows are
///    the MTP block's output before shared_head.norm: what a chained draft step (the same MTP
///    layer drafting a second token) takes as prev_hidden, as vLLM does.
///
/// Numerics: float32 activations; weights dequantized inside the kernels in float32; float32
/// accumulation (golden/README.md §6 tolerances hold on the CPU backend).
///
/// Thread rules: an Engine is used by one thread at a time (the worker's engine loop); it may
/// use a thread pool internally. The cache memory must not be touched by others during a call.
/// Errors: InvalidArgument for a malformed batch (token out of range, block table too short,
/// position beyond max_position_embeddings, missing prev_hidden); nothing is written then.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pd/common/result.h"
#include "pd/engine/kernels.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/model_config.h"

namespace pd::comm {
class Communicator;
}  // namespace pd::comm

namespace pd::model {

/// New tokens of one sequence.
struct SequenceChunk {
  std::span<const std::int32_t> tokens;
  /// Cache position of tokens[0]; positions [0, start_pos) are already cached.
  std::int64_t start_pos = 0;
  /// Cache blocks holding positions [0, start_pos + tokens.size()).
  std::span<const std::int32_t> block_table;
  /// forwardMtp only: [tokens.size(), hidden_size] main-model final hidden states (after
  /// model.norm), row i pairing with tokens[i].
  std::span<const float> prev_hidden;
  /// RoPE position = cache position + rope_offset. 0 except for a cache that does not start at
  /// position 0 (the golden `mtp_logits` run, which skips position 0).
  std::int64_t rope_offset = 0;
};

enum class AttentionPath {
  Auto,      ///< Prefill for chunks of more than a few tokens, Absorbed otherwise
  Prefill,   ///< up-project the cached latents to per-head K/V, then attention per head
  Absorbed,  ///< W_UK folded into the query, attention over the latents, W_UV applied after
};

enum class OutputRows {
  None,
  Last,  ///< one row per sequence: its last new token
  All,   ///< one row per new token, sequences in batch order
};

/// Receives each layer's latent KV as soon as it is computed. Called on the engine thread.
class LatentKvSink {
 public:
  virtual ~LatentKvSink() = default;
  /// `latent` is [n, latent_dim] float32 for cache positions [start_pos, start_pos + n) of
  /// batch[sequence], KV layer `kv_layer` (main layers, then MTP). Valid only during the call.
  virtual void onLayer(std::int64_t kv_layer, std::size_t sequence, std::int64_t start_pos,
                       std::span<const float> latent) = 0;
};

/// Intermediate values for tests and diagnostics (filled only when requested).
struct ForwardTrace {
  std::vector<float> layer_hidden;     ///< [layers run, tokens, hidden]: residual after each layer
  std::vector<std::int32_t> topk_idx;  ///< [MoE layers run, tokens, experts_per_tok], descending biased score
  std::vector<float> topk_weight;      ///< same shape: routing weights (scaled)
  std::vector<float> mtp_input;        ///< forwardMtp: eh_proj output [tokens, hidden]
};

struct ForwardOptions {
  AttentionPath attention = AttentionPath::Auto;
  OutputRows logits = OutputRows::Last;
  OutputRows hidden = OutputRows::None;  ///< final hidden states (after the final norm)
  LatentKvSink* sink = nullptr;
  ForwardTrace* trace = nullptr;
  /// forwardMtp: zero the token embedding at RoPE position 0 (vLLM's convention; golden
  /// `mtp_logits_vllm`). Off by default: pdserve follows SGLang and zeroes nothing.
  bool mtp_zero_position0_embedding = false;
};

/// What a call read, for bandwidth accounting (bench engine).
struct ForwardStats {
  std::uint64_t weight_bytes = 0;  ///< every weight matrix read (each expert once per call)
  std::uint64_t kv_bytes = 0;      ///< latent cache bytes read by attention
  std::int64_t experts_used = 0;   ///< distinct routed experts run, summed over layers
  std::uint64_t flops = 0;         ///< multiply-adds x 2 of every matrix product and attention
};

struct ForwardOutput {
  std::vector<float> logits;  ///< [rows, vocab_size], rows as ForwardOptions::logits says
  std::vector<float> hidden;  ///< [rows, hidden_size], rows as ForwardOptions::hidden says
  ForwardStats stats;
};

struct EngineCapabilities {
  std::string backend;  ///< e.g. "cpu/avx512"
  int threads = 1;
  bool mtp = false;  ///< the checkpoint has an MTP layer
  DType weight_dtype = DType::BF16;
  bool batch_invariant = false;  ///< CpuEngineOptions::batch_invariant is on
};

/// The compute backend seam.
class Engine {
 public:
  virtual ~Engine() = default;
  [[nodiscard]] virtual const ModelConfig& config() const = 0;
  [[nodiscard]] virtual EngineCapabilities capabilities() const = 0;
  /// The main model over a batch (see the file comment).
  virtual Result<ForwardOutput> forward(std::span<const SequenceChunk> batch, const LatentCacheView& cache,
                                        const ForwardOptions& options) = 0;
  /// The MTP layer over a batch; Unsupported when the checkpoint has none.
  virtual Result<ForwardOutput> forwardMtp(std::span<const SequenceChunk> batch, const LatentCacheView& cache,
                                           const ForwardOptions& options) = 0;
  /// Memory for a KV cache of config().kvLayers() layers that this engine reads and writes best: host
  /// memory by default (allocateHostCache); the CUDA engine's own GPU memory, which it then uses as
  /// its device cache directly (no host copy, no per-call upload; docs/gpu.md "The device KV pool").
  /// A cache on the device is only for this engine: other engines refuse it.
  [[nodiscard]] virtual Result<std::unique_ptr<CacheMemory>> allocateCache(std::int64_t num_blocks,
                                                                           std::int64_t block_size, DType dtype) {
    return allocateHostCache(config(), num_blocks, block_size, dtype);
  }
};

struct CpuEngineOptions {
  int threads = 0;            ///< 0 = every hardware thread
  std::optional<CpuIsa> isa;  ///< default: the best this CPU runs (detectCpuIsa())
  /// Touch every page of the memory-mapped checkpoint at creation, so that the first requests
  /// do not pay the page faults (and a decode step's time is its bandwidth, not the disk's).
  bool prefault_weights = true;
  /// Tensor parallelism (docs/tensor-parallel.md): this engine is rank tp->rank() of tp->size()
  /// and every rank of the group must make the same forward calls in the same order. The
  /// weights are that rank's shard; outputs (logits, hidden) are whole on every rank. Null or
  /// size 1: no tensor parallelism. Not owned; must outlive the engine.
  comm::Communicator* tp = nullptr;
  /// Batch-invariant numerics (docs/engine.md, "Batch-invariant mode"): a token's outputs and
  /// latent KV are bit-identical however it is batched or chunked, in a decode step or a prefill
  /// chunk, alone or with other sequences. Every forward then attends on the Absorbed path (one
  /// query at a time) and one-token products take the tiled kernels instead of the faster GEMV.
  bool batch_invariant = false;
};

/// The CPU backend over the checkpoint in `model_dir` (config.json + safetensors).
Result<std::unique_ptr<Engine>> createCpuEngine(const std::filesystem::path& model_dir,
                                                const CpuEngineOptions& options = {});

class ModelWeights;
/// The CPU backend over already-loaded weights.
Result<std::unique_ptr<Engine>> createCpuEngine(std::unique_ptr<ModelWeights> weights,
                                                const CpuEngineOptions& options = {});

}  // namespace pd::model
