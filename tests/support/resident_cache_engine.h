#pragma once
// A model::Engine that runs another engine on a private copy of the cache, kept up to date only
// through model::CacheResidency, the way the CUDA engine keeps its device cache: before each call
// the ranges CacheResidency returns are copied host -> copy, then every position the call reads
// is compared with the host cache (a stale position is a test failure, counted in
// stale_positions), the inner engine runs on the copy, and the positions it wrote are copied
// back into the host cache (the CUDA engine's host mirror). So a decode test run through it checks,
// in every build, that the pool's block epochs and the residency rules never leave a position
// stale, whatever the decode engine does (forks, local prefill on a scratch cache, preemption,
// pools shared by several engines).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include "pd/engine/cache_residency.h"
#include "pd/engine/engine.h"
#include "pd/engine/latent_cache.h"

namespace pd::test_support {

class ResidentCacheEngine final : public model::Engine {
 public:
  explicit ResidentCacheEngine(model::Engine& inner) : inner_(inner) {}
  [[nodiscard]] const pd::ModelConfig& config() const override { return inner_.config(); }
  [[nodiscard]] model::EngineCapabilities capabilities() const override { return inner_.capabilities(); }
  pd::Result<model::ForwardOutput> forward(std::span<const model::SequenceChunk> batch,
                                           const model::LatentCacheView& cache,
                                           const model::ForwardOptions& options) override {
    return run(batch, cache, options, false);
  }
  pd::Result<model::ForwardOutput> forwardMtp(std::span<const model::SequenceChunk> batch,
                                              const model::LatentCacheView& cache,
                                              const model::ForwardOptions& options) override {
    return run(batch, cache, options, true);
  }

  std::int64_t stale_positions = 0;   ///< positions read stale: must stay 0
  std::int64_t copied_positions = 0;  ///< positions copied host -> copy (each for its layer group)
  std::int64_t read_positions = 0;    ///< positions the calls read

 private:
  pd::Result<model::ForwardOutput> run(std::span<const model::SequenceChunk> batch, const model::LatentCacheView& cache,
                                       const model::ForwardOptions& options, bool mtp) {
    const std::int64_t main_layers = config().num_hidden_layers;
    const std::int64_t first_layer = mtp ? main_layers : 0;
    const std::int64_t end_layer = mtp ? static_cast<std::int64_t>(cache.layers.size()) : main_layers;
    if (!copy_ || copy_->view().num_blocks != cache.num_blocks || copy_->view().block_size != cache.block_size ||
        copy_->view().dtype != cache.dtype || copy_->view().layers.size() != cache.layers.size()) {
      auto c = model::PagedLatentCache::create(static_cast<std::int64_t>(cache.layers.size()), cache.latent_dim,
                                               cache.num_blocks, cache.block_size, cache.dtype);
      EXPECT_TRUE(c.ok());
      if (!c.ok()) return c.error();
      copy_.emplace(std::move(c).value());
      main_.forget();
      mtp_.forget();
    }
    const model::LatentCacheView& dev = copy_->view();
    const std::size_t slot_bytes = static_cast<std::size_t>(cache.latent_dim) * dtypeSize(cache.dtype);
    model::CacheResidency& residency = mtp ? mtp_ : main_;
    for (const model::CacheResidency::Range& r : residency.prepare(batch, cache)) {
      for (std::int64_t l = first_layer; l < end_layer; ++l) {
        std::memcpy(dev.slot(l, r.block, r.first), cache.slot(l, r.block, r.first),
                    static_cast<std::size_t>(r.count) * slot_bytes);
      }
      copied_positions += r.count;
    }
    for (const model::SequenceChunk& s : batch) {
      for (std::int64_t p = 0; p < s.start_pos; ++p) {
        const std::int32_t b = s.block_table[static_cast<std::size_t>(p / cache.block_size)];
        for (std::int64_t l = first_layer; l < end_layer; ++l) {
          if (std::memcmp(dev.slot(l, b, p % cache.block_size), cache.slot(l, b, p % cache.block_size), slot_bytes) !=
              0) {
            ++stale_positions;
            break;
          }
        }
        ++read_positions;
      }
    }
    auto out = mtp ? inner_.forwardMtp(batch, dev, options) : inner_.forward(batch, dev, options);
    if (!out.ok()) {
      residency.forget();
      return out;
    }
    for (const model::SequenceChunk& s : batch) {
      const std::int64_t end = s.start_pos + static_cast<std::int64_t>(s.tokens.size());
      for (std::int64_t p = s.start_pos; p < end; ++p) {
        const std::int32_t b = s.block_table[static_cast<std::size_t>(p / cache.block_size)];
        for (std::int64_t l = first_layer; l < end_layer; ++l) {
          std::memcpy(cache.slot(l, b, p % cache.block_size), dev.slot(l, b, p % cache.block_size), slot_bytes);
        }
      }
    }
    return out;
  }

  model::Engine& inner_;
  std::optional<model::PagedLatentCache> copy_;
  model::CacheResidency main_;
  model::CacheResidency mtp_;
};

}  // namespace pd::test_support
