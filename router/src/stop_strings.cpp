#include "pd/router/stop_strings.h"

#include <algorithm>

namespace pd::router {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops, bool include_match)
    : include_match_(include_match) {
  for (auto& s : stops) {
    if (!s.empty()) stops_.push_back(std::move(s));
  }
}

StopStringMatcher::Step StopStringMatcher::push(std::string_view piece) {
  Step step;
  if (matched_) return step;
  held_.append(piece);
  if (stops_.empty()) {
    step.text = std::move(held_);
    held_.clear();
    return step;
  }
  // Earliest match wins; of two starting there, the longer (it decides the text when it is included).
  std::size_t first = std::string::npos;
  std::size_t length = 0;
  for (const auto& s : stops_) {
    const std::size_t at = held_.find(s);
    if (at < first || (at == first && at != std::string::npos && s.size() > length)) {
      first = at;
      length = s.size();
    }
  }
  if (first != std::string::npos) {
    step.text = held_.substr(0, include_match_ ? first + length : first);
    step.matched = true;
    matched_ = true;
    held_.clear();
    return step;
  }
  // Hold back the longest tail of held_ that is a proper prefix of some stop string.
  std::size_t keep = 0;
  for (const auto& s : stops_) {
    const std::size_t most = std::min(s.size() - 1, held_.size());
    for (std::size_t n = most; n > keep; --n) {
      if (std::string_view(held_).substr(held_.size() - n) == std::string_view(s).substr(0, n)) {
        keep = n;
        break;
      }
    }
  }
  step.text = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return step;
}

std::string StopStringMatcher::flush() {
  std::string out = std::move(held_);
  held_.clear();
  return out;
}

}  // namespace pd::router
