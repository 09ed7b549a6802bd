#pragma once
/// Resume of a generation whose decode leg ended without a finish (docs/kv-memory.md, "Resume";
/// docs/router.md): the decode worker preempted it (its KV pool ran dry), died or drained, or
/// its stream stalled. The router knows the prompt and every token it relayed, so it opens a
/// new decode leg on a worker with room (the same or another) whose prompt is the original
/// prompt plus those tokens, prefills that, and keeps relaying into the same client stream: no
/// token repeated or missing, and `usage` as if nothing happened (the front end counts the
/// deltas). The new legs carry the tokens as resumed (DecodeOpen.resumed_token_ids,
/// PrefillSubmit.resumed_tokens) so both workers' samplers continue where the lost one was:
/// greedy and seeded sampling give the same tokens with or without resumes.
///
/// A generation is resumed at most `max_resumes` times after a failure (worker lost, stalled,
/// drained); then it fails with the leg's error, as without resume. Preemption is the
/// decode worker's flow control, not a failure — nothing is lost, and the worker preempts the
/// latest arrival first, which a resumed generation no longer is (DecodeOpen.arrival_us) — so
/// resumes after preemption are bounded by the request's deadline, not by `max_resumes`. Every
/// resume is counted on pdserve_router_resumes_total{cause}.
///
/// Thread rules: one GenerationResume per generation, used by its driving chain only (see
/// Generation in pd_backend.cpp); ResumeMetrics is thread-safe.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/metrics.h"
#include "pd/common/result.h"
#include "pd/common/worker_api.h"
#include "pd/router/completion_backend.h"

namespace pd::router {

/// Why a decode leg ended without a finish (label `cause`).
enum class ResumeCause {
  Preempted,   ///< the worker's KV pool ran dry and it gave the request up (a Preempted event)
  WorkerLost,  ///< the connection failed or was cut, or the stream ended without a last event
  Stalled,     ///< no event within the leg's deadline (stream_stall_timeout, kv_timeout)
  Drained,     ///< the worker ended the stream as Cancelled or Overloaded (its drain time ran out)
};
inline constexpr std::size_t kResumeCauseCount = 4;

/// "preempted", "worker_lost", "stalled", "drained".
[[nodiscard]] std::string_view resumeCauseName(ResumeCause cause);

/// How the last decode leg ended, as far as resuming cares.
struct LegEnd {
  bool preempted = false;            ///< a Preempted event came
  bool stalled = false;              ///< the leg's own watch fired (not the request's deadline)
  bool transport_failed = false;     ///< the connection failed or was cut (not by us)
  std::optional<ErrorCode> refused;  ///< a non-200 answer to the open: its code
  std::optional<ErrorCode> error;    ///< the worker's Error event: its code
  bool protocol_error = false;       ///< the worker broke the protocol (not resumed)
  bool kv_unreachable = false;       ///< the prefill worker could not deliver the KV to it
};

/// The cause a leg's end counts as, or nullopt when it must not be resumed (the request itself
/// is at fault, or the worker broke the protocol).
[[nodiscard]] std::optional<ResumeCause> classifyLegEnd(const LegEnd& end);

/// pdserve_router_resumes_total{cause}.
class ResumeMetrics {
 public:
  explicit ResumeMetrics(metrics::Registry& registry);
  void resumed(ResumeCause cause) const;

 private:
  std::vector<metrics::Counter*> by_cause_;
};

class GenerationResume {
 public:
  /// `metrics` must outlive this object.
  GenerationResume(std::int64_t max_resumes, const ResumeMetrics& metrics)
      : max_resumes_(max_resumes), metrics_(metrics) {}

  /// Tokens relayed to the client from the current leg, in order.
  void noteRelayed(std::span<const TokenId> ids) { generated_.insert(generated_.end(), ids.begin(), ids.end()); }
  /// Every token relayed so far, over every leg.
  [[nodiscard]] const std::vector<TokenId>& generated() const { return generated_; }
  /// Resumes so far, every cause.
  [[nodiscard]] std::int64_t resumes() const { return resumes_; }

  /// Whether a leg that ended for `cause` is resumed (always for Preempted; for the others while
  /// fewer than max_resumes were); counts it if so. A leg that produced nothing yet and was not
  /// preempted is the caller's plain retry instead.
  [[nodiscard]] bool take(ResumeCause cause);

  /// The next leg's open and prefill for `request`. With n >= 1 tokens so far: the prompt plus
  /// the first n - 1 of them is prefilled (they are resumed tokens), and the n-th is the leg's
  /// forced first token (PrefillSubmit.forced_first_token): the token after it is then sampled by
  /// the decode worker from a decode step's logits, as in the uninterrupted generation, not from
  /// the prefill path's, which differ in the last bits (docs/kv-memory.md, "Same tokens"). The
  /// leg streams that n-th token again first: skipFirst(). max_tokens
  /// is the request's less n - 1 (at least 1: the caller finishes a generation that already has
  /// max_tokens).
  void shapeOpen(const GenerationRequest& request, worker_api::DecodeOpen& open) const;
  void shapePrefill(const GenerationRequest& request, worker_api::PrefillSubmit& submit) const;
  /// The token the next leg streams first and the client already has (nullopt without tokens).
  [[nodiscard]] std::optional<TokenId> skipFirst() const;
  /// The worker request id of leg `attempt` of a generation: the request's id, then "-retry<n>"
  /// or, once resumed, "-resume<n>" (unique among a worker's live requests).
  [[nodiscard]] std::string legId(const std::string& request_id, std::int64_t attempt) const;

 private:
  const std::int64_t max_resumes_;
  const ResumeMetrics& metrics_;
  std::vector<TokenId> generated_;
  std::int64_t resumes_ = 0;
  std::int64_t failure_resumes_ = 0;  // the ones max_resumes bounds
};

}  // namespace pd::router
