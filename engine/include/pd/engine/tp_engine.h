#pragma once
/// Tensor parallelism for the decode worker (docs/tensor-parallel.md). Rank 0, the leader, runs
/// the worker (HTTP API, scheduler, KV pool accounting) and drives a TpLeaderEngine: a
/// model::Engine that, on every forward / forwardMtp call, first broadcasts the call (the batch:
/// tokens, positions, block tables, MTP hidden inputs; the options; the cache geometry) to the
/// other ranks, then runs its own shard of the same forward. Ranks 1.. run runTpFollower(): they
/// receive each call and run it on their own shard and their own copy of the latent KV cache
/// (MLA's latent KV is replicated per rank; every rank's pool has the same block ids, so the
/// leader's block tables are valid on every rank). The collectives inside the sharded forward
/// (communicator.h) keep the ranks in step; every rank ends a call with the same logits.
///
/// Besides forward calls, the leader relays KV expectations: expectKv(request) before the
/// request's descriptor (which lists every rank's KV target) is handed out, so that each
/// follower's transport accepts the prefill worker's writes into its pool copy (TpFollowerWorker,
/// tp_worker.h); and grantKv(descriptor) once the request's blocks are known, so that each
/// follower's transport confines those writes to the request's blocks as the leader's does. The
/// grant is opaque bytes here (the engine does not know the KV wire format).
///
/// Thread rules: a TpLeaderEngine is a model::Engine (one thread at a time calls forward /
/// forwardMtp); expectKv / cancelKv may come from any thread (they wait for a running step).
/// runTpFollower() blocks its calling thread until the leader stops the group or a rank fails.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "pd/comm/communicator.h"
#include "pd/common/result.h"
#include "pd/engine/device_sampling.h"
#include "pd/engine/engine.h"
#include "pd/engine/latent_cache.h"

namespace pd::model {

/// The cache geometry a call runs on; a follower's cache must match it.
struct TpCacheGeometry {
  DType dtype = DType::F32;
  std::int64_t latent_dim = 0;
  std::int64_t block_size = 0;
  std::int64_t num_blocks = 0;
  std::int64_t layers = 0;
  bool operator==(const TpCacheGeometry&) const = default;
};

class TpLeaderEngine : public model::Engine {
 public:
  /// `local` is rank 0's shard engine (created with CpuEngineOptions::tp = &comm); `comm` is
  /// rank 0 of the group and must outlive this object.
  TpLeaderEngine(std::unique_ptr<model::Engine> local, comm::Communicator& comm);
  /// Stops the followers (best effort: a broken group is left as it is).
  ~TpLeaderEngine() override;
  TpLeaderEngine(const TpLeaderEngine&) = delete;
  TpLeaderEngine& operator=(const TpLeaderEngine&) = delete;

  [[nodiscard]] const ModelConfig& config() const override { return local_->config(); }
  [[nodiscard]] model::EngineCapabilities capabilities() const override;
  /// Broadcast, then the local shard's forward. A communication failure (PeerFailed / Timeout)
  /// breaks the group: every later call fails with it.
  Result<model::ForwardOutput> forward(std::span<const model::SequenceChunk> batch, const model::LatentCacheView& cache,
                                       const model::ForwardOptions& options) override;
  Result<model::ForwardOutput> forwardMtp(std::span<const model::SequenceChunk> batch,
                                          const model::LatentCacheView& cache,
                                          const model::ForwardOptions& options) override;
  /// Rank 0's shard's memory (the CUDA engine's GPU memory, host memory otherwise): the
  /// followers' caches come from their own shards the same way (engineTpCache, TpFollowerWorker).
  [[nodiscard]] Result<std::unique_ptr<model::CacheMemory>> allocateCache(std::int64_t num_blocks,
                                                                          std::int64_t block_size,
                                                                          DType dtype) override {
    return local_->allocateCache(num_blocks, block_size, dtype);
  }
  /// Tells the followers to return from runTpFollower(); later calls fail. Idempotent.
  Status stop();
  /// Tells every follower to expect request `request_id`'s KV for `timeout_ms` (their
  /// transports' expect()); call before the descriptor goes out. Errors as forward().
  Status expectKv(std::uint64_t request_id, std::uint32_t timeout_ms);
  /// Hands every follower the granted KV descriptor (`grant`, encoded by the caller) of request
  /// `request_id` for its transport's grant (TpFollowerHooks::grant_kv) and waits until every
  /// follower has answered. The answer: per rank (index = rank; rank 0's entry is empty), the
  /// block ids that rank's transport receives at when they are its own (a rank on the staging
  /// path: exactly `blocks` ids, its staging blocks), or empty (the descriptor's block ids).
  /// Internal naming how many ranks could not apply the grant (the group stays usable).
  /// Communication errors as forward(). Call after expectKv for the same request.
  Result<std::vector<std::vector<std::uint32_t>>> grantKv(std::uint64_t request_id, std::span<const std::byte> grant,
                                                          std::uint32_t blocks);
  /// Once rank 0's KV of `request_id` has arrived: waits (at most `timeout_ms`) until every
  /// follower's has landed in its pool too (TpFollowerHooks::await_kv). Internal naming how many
  /// ranks do not hold it (the group stays usable); communication errors as forward().
  Status awaitKv(std::uint64_t request_id, std::uint32_t timeout_ms);
  /// Tells every follower to stop expecting `request_id` (abort, deadline, failure).
  Status cancelKv(std::uint64_t request_id);
  /// The group (rank 0): for exchangeKvTargets() at start-up, before any forward call.
  [[nodiscard]] comm::Communicator& comm() { return comm_; }
  /// Whether the group is broken (a communication failure, or markBroken()); never blocks, so a
  /// readiness probe may ask it from any thread.
  [[nodiscard]] bool broken() const { return failed_.load(); }
  /// Breaks the group from outside (e.g. the process saw a follower exit while idle): every later
  /// call fails with `why` (no-op if already broken or stopped). Waits for a running step.
  void markBroken(Error why);

 protected:
  /// A sampled forward (TpSamplingLeaderEngine): broadcast as such, so that followers run their
  /// shard's forwardSampled too (greedy rows: the collectives are the same, and no logits cross
  /// to their host), then the local engine's forwardSampled.
  Result<model::SampledForward> sampledCall(std::span<const model::SequenceChunk> batch,
                                            const model::LatentCacheView& cache, const model::ForwardOptions& options,
                                            std::span<const model::RowSample> rows);

 private:
  Result<model::ForwardOutput> call(bool mtp, std::span<const model::SequenceChunk> batch,
                                    const model::LatentCacheView& cache, const model::ForwardOptions& options);

  Status send(std::vector<std::byte> message);
  // A communication failure (PeerFailed / Timeout) of a call breaks the group; others do not.
  // Called with mu_ held.
  void noteFailure(const Error& e);
  // Any failure of a relay's own collective breaks the group (the ranks may be out of step).
  // Returns `s`. Called with mu_ held.
  Status breakOnFailure(Status s);

  std::unique_ptr<model::Engine> local_;
  comm::Communicator& comm_;
  std::mutex mu_;                    // one collective sequence at a time (forward vs expectKv from other threads)
  std::optional<Error> broken_;      // guarded by mu_
  std::atomic<bool> failed_{false};  // broken_ is set (readable without mu_)
  bool stopped_ = false;
};

/// A TpLeaderEngine whose local engine samples where it computes (a model::SamplingEngine: the
/// CUDA engine): the decode worker's verifier then samples on rank 0's device through it, and
/// only the sampled tokens cross to the host.
class TpSamplingLeaderEngine final : public TpLeaderEngine, public model::SamplingEngine {
 public:
  /// `local` must be a model::SamplingEngine (makeTpLeaderEngine checks).
  TpSamplingLeaderEngine(std::unique_ptr<model::Engine> local, comm::Communicator& comm)
      : TpLeaderEngine(std::move(local), comm) {}
  Result<model::SampledForward> forwardSampled(std::span<const model::SequenceChunk> batch,
                                               const model::LatentCacheView& cache,
                                               const model::ForwardOptions& options,
                                               std::span<const model::RowSample> rows) override {
    return sampledCall(batch, cache, options, rows);
  }
};

/// The leader over `local`: a TpSamplingLeaderEngine when `local` is a model::SamplingEngine,
/// else a TpLeaderEngine.
[[nodiscard]] std::unique_ptr<TpLeaderEngine> makeTpLeaderEngine(std::unique_ptr<model::Engine> local,
                                                                 comm::Communicator& comm);

/// Where a follower's cache comes from: called with each call's geometry, returns the view to
/// use (or an error, which fails that call on this rank — and so, through the collectives, the
/// group).
using TpCacheProvider = std::function<Result<model::LatentCacheView>(const TpCacheGeometry&)>;

/// A provider over a fixed cache (a worker's registered KV pool): InvalidArgument if a call's
/// geometry differs from it.
TpCacheProvider fixedTpCache(model::LatentCacheView view);
/// A provider that allocates (and reallocates on a geometry change) a cache of its own, for
/// followers of a leader whose caches come and go (tests, `generate`).
TpCacheProvider ownedTpCache();
/// ownedTpCache() in the memory `engine` allocates (Engine::allocateCache: the CUDA engine's GPU
/// memory, which its steps use in place; host memory otherwise): a prefill follower's cache.
/// `engine` must outlive the provider.
TpCacheProvider engineTpCache(model::Engine& engine);

/// What a follower does with the leader's KV expectations (TpLeaderEngine::expectKv / grantKv /
/// cancelKv).
struct TpFollowerHooks {
  std::function<void(std::uint64_t request_id, std::uint32_t timeout_ms)> expect_kv;
  std::function<void(std::uint64_t request_id)> cancel_kv;
  /// TpLeaderEngine::awaitKv: true once request_id's KV has landed in this rank's pool, waiting
  /// for it at most timeout_ms; false when it did not (failed, cancelled, never expected, late).
  /// Absent: false.
  std::function<bool(std::uint64_t request_id, std::uint32_t timeout_ms)> await_kv;
  /// TpLeaderEngine::grantKv's request, bytes and block count: once this rank's transport is
  /// confined by them, the block ids it receives at when they are its own (exactly `blocks` of
  /// them: the staging path's staging blocks) or an empty list (the descriptor's); nullopt when it
  /// could not apply the grant. Absent: the follower answers nullopt (nothing to confine with).
  std::function<std::optional<std::vector<std::uint32_t>>(std::uint64_t request_id, std::span<const std::byte> grant,
                                                          std::uint32_t blocks)>
      grant_kv;
};

/// Runs follower rank comm.rank() (>= 1): receives each call from rank 0 and runs it on
/// `engine` (this rank's shard, created with CpuEngineOptions::tp = &comm). A sampled call runs
/// as forwardSampled with greedy rows when `engine` is a model::SamplingEngine, else as forward. Returns OK when the
/// leader stopped the group, or the communication error that ended it. A call that fails input
/// validation fails the same way on the leader, so the loop goes on after it.
Status runTpFollower(model::Engine& engine, comm::Communicator& comm, const TpCacheProvider& cache,
                     const TpFollowerHooks& hooks = {});

}  // namespace pd::model
