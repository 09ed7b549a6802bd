#include "pd/decode/kv_pool.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "pd/common/kv_format.h"
#include "pd/engine/cache_residency.h"

namespace pd::decode {

Result<KvPool> KvPool::create(const ModelConfig& config, std::int64_t num_blocks, std::int64_t block_size,
                              DType dtype) {
  PD_ASSIGN_OR_RETURN(std::unique_ptr<model::CacheMemory> memory,
                      model::allocateHostCache(config, num_blocks, block_size, dtype));
  return create(std::move(memory));
}

Result<KvPool> KvPool::create(std::unique_ptr<model::CacheMemory> memory) {
  PD_CHECK(memory != nullptr);
  // The transport describes the pool as one region with constant strides: check that holds.
  const auto& v = memory->view();
  if (v.layers.empty() || v.num_blocks <= 0 || v.block_size <= 0) {
    return makeError(ErrorCode::InvalidArgument, "KV pool: an empty cache");
  }
  for (std::size_t l = 1; l < v.layers.size(); ++l) {
    PD_CHECK(v.layers[l] - v.layers[l - 1] == v.layers[1] - v.layers[0]);
  }
  return KvPool(std::move(memory));
}

std::span<std::byte> KvPool::memory() const {
  return {view().layers.front(), memory_->bytes()};
}

std::uint64_t KvPool::blockStride() const {
  return static_cast<std::uint64_t>(blockSize()) * view().tokenBytes();
}

std::uint64_t KvPool::layerStride() const {
  // An engine's memory may hold blocks of its own after the pool's (the CUDA engine's padding
  // blocks): the stride is the distance between layers.
  if (view().layers.size() >= 2) return static_cast<std::uint64_t>(view().layers[1] - view().layers[0]);
  return blockStride() * static_cast<std::uint64_t>(numBlocks());
}

kvtransfer::RegionLayout KvPool::regionLayout(kvtransfer::RegionId region) const {
  kvtransfer::RegionLayout layout;
  layout.region = region;
  layout.offset = 0;
  layout.first_layer = 0;
  layout.num_layers = static_cast<std::uint32_t>(numLayers());
  layout.layer_stride = layerStride();
  layout.block_stride = blockStride();
  return layout;
}

kvtransfer::CompatInfo KvPool::compat(std::uint64_t model_hash, std::uint32_t tp_size) const {
  kvtransfer::CompatInfo c;
  c.model_hash = model_hash;
  c.kv_dtype = dtype();
  c.block_size = static_cast<std::uint32_t>(blockSize());
  c.num_layers = static_cast<std::uint32_t>(numLayers());
  c.kv_dim = static_cast<std::uint32_t>(latentDim());
  c.tp_size = tp_size;
  return c;
}

void KvPool::enableEpochs() {
  if (!epochs_.empty()) return;
  epochs_.resize(static_cast<std::size_t>(numBlocks()));
  for (auto& e : epochs_) e = model::nextCacheEpoch();  // unique in the process: no two caches share one
  view_.block_epochs = epochs_;
}

void KvPool::touch(std::int32_t block) {
  PD_CHECK(block >= 0 && block < numBlocks());
  if (!epochs_.empty()) epochs_[static_cast<std::size_t>(block)] = model::nextCacheEpoch();
}

void KvPool::copyBlock(std::int32_t src, std::int32_t dst) {
  PD_CHECK(src >= 0 && src < numBlocks() && dst >= 0 && dst < numBlocks() && src != dst);
  touch(dst);
  const Status copied = memory_->copyBlock(src, dst);
  PD_CHECK_MSG(copied.ok(),
               "KV pool block copy failed");  // a device copy between valid blocks fails only if the GPU does
}

Status KvPool::writeLatent(std::int64_t layer, std::span<const std::int32_t> block_table, std::int64_t pos,
                           const float* values) {
  return writeLatents(layer, block_table, pos, std::span(values, static_cast<std::size_t>(latentDim())));
}

Status KvPool::writeLatents(std::int64_t layer, std::span<const std::int32_t> block_table, std::int64_t start_pos,
                            std::span<const float> rows) {
  const auto dim = static_cast<std::size_t>(latentDim());
  const auto n = static_cast<std::int64_t>(rows.size() / dim);
  if (!onDevice()) {
    for (std::int64_t t = 0; t < n; ++t) {
      model::writeLatent(view(), layer, block_table, start_pos + t, rows.data() + static_cast<std::size_t>(t) * dim);
    }
    return okStatus();
  }
  const std::size_t token = view().tokenBytes();
  std::vector<std::byte> run;
  for (std::int64_t t = 0; t < n;) {  // one copy per block
    const std::int64_t pos = start_pos + t;
    const auto index = static_cast<std::size_t>(pos / blockSize());
    PD_CHECK(index < block_table.size() && block_table[index] >= 0 && block_table[index] < numBlocks());
    const std::int64_t take = std::min(blockSize() - pos % blockSize(), n - t);
    run.resize(static_cast<std::size_t>(take) * token);
    for (std::int64_t i = 0; i < take; ++i) {
      encodeKvToken(dtype(), rows.subspan(static_cast<std::size_t>(t + i) * dim, dim),
                    run.data() + static_cast<std::size_t>(i) * token);
    }
    PD_TRY(memory_->writeTokens(layer, block_table[index] * blockSize() + pos % blockSize(), run));
    t += take;
  }
  return okStatus();
}

}  // namespace pd::decode
