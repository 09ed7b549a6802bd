#pragma once
/// A model::Engine that wraps a real one and holds every main-model forward() at a gate until the
/// test opens it, so a test can keep an engine thread busy by construction (no timing): it waits
/// until a forward has entered, acts while the engine is held, then opens the gate.
///
/// Thread rules: forward() and forwardMtp() from the engine's thread; waitEntered(), open() and
/// entered() from any thread. open() must be called before the wrapper is destroyed if a
/// forward may be waiting.

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>

#include "pd/engine/engine.h"

namespace pd::fakes {

class GatedEngine final : public model::Engine {
 public:
  explicit GatedEngine(std::unique_ptr<model::Engine> inner) : inner_(std::move(inner)) {}

  [[nodiscard]] const ModelConfig& config() const override { return inner_->config(); }
  [[nodiscard]] model::EngineCapabilities capabilities() const override { return inner_->capabilities(); }

  Result<model::ForwardOutput> forward(std::span<const model::SequenceChunk> batch, const model::LatentCacheView& cache,
                                       const model::ForwardOptions& options) override {
    {
      std::unique_lock lock(mu_);
      ++entered_;
      cv_.notify_all();
      cv_.wait(lock, [&] { return open_; });
    }
    return inner_->forward(batch, cache, options);
  }
  Result<model::ForwardOutput> forwardMtp(std::span<const model::SequenceChunk> batch,
                                          const model::LatentCacheView& cache,
                                          const model::ForwardOptions& options) override {
    return inner_->forwardMtp(batch, cache, options);
  }

  /// Waits until `n` forwards have entered (held or passed); false at `timeout`.
  bool waitEntered(int n, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return entered_ >= n; });
  }
  /// Lets every held and later forward through.
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  std::unique_ptr<model::Engine> inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  int entered_ = 0;    // guarded by mu_
  bool open_ = false;  // guarded by mu_
};

}  // namespace pd::fakes
