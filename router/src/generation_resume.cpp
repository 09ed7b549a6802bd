#include "generation_resume.h"

#include <fmt/format.h>

#include <algorithm>

namespace pd::router {

std::string_view resumeCauseName(ResumeCause cause) {
  switch (cause) {
    case ResumeCause::Preempted:
      return "preempted";
    case ResumeCause::WorkerLost:
      return "worker_lost";
    case ResumeCause::Stalled:
      return "stalled";
    case ResumeCause::Drained:
      return "drained";
  }
  return "worker_lost";
}

namespace {

// A worker-side failure of the leg (not of the request): another leg may succeed.
std::optional<ResumeCause> fromCode(ErrorCode code) {
  switch (code) {
    case ErrorCode::Overloaded:
    case ErrorCode::Cancelled:
      return ResumeCause::Drained;
    case ErrorCode::PeerFailed:
    case ErrorCode::Io:
    case ErrorCode::Internal:
      return ResumeCause::WorkerLost;
    case ErrorCode::Timeout:
      return ResumeCause::Stalled;
    default:
      return std::nullopt;
  }
}

}  // namespace

std::optional<ResumeCause> classifyLegEnd(const LegEnd& end) {
  if (end.protocol_error) return std::nullopt;
  if (end.preempted) return ResumeCause::Preempted;
  if (end.stalled) return ResumeCause::Stalled;
  if (end.transport_failed || end.kv_unreachable) return ResumeCause::WorkerLost;
  if (end.refused) return fromCode(*end.refused);
  if (end.error) return fromCode(*end.error);
  return ResumeCause::WorkerLost;  // a clean end of the stream without a last event
}

ResumeMetrics::ResumeMetrics(metrics::Registry& registry) {
  auto& family =
      registry.counter("pdserve_router_resumes_total",
                       "Generations resumed after their decode leg ended without a finish, by cause.", {"cause"});
  for (std::size_t i = 0; i < kResumeCauseCount; ++i) {
    by_cause_.push_back(&family.labels({std::string(resumeCauseName(static_cast<ResumeCause>(i)))}));
  }
}

void ResumeMetrics::resumed(ResumeCause cause) const {
  by_cause_[static_cast<std::size_t>(cause)]->inc();
}

bool GenerationResume::take(ResumeCause cause) {
  if (cause != ResumeCause::Preempted) {
    if (failure_resumes_ >= max_resumes_) return false;
    ++failure_resumes_;
  }
  ++resumes_;
  metrics_.resumed(cause);
  return true;
}

void GenerationResume::shapeOpen(const GenerationRequest& request, worker_api::DecodeOpen& open) const {
  // The last token so far is not prefilled: it is the leg's first token (skipFirst()).
  const std::int64_t resumed = std::max<std::int64_t>(0, static_cast<std::int64_t>(generated_.size()) - 1);
  open.prompt_tokens = static_cast<std::int64_t>(request.prompt_token_ids.size()) + resumed;
  open.max_tokens = std::max<std::int64_t>(1, request.max_tokens - resumed);
  open.resumed_token_ids.assign(generated_.begin(), generated_.begin() + resumed);
}

void GenerationResume::shapePrefill(const GenerationRequest& request, worker_api::PrefillSubmit& submit) const {
  const std::int64_t resumed = std::max<std::int64_t>(0, static_cast<std::int64_t>(generated_.size()) - 1);
  submit.token_ids = request.prompt_token_ids;
  submit.token_ids.insert(submit.token_ids.end(), generated_.begin(), generated_.begin() + resumed);
  submit.resumed_tokens = resumed;
  submit.forced_first_token = generated_.empty() ? -1 : generated_.back();
}

std::optional<TokenId> GenerationResume::skipFirst() const {
  if (generated_.empty()) return std::nullopt;
  return generated_.back();
}

std::string GenerationResume::legId(const std::string& request_id, std::int64_t attempt) const {
  if (attempt == 0) return request_id;
  if (resumes_ > 0) return fmt::format("{}-resume{}", request_id, attempt);
  return fmt::format("{}-retry{}", request_id, attempt);
}

}  // namespace pd::router
