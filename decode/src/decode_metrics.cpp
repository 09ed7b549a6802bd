#include "pd/decode/decode_metrics.h"

#include <string>
#include <vector>

namespace pd::decode {
namespace {

// 1 ms .. 10 s: a CPU step of a tiny model is about a millisecond, a big batch seconds.
std::vector<double> stepBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};
}

}  // namespace

const char* requestOutcomeName(RequestOutcome outcome) {
  switch (outcome) {
    case RequestOutcome::Stop:
      return "stop";
    case RequestOutcome::Length:
      return "length";
    case RequestOutcome::Aborted:
      return "aborted";
    case RequestOutcome::Timeout:
      return "timeout";
    case RequestOutcome::KvFailed:
      return "kv_failed";
    case RequestOutcome::Error:
      return "error";
    case RequestOutcome::Preempted:
      return "preempted";
  }
  return "error";
}

DecodeMetrics::DecodeMetrics(metrics::Registry& registry) : registry_(registry) {
  auto& requests = registry_.counter("pdserve_decode_requests_total",
                                     "Admitted decode requests that ended, by outcome.", {"outcome"});
  for (std::size_t i = 0; i < kRequestOutcomeCount; ++i) {
    requests_[i] = &requests.labels({requestOutcomeName(static_cast<RequestOutcome>(i))});
  }
  refused_ =
      &registry_.counter("pdserve_decode_refused_total",
                         "Decode opens refused (malformed, too large, pool full, draining), by error code.", {"code"});
  tokens_ = &registry_
                 .counter("pdserve_decode_generated_tokens_total",
                          "Tokens produced by decode steps (the first token of each request comes from prefill).")
                 .get();
  steps_ = &registry_.counter("pdserve_decode_steps_total", "Batched decode steps run.").get();
  drafts_proposed_ = &registry_.counter("pdserve_decode_mtp_drafts_proposed_total", "MTP draft tokens proposed.").get();
  drafts_accepted_ = &registry_
                          .counter("pdserve_decode_mtp_drafts_accepted_total",
                                   "MTP draft tokens accepted (acceptance rate = accepted / proposed).")
                          .get();
  retries_ = &registry_
                  .counter("pdserve_decode_prefill_retries_total",
                           "Prefill failures absorbed while the request kept its blocks for another attempt.")
                  .get();
  preemptions_ = &registry_
                      .counter("pdserve_decode_preemptions_total",
                               "Requests preempted because a decode step could not get a KV block (the router "
                               "resumes them).")
                      .get();
  local_prefills_ = &registry_
                         .counter("pdserve_decode_local_prefills_total",
                                  "Prompts this decode worker prefilled itself (conditional disaggregation).")
                         .get();
  local_prefill_tokens_ =
      &registry_
           .counter("pdserve_decode_local_prefill_tokens_total", "Prompt tokens this decode worker prefilled itself.")
           .get();
  local_prefill_seconds_ = &registry_
                                .counter("pdserve_decode_local_prefill_seconds_total",
                                         "Wall time of the local prefills (they run between decode steps).")
                                .get();
  step_seconds_ =
      &registry_.histogram("pdserve_decode_step_seconds", "Wall time of one batched decode step.", stepBuckets()).get();
  blocks_free_ = &registry_
                      .gauge("pdserve_kv_blocks_free",
                             "KV pool blocks a request may take: not allocated to any request (idle decode "
                             "prefix-cache blocks included).")
                      .get();
  blocks_used_ =
      &registry_.gauge("pdserve_kv_blocks_used", "KV pool blocks allocated to requests (quarantined included).").get();
  blocks_available_ = &registry_
                           .gauge("pdserve_kv_blocks_available",
                                  "KV pool blocks a new admission may take (free minus the admission headroom).")
                           .get();
  blocks_total_ = &registry_.gauge("pdserve_kv_blocks_total", "KV pool blocks.").get();
  blocks_quarantined_ = &registry_
                             .gauge("pdserve_kv_blocks_quarantined",
                                    "KV pool blocks held back after their request ended while a prefill could still "
                                    "write them (data path rma); neither free nor available.")
                             .get();
  waiting_kv_ =
      &registry_.gauge("pdserve_decode_waiting_sequences", "Admitted requests waiting for their KV from prefill.")
           .get();
  waiting_kv_tokens_ =
      &registry_.gauge("pdserve_decode_waiting_prompt_tokens", "Prompt tokens of the requests waiting for their KV.")
           .get();
  queued_ =
      &registry_.gauge("pdserve_decode_queued_sequences", "Sequences with their KV waiting for a batch slot.").get();
  running_ = &registry_.gauge("pdserve_decode_running_sequences", "Sequences in the running batch.").get();
  prefix_hit_tokens_ = &registry_
                            .counter("pdserve_decode_prefix_cache_hit_tokens_total",
                                     "Prompt tokens whose KV the decode prefix cache already held (not transferred).")
                            .get();
  prefix_blocks_ =
      &registry_.gauge("pdserve_decode_prefix_cache_blocks", "KV pool blocks the decode prefix cache holds.").get();
  prefix_evictions_ = &registry_
                           .counter("pdserve_decode_prefix_cache_evictions_total",
                                    "Decode prefix-cache blocks given back to the pool (pressure or capacity).")
                           .get();
}

void DecodeMetrics::prefixHit(std::int64_t tokens) {
  prefix_hit_tokens_->inc(static_cast<double>(tokens));
}

void DecodeMetrics::setPrefixCache(std::int64_t blocks, std::int64_t evictions_total) {
  prefix_blocks_->set(static_cast<double>(blocks));
  if (evictions_total > evictions_seen_) {
    prefix_evictions_->inc(static_cast<double>(evictions_total - evictions_seen_));
    evictions_seen_ = evictions_total;
  }
}

void DecodeMetrics::requestEnded(RequestOutcome outcome) {
  requests_[static_cast<std::size_t>(outcome)]->inc();
}

void DecodeMetrics::refused(ErrorCode code) {
  refused_->labels({std::string(errorCodeName(code))}).inc();
}

void DecodeMetrics::stepDone(double seconds, std::int64_t tokens, std::int64_t drafts_proposed,
                             std::int64_t drafts_accepted) {
  steps_->inc();
  step_seconds_->observe(seconds);
  tokens_->inc(static_cast<double>(tokens));
  drafts_proposed_->inc(static_cast<double>(drafts_proposed));
  drafts_accepted_->inc(static_cast<double>(drafts_accepted));
}

void DecodeMetrics::prefillRetried() {
  retries_->inc();
}

void DecodeMetrics::preempted() {
  preemptions_->inc();
}

void DecodeMetrics::localPrefilled(std::int64_t tokens, double seconds) {
  local_prefills_->inc();
  local_prefill_tokens_->inc(static_cast<double>(tokens));
  local_prefill_seconds_->inc(seconds);
}

void DecodeMetrics::setBlocks(std::int64_t free, std::int64_t available, std::int64_t total, std::int64_t quarantined) {
  blocks_free_->set(static_cast<double>(free));
  blocks_used_->set(static_cast<double>(total - free));
  blocks_quarantined_->set(static_cast<double>(quarantined));
  blocks_available_->set(static_cast<double>(available));
  blocks_total_->set(static_cast<double>(total));
}

void DecodeMetrics::setSequences(std::int64_t waiting_kv, std::int64_t waiting_kv_tokens, std::int64_t queued,
                                 std::int64_t running) {
  waiting_kv_->set(static_cast<double>(waiting_kv));
  waiting_kv_tokens_->set(static_cast<double>(waiting_kv_tokens));
  queued_->set(static_cast<double>(queued));
  running_->set(static_cast<double>(running));
}

DecodeMetrics::Snapshot DecodeMetrics::snapshot() const {
  Snapshot s;
  s.free_blocks = static_cast<std::int64_t>(blocks_free_->value());
  s.available_blocks = static_cast<std::int64_t>(blocks_available_->value());
  s.total_blocks = static_cast<std::int64_t>(blocks_total_->value());
  s.quarantined_blocks = static_cast<std::int64_t>(blocks_quarantined_->value());
  s.waiting_kv = static_cast<std::int64_t>(waiting_kv_->value());
  s.waiting_kv_tokens = static_cast<std::int64_t>(waiting_kv_tokens_->value());
  s.queued = static_cast<std::int64_t>(queued_->value());
  s.running = static_cast<std::int64_t>(running_->value());
  s.drafts_proposed = static_cast<std::int64_t>(drafts_proposed_->value());
  s.drafts_accepted = static_cast<std::int64_t>(drafts_accepted_->value());
  s.preemptions = static_cast<std::int64_t>(preemptions_->value());
  s.prefix_cache_blocks = static_cast<std::int64_t>(prefix_blocks_->value());
  return s;
}

}  // namespace pd::decode
