#pragma once
/// The decode worker's Prometheus series (docs/configuration.md, "Decode worker metrics"): KV pool
/// occupancy, sequences by state, requests by outcome, refusals, tokens, steps, MTP drafts and the
/// step time. The KV transport publishes its own `pdserve_kv_*` families into the same registry
/// (kvtransfer/metrics.h).
///
/// Thread rules: thread-safe (the children are lock-free; they are looked up once here), except
/// setPrefixCache (engine thread only). The
/// engine thread updates most series; HTTP threads count refusals and read the gauges back for
/// /v1/internal/status.

#include <array>
#include <cstdint>

#include "pd/common/metrics.h"
#include "pd/common/result.h"

namespace pd::decode {

/// How a request that was admitted ended (label `outcome` of pdserve_decode_requests_total).
enum class RequestOutcome {
  Stop,       ///< EOS or a stop token id
  Length,     ///< max_tokens
  Aborted,    ///< the client went away or the router cancelled
  Timeout,    ///< the KV did not arrive before the deadline
  KvFailed,   ///< the prefill side failed (every attempt) or its record did not match
  Error,      ///< the decode step failed
  Preempted,  ///< the pool ran dry and this request gave its blocks up (the router resumes it)
};
inline constexpr std::size_t kRequestOutcomeCount = 7;

/// "stop", "length", "aborted", "timeout", "kv_failed", "error", "preempted".
[[nodiscard]] const char* requestOutcomeName(RequestOutcome outcome);

class DecodeMetrics {
 public:
  /// Registers the families in `registry`, which must outlive this object.
  explicit DecodeMetrics(metrics::Registry& registry);

  void requestEnded(RequestOutcome outcome);
  /// An open refused before admission or by it (label `code`: the ErrorCode name).
  void refused(ErrorCode code);
  /// One decode step: its wall time, the tokens it emitted, the drafts it proposed and accepted.
  void stepDone(double seconds, std::int64_t tokens, std::int64_t drafts_proposed, std::int64_t drafts_accepted);
  /// A prefill failure absorbed because attempts remained.
  void prefillRetried();
  /// A request preempted because a step could not get a block (pdserve_decode_preemptions_total).
  void preempted();
  /// A prompt prefilled by this worker itself (DecodeRequest::local_prompt): its tokens and time.
  void localPrefilled(std::int64_t tokens, double seconds);
  /// Prompt tokens an admission found in the decode prefix cache.
  void prefixHit(std::int64_t tokens);
  /// The prefix cache's blocks now and its evictions since the engine started (the counter moves by
  /// the difference). Engine thread only.
  void setPrefixCache(std::int64_t blocks, std::int64_t evictions_total);

  /// Pool blocks: free (on the free list; in use = total - free), available to a new admission
  /// (free minus the admission headroom), total, and
  /// quarantined (held after an rma request ended while its KV could still be written;
  /// neither free nor available).
  void setBlocks(std::int64_t free, std::int64_t available, std::int64_t total, std::int64_t quarantined = 0);
  /// Requests waiting for their KV (and their prompt tokens), ready ones waiting for a batch
  /// slot, and running ones.
  void setSequences(std::int64_t waiting_kv, std::int64_t waiting_kv_tokens, std::int64_t queued, std::int64_t running);

  /// The gauges as last set (what /v1/internal/status reports).
  struct Snapshot {
    std::int64_t free_blocks = 0;
    std::int64_t available_blocks = 0;  ///< what a new admission may take (free minus the headroom)
    std::int64_t total_blocks = 0;
    std::int64_t quarantined_blocks = 0;
    std::int64_t waiting_kv = 0;
    std::int64_t waiting_kv_tokens = 0;
    std::int64_t queued = 0;
    std::int64_t running = 0;
    std::int64_t drafts_proposed = 0;  ///< since start
    std::int64_t drafts_accepted = 0;  ///< since start
    std::int64_t preemptions = 0;      ///< since start
    std::int64_t prefix_cache_blocks = 0;
  };
  [[nodiscard]] Snapshot snapshot() const;

 private:
  metrics::Registry& registry_;
  std::array<metrics::Counter*, kRequestOutcomeCount> requests_{};
  metrics::Family<metrics::Counter>* refused_ = nullptr;
  metrics::Counter* tokens_ = nullptr;
  metrics::Counter* steps_ = nullptr;
  metrics::Counter* drafts_proposed_ = nullptr;
  metrics::Counter* drafts_accepted_ = nullptr;
  metrics::Counter* retries_ = nullptr;
  metrics::Counter* preemptions_ = nullptr;
  metrics::Counter* local_prefills_ = nullptr;
  metrics::Counter* local_prefill_tokens_ = nullptr;
  metrics::Counter* local_prefill_seconds_ = nullptr;
  metrics::Histogram* step_seconds_ = nullptr;
  metrics::Gauge* blocks_free_ = nullptr;
  metrics::Gauge* blocks_used_ = nullptr;
  metrics::Gauge* blocks_available_ = nullptr;
  metrics::Gauge* blocks_total_ = nullptr;
  metrics::Gauge* blocks_quarantined_ = nullptr;
  metrics::Gauge* waiting_kv_ = nullptr;
  metrics::Gauge* waiting_kv_tokens_ = nullptr;
  metrics::Gauge* queued_ = nullptr;
  metrics::Gauge* running_ = nullptr;
  metrics::Counter* prefix_hit_tokens_ = nullptr;
  metrics::Gauge* prefix_blocks_ = nullptr;
  metrics::Counter* prefix_evictions_ = nullptr;
  std::int64_t evictions_seen_ = 0;  // engine thread only (setPrefixCache)
};

}  // namespace pd::decode
