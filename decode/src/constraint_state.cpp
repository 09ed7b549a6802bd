#include "constraint_state.h"

namespace pd::decode {

ConstraintState::ConstraintState(std::shared_ptr<const structured::Grammar> grammar)
    : mask_(grammar->vocabulary().maskWords()), matcher_(std::move(grammar)) {}

std::span<const std::uint64_t> ConstraintState::mask() {
  matcher_.fillMask(mask_);
  return mask_;
}

Status ConstraintState::accept(pd::TokenId token) {
  return matcher_.accept(token);
}

std::size_t ConstraintState::acceptablePrefix(std::span<const std::int32_t> drafts) {
  std::size_t n = 0;
  while (n < drafts.size() && !matcher_.isTerminated() && matcher_.accept(drafts[n]).ok()) ++n;
  matcher_.rollback(n);
  return n;
}

}  // namespace pd::decode
