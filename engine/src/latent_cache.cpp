#include "pd/engine/latent_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>
#include <vector>

#include "pd/common/check.h"
#include "pd/common/kv_format.h"

namespace pd::model {

namespace {
std::byte* slotOf(const LatentCacheView& cache, std::int64_t layer, std::span<const std::int32_t> block_table,
                  std::int64_t pos) {
  const auto block_index = static_cast<std::size_t>(pos / cache.block_size);
  PD_CHECK(block_index < block_table.size());
  const std::int32_t block = block_table[block_index];
  PD_CHECK(block >= 0 && block < cache.num_blocks);
  PD_CHECK_MSG(!cache.on_device, "host access to a device cache");
  return cache.slot(layer, block, pos % cache.block_size);
}
}  // namespace

void readLatent(const LatentCacheView& cache, std::int64_t layer, std::span<const std::int32_t> block_table,
                std::int64_t pos, float* out) {
  decodeKvToken(cache.dtype, slotOf(cache, layer, block_table, pos),
                std::span(out, static_cast<std::size_t>(cache.latent_dim)));
}

void writeLatent(const LatentCacheView& cache, std::int64_t layer, std::span<const std::int32_t> block_table,
                 std::int64_t pos, const float* values) {
  encodeKvToken(cache.dtype, std::span(values, static_cast<std::size_t>(cache.latent_dim)),
                slotOf(cache, layer, block_table, pos));
}

PagedLatentCache::PagedLatentCache(std::unique_ptr<std::byte[]> storage, std::size_t bytes, LatentCacheView view)
    : storage_(std::move(storage)), bytes_(bytes), view_(std::move(view)) {}

Result<PagedLatentCache> PagedLatentCache::create(std::int64_t layers, std::int64_t latent_dim, std::int64_t num_blocks,
                                                  std::int64_t block_size, DType dtype) {
  if (!isKvDType(dtype)) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("latent cache dtype must be F32, BF16 or F8_E4M3, not {}", dtypeName(dtype)));
  }
  if (layers <= 0 || latent_dim <= 0 || num_blocks <= 0 || block_size <= 0) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("latent cache sizes must be positive (layers {}, latent_dim {}, blocks {}, "
                                 "block_size {})",
                                 layers, latent_dim, num_blocks, block_size));
  }
  const auto layer_bytes = static_cast<std::size_t>(num_blocks * block_size) * kvTokenBytes(dtype, latent_dim);
  const std::size_t bytes = layer_bytes * static_cast<std::size_t>(layers);
  std::unique_ptr<std::byte[]> storage(new (std::nothrow) std::byte[bytes]());
  if (!storage) {
    return makeError(ErrorCode::ResourceExhausted, fmt::format("cannot allocate a {}-byte latent cache", bytes));
  }
  LatentCacheView view;
  view.dtype = dtype;
  view.latent_dim = latent_dim;
  view.block_size = block_size;
  view.num_blocks = num_blocks;
  for (std::int64_t l = 0; l < layers; ++l)
    view.layers.push_back(storage.get() + layer_bytes * static_cast<std::size_t>(l));
  return PagedLatentCache(std::move(storage), bytes, std::move(view));
}

bool tokenRunInCache(const LatentCacheView& cache, std::int64_t layer, std::int64_t first_slot, std::size_t bytes) {
  const std::size_t token = cache.tokenBytes();
  return layer >= 0 && layer < static_cast<std::int64_t>(cache.layers.size()) && first_slot >= 0 && token > 0 &&
         bytes % token == 0 &&
         static_cast<std::size_t>(first_slot) + bytes / token <=
             static_cast<std::size_t>(cache.num_blocks * cache.block_size);
}

namespace {
class HostCacheMemory final : public CacheMemory {
 public:
  explicit HostCacheMemory(PagedLatentCache cache) : cache_(std::move(cache)) {}
  const LatentCacheView& view() const override { return cache_.view(); }
  std::size_t bytes() const override { return cache_.bytes(); }
  std::string location() const override { return "host"; }
  Status copyBlock(std::int32_t src, std::int32_t dst) override {
    const LatentCacheView& v = cache_.view();
    const std::size_t stride = static_cast<std::size_t>(v.block_size) * v.tokenBytes();
    for (std::byte* layer : v.layers) {
      std::memcpy(layer + static_cast<std::size_t>(dst) * stride, layer + static_cast<std::size_t>(src) * stride,
                  stride);
    }
    return okStatus();
  }
  Status readTokens(std::int64_t layer, std::int64_t first_slot, std::span<std::byte> tokens) const override {
    const LatentCacheView& v = cache_.view();
    const std::size_t token = v.tokenBytes();
    if (!tokenRunInCache(v, layer, first_slot, tokens.size())) {
      return makeError(ErrorCode::InvalidArgument, "cache read outside the cache");
    }
    std::memcpy(tokens.data(), v.layers[static_cast<std::size_t>(layer)] + static_cast<std::size_t>(first_slot) * token,
                tokens.size());
    return okStatus();
  }
  Status writeTokens(std::int64_t layer, std::int64_t first_slot, std::span<const std::byte> tokens) override {
    const LatentCacheView& v = cache_.view();
    const std::size_t token = v.tokenBytes();
    if (!tokenRunInCache(v, layer, first_slot, tokens.size())) {
      return makeError(ErrorCode::InvalidArgument, "cache write outside the cache");
    }
    std::memcpy(v.layers[static_cast<std::size_t>(layer)] + static_cast<std::size_t>(first_slot) * token, tokens.data(),
                tokens.size());
    return okStatus();
  }

 private:
  PagedLatentCache cache_;
};
}  // namespace

Status CacheMemory::readLatents(std::int64_t layer, std::span<const std::int32_t> block_table, std::int64_t count,
                                float* out) const {
  const LatentCacheView& v = view();
  const std::size_t token = v.tokenBytes();
  const auto dim = static_cast<std::size_t>(v.latent_dim);
  std::vector<std::byte> run;
  for (std::int64_t p = 0; p < count;) {  // one read per block
    const auto index = static_cast<std::size_t>(p / v.block_size);
    if (index >= block_table.size() || block_table[index] < 0 || block_table[index] >= v.num_blocks) {
      return makeError(ErrorCode::InvalidArgument, "cache read: the block table does not cover the positions");
    }
    const std::int64_t offset = p % v.block_size;
    const std::int64_t n = std::min(v.block_size - offset, count - p);
    run.resize(static_cast<std::size_t>(n) * token);
    PD_TRY(readTokens(layer, block_table[index] * v.block_size + offset, run));
    for (std::int64_t i = 0; i < n; ++i) {
      decodeKvToken(v.dtype, run.data() + static_cast<std::size_t>(i) * token,
                    std::span(out + static_cast<std::size_t>(p + i) * dim, dim));
    }
    p += n;
  }
  return okStatus();
}

Result<std::unique_ptr<CacheMemory>> allocateHostCache(const ModelConfig& config, std::int64_t num_blocks,
                                                       std::int64_t block_size, DType dtype) {
  PD_ASSIGN_OR_RETURN(PagedLatentCache cache, PagedLatentCache::create(config, num_blocks, block_size, dtype));
  return std::unique_ptr<CacheMemory>(new HostCacheMemory(std::move(cache)));
}

Result<PagedLatentCache> PagedLatentCache::create(const ModelConfig& config, std::int64_t num_blocks,
                                                  std::int64_t block_size, DType dtype) {
  return create(config.kvLayers(), config.latentDim(), num_blocks, block_size, dtype);
}

}  // namespace pd::model
