#pragma once
/// The decode worker's latent-KV memory (DESIGN §4): one contiguous allocation holding, per KV
/// layer (main layers, then the MTP layer), a region [num_blocks][block_size] of tokens, each a
/// latent of latent_dim values in F32, BF16 or FP8 with tile scales (pd/common/kv_format.h),
/// latent_dim = kv_lora_rank + qk_rope_head_dim. It is the engine's own paged cache
/// type (model::PagedLatentCache), so forward() reads and writes it directly, and it is laid out
/// so that a kvtransfer::Transport can register it as one region and describe it with one
/// RegionLayout (layer stride and block stride constant).
///
/// Ownership: owns the memory; move-only. A transport registration must be deregistered before
/// the pool is destroyed (the pool does not hold the transport).
/// Thread rules: the memory is written by the engine thread during forward calls and by the
/// transport (remote puts) into blocks the engine has handed out and does not yet read; the
/// block epochs (enableEpochs, touch) change on the engine thread only.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pd/common/dtype.h"
#include "pd/common/result.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/model_config.h"
#include "pd/kvtransfer/transport.h"
#include "pd/kvtransfer/wire.h"

namespace pd::decode {

class KvPool {
 public:
  /// config.kvLayers() layers of num_blocks x block_size tokens. InvalidArgument for a dtype
  /// other than F32/BF16/F8E4M3 or non-positive sizes; ResourceExhausted if the memory is not there.
  [[nodiscard]] static Result<KvPool> create(const ModelConfig& config, std::int64_t num_blocks,
                                             std::int64_t block_size, DType dtype);
  /// A pool in memory an engine allocated (Engine::allocateCache): host memory, or the CUDA
  /// engine's GPU memory (onDevice(): the host never touches the pool's bytes; KV lands through
  /// the staging transport's device copier).
  [[nodiscard]] static Result<KvPool> create(std::unique_ptr<model::CacheMemory> memory);

  /// What the engine's forward() takes (with block epochs once enableEpochs() was called).
  [[nodiscard]] const model::LatentCacheView& view() const { return view_; }
  [[nodiscard]] std::int64_t numLayers() const { return static_cast<std::int64_t>(view().layers.size()); }
  [[nodiscard]] std::int64_t numBlocks() const { return view().num_blocks; }
  [[nodiscard]] std::int64_t blockSize() const { return view().block_size; }
  [[nodiscard]] std::int64_t latentDim() const { return view().latent_dim; }
  [[nodiscard]] DType dtype() const { return view().dtype; }

  /// The whole allocation, to pass to Transport::registerRegion() (device addresses when
  /// onDevice(): only a transport that never dereferences them may take it, the staging one).
  [[nodiscard]] std::span<std::byte> memory() const;
  /// Whether the pool is GPU memory, and where it is ("host", "cuda:N").
  [[nodiscard]] bool onDevice() const { return view().on_device; }
  [[nodiscard]] std::string location() const { return memory_->location(); }
  /// Writes float32 values into position `pos` of a sequence's blocks in `layer`, encoded as the
  /// pool stores them (model::writeLatent for host memory; encoded on the host and copied for a
  /// device pool). Engine thread only.
  [[nodiscard]] Status writeLatent(std::int64_t layer, std::span<const std::int32_t> block_table, std::int64_t pos,
                                   const float* values);
  /// The same for consecutive positions [start_pos, start_pos + rows.size() / latentDim()): one
  /// copy per block they cover for a device pool.
  [[nodiscard]] Status writeLatents(std::int64_t layer, std::span<const std::int32_t> block_table,
                                    std::int64_t start_pos, std::span<const float> rows);
  [[nodiscard]] std::uint64_t layerStride() const;
  [[nodiscard]] std::uint64_t blockStride() const;
  /// The layout of every layer inside the registered region `region`, for exportTarget().
  [[nodiscard]] kvtransfer::RegionLayout regionLayout(kvtransfer::RegionId region) const;
  /// The layout fields of CompatInfo this pool implies (model_hash and tp_size left to caller).
  [[nodiscard]] kvtransfer::CompatInfo compat(std::uint64_t model_hash, std::uint32_t tp_size) const;
  /// Copies block `src` into block `dst` in every layer (copy-on-write of a shared prompt's last
  /// block, KvBlockManager::fork). Engine thread only, like the model's writes; PD_CHECKs the ids.
  void copyBlock(std::int32_t src, std::int32_t dst);

  /// Publishes block epochs in view() (model::LatentCacheView::block_epochs). The owner of the
  /// block allocations turns them on (DecodeEngine) and then touch()es every block whose
  /// contents change other than by the engine's forward: each block it hands to a new owner, each
  /// block KV lands into. copyBlock touches its destination. Without them (a TP follower's pool,
  /// whose blocks the leader allocates), an engine re-reads every position it needs.
  void enableEpochs();
  /// Bumps `block`'s epoch (PD_CHECKs the id); nothing before enableEpochs().
  void touch(std::int32_t block);

 private:
  explicit KvPool(std::unique_ptr<model::CacheMemory> memory) : memory_(std::move(memory)), view_(memory_->view()) {}

  std::unique_ptr<model::CacheMemory> memory_;
  std::vector<std::uint64_t> epochs_;  // one per block once enabled; view_.block_epochs points here
  model::LatentCacheView view_;
};

}  // namespace pd::decode
