#pragma once
/// The paged latent-KV cache the engine reads and writes: per KV layer (main layers, then the
/// MTP layer) a region [num_blocks][block_size] of tokens, each a latent of latent_dim values
/// stored as F32, BF16 or FP8 with tile scales (pd/common/kv_format.h: kvTokenBytes), where a
/// token's latent is (normalized c_kv [kv_lora_rank] ‖ RoPE'd k_pe [qk_rope_head_dim]).
/// A sequence owns a list of block ids; position p lives in block_table[p / block_size] at
/// offset p % block_size (DESIGN §4).
///
/// Thread rules: LatentCacheView is a plain value; whoever owns the memory decides who may
/// write it (the engine writes only during forward calls, on the engine thread).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pd/common/dtype.h"
#include "pd/common/kv_format.h"
#include "pd/common/result.h"
#include "pd/engine/model_config.h"

namespace pd::model {

/// Non-owning description of cache memory (a PagedLatentCache, or a worker's registered pool).
struct LatentCacheView {
  DType dtype = DType::F32;     ///< F32, BF16 or F8E4M3 (kv_format.h)
  std::int64_t latent_dim = 0;  ///< kv_lora_rank + qk_rope_head_dim
  std::int64_t block_size = 0;  ///< tokens per block
  std::int64_t num_blocks = 0;
  std::vector<std::byte*> layers;  ///< base of each KV layer's region
  /// Optional, one per block: a counter the cache's owner bumps whenever a block's contents may
  /// change other than by an engine's own forward writes (the block handed to a new owner, KV
  /// landed into it, a block copied into it). An engine that keeps a copy of the cache (the CUDA
  /// engine's device cache, model::CacheResidency) re-reads a block whose counter moved and
  /// trusts the positions it already holds otherwise. Empty: unknown, every needed position is
  /// re-read on every call.
  std::span<const std::uint64_t> block_epochs;
  /// The layers are GPU memory (device `device`) that only the engine which allocated it reads or
  /// writes (Engine::allocateCache): host code never dereferences them (readLatent / writeLatent
  /// refuse such a view); it goes through the owning CacheMemory.
  bool on_device = false;
  int device = -1;

  /// Address of `layer`'s slot for token `offset` of `block`.
  [[nodiscard]] std::byte* slot(std::int64_t layer, std::int64_t block, std::int64_t offset) const {
    return layers[static_cast<std::size_t>(layer)] +
           static_cast<std::size_t>(block * block_size + offset) * tokenBytes();
  }
  /// Bytes of one token's latent (kvTokenBytes(dtype, latent_dim)).
  [[nodiscard]] std::size_t tokenBytes() const { return kvTokenBytes(dtype, latent_dim); }
};

/// Reads the latent of position `pos` of a sequence as float32 into out[0, latent_dim).
void readLatent(const LatentCacheView& cache, std::int64_t layer, std::span<const std::int32_t> block_table,
                std::int64_t pos, float* out);
/// Writes float32 values into position `pos` (encodeKvToken: rounded to nearest even for BF16,
/// quantized per tile for F8E4M3).
void writeLatent(const LatentCacheView& cache, std::int64_t layer, std::span<const std::int32_t> block_table,
                 std::int64_t pos, const float* values);

/// Whether `bytes` of whole tokens from slot `first_slot` of `layer` lie inside the cache's
/// num_blocks x block_size slots (CacheMemory::readTokens / writeTokens check runs with it).
[[nodiscard]] bool tokenRunInCache(const LatentCacheView& cache, std::int64_t layer, std::int64_t first_slot,
                                   std::size_t bytes);

/// Cache memory and how the host reaches it: host memory (HostCacheMemory), or GPU memory that an
/// engine allocated for itself (Engine::allocateCache: the CUDA engine's device KV pool). The
/// view's layer regions are equally spaced (one stride between consecutive layers), each at
/// least num_blocks x block_size tokens (an engine may keep blocks of its own after them).
/// Thread rules: as for the view; the methods run on the thread that owns the cache's writes.
class CacheMemory {
 public:
  CacheMemory() = default;
  virtual ~CacheMemory() = default;
  CacheMemory(const CacheMemory&) = delete;
  CacheMemory& operator=(const CacheMemory&) = delete;
  CacheMemory(CacheMemory&&) = delete;
  CacheMemory& operator=(CacheMemory&&) = delete;

  [[nodiscard]] virtual const LatentCacheView& view() const = 0;
  /// Bytes from view().layers.front() to the end of the allocation (a transport registers these).
  [[nodiscard]] virtual std::size_t bytes() const = 0;
  /// "host", or "cuda:N".
  [[nodiscard]] virtual std::string location() const = 0;
  /// Copies block `src` over block `dst` in every layer (ids checked by the caller).
  [[nodiscard]] virtual Status copyBlock(std::int32_t src, std::int32_t dst) = 0;
  /// Writes `tokens` (whole tokens of view().tokenBytes() bytes, as kv_format.h encodes them) into
  /// consecutive slots of `layer` from `first_slot` (slot = block * block_size + offset).
  [[nodiscard]] virtual Status writeTokens(std::int64_t layer, std::int64_t first_slot,
                                           std::span<const std::byte> tokens) = 0;
  /// Reads consecutive slots of `layer` from `first_slot` into `tokens` (whole tokens).
  [[nodiscard]] virtual Status readTokens(std::int64_t layer, std::int64_t first_slot,
                                          std::span<std::byte> tokens) const = 0;
  /// Positions [0, count) of a sequence's blocks in `layer` as float32 (count x latent_dim values),
  /// through readTokens: for any memory, a device cache included.
  [[nodiscard]] Status readLatents(std::int64_t layer, std::span<const std::int32_t> block_table, std::int64_t count,
                                   float* out) const;
};

/// Host memory: a PagedLatentCache's.
[[nodiscard]] Result<std::unique_ptr<CacheMemory>> allocateHostCache(const ModelConfig& config, std::int64_t num_blocks,
                                                                     std::int64_t block_size, DType dtype);

/// Cache memory owned in this process (tests, the CLI, a prefill worker's local cache).
/// Move-only; thread rules as for the view.
class PagedLatentCache {
 public:
  /// `layers` regions of num_blocks x block_size tokens. InvalidArgument for a dtype other than
  /// F32/BF16/F8E4M3 or non-positive sizes; ResourceExhausted if the allocation fails.
  static Result<PagedLatentCache> create(std::int64_t layers, std::int64_t latent_dim, std::int64_t num_blocks,
                                         std::int64_t block_size, DType dtype);
  /// One layer per KV layer of `config` (main layers + MTP layers).
  static Result<PagedLatentCache> create(const ModelConfig& config, std::int64_t num_blocks, std::int64_t block_size,
                                         DType dtype = DType::F32);

  [[nodiscard]] const LatentCacheView& view() const { return view_; }
  [[nodiscard]] std::size_t bytes() const { return bytes_; }

 private:
  PagedLatentCache(std::unique_ptr<std::byte[]> storage, std::size_t bytes, LatentCacheView view);

  std::unique_ptr<std::byte[]> storage_;
  std::size_t bytes_ = 0;
  LatentCacheView view_;
};

}  // namespace pd::model
