#include "constraint_state.h"

#include <chrono>

namespace pd::decode {
namespace {

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

ConstraintState::ConstraintState(std::shared_ptr<const structured::Grammar> grammar)
    : mask_(grammar->vocabulary().maskWords()), matcher_(std::move(grammar)) {}

std::span<const std::uint64_t> ConstraintState::mask() {
  const auto t0 = Clock::now();
  matcher_.fillMask(mask_);
  seconds_ += secondsSince(t0);
  return mask_;
}

Status ConstraintState::accept(pd::TokenId token) {
  const auto t0 = Clock::now();
  Status s = matcher_.accept(token);
  seconds_ += secondsSince(t0);
  return s;
}

std::size_t ConstraintState::acceptablePrefix(std::span<const std::int32_t> drafts) {
  const auto t0 = Clock::now();
  std::size_t n = 0;
  while (n < drafts.size() && !matcher_.isTerminated() && matcher_.accept(drafts[n]).ok()) ++n;
  matcher_.rollback(n);
  seconds_ += secondsSince(t0);
  return n;
}

std::vector<std::uint64_t> ConstraintState::rowMasks(std::span<const std::int32_t> drafts) {
  const auto t0 = Clock::now();
  const std::size_t words = mask_.size();
  std::vector<std::uint64_t> out;
  out.reserve((drafts.size() + 1) * words);
  std::size_t accepted = 0;
  for (std::size_t j = 0; j <= drafts.size(); ++j) {
    // mask_ keeps the last mask filled: the one a row past the grammar's reach repeats.
    const bool live = accepted == j && (j == 0 || !matcher_.isTerminated());
    if (live) {
      matcher_.fillMask(mask_);
      if (j < drafts.size() && !matcher_.isTerminated() && matcher_.accept(drafts[j]).ok()) ++accepted;
    }
    out.insert(out.end(), mask_.begin(), mask_.end());
  }
  matcher_.rollback(accepted);
  seconds_ += secondsSince(t0);
  return out;
}

}  // namespace pd::decode
