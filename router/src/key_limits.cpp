#include "pd/router/key_limits.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "pd/common/check.h"

namespace pd::router {

KeyLease::~KeyLease() {
  finish(reserved_);
}

KeyLease::KeyLease(KeyLease&& other) noexcept
    : limiter_(std::exchange(other.limiter_, nullptr)),
      key_(other.key_),
      seq_(other.seq_),
      reserved_(other.reserved_) {}

KeyLease& KeyLease::operator=(KeyLease&& other) noexcept {
  if (this != &other) {
    finish(reserved_);
    limiter_ = std::exchange(other.limiter_, nullptr);
    key_ = other.key_;
    seq_ = other.seq_;
    reserved_ = other.reserved_;
  }
  return *this;
}

void KeyLease::finish(std::int64_t used_tokens) {
  if (limiter_ == nullptr) return;
  std::exchange(limiter_, nullptr)->release(key_, seq_, reserved_, used_tokens);
}

KeyLimiter::KeyLimiter(std::vector<KeyLimits> limits, std::function<Clock::time_point()> now) : now_(std::move(now)) {
  PD_CHECK(now_ != nullptr);
  keys_.resize(limits.size());
  for (std::size_t i = 0; i < limits.size(); ++i) keys_[i].limits = limits[i];
}

void KeyLimiter::expire(KeyState& k, Clock::time_point now) {
  while (!k.window.empty() && k.window.front().at + kWindow <= now) {
    k.window_tokens -= k.window.front().tokens;
    k.window.pop_front();
  }
}

KeyLimiter::Admission KeyLimiter::admit(std::size_t key, std::int64_t tokens) {
  PD_CHECK(tokens >= 1);
  Admission a;
  if (key >= keys_.size() || !keys_[key].limits.any()) {
    a.lease.emplace();
    return a;
  }
  std::lock_guard lock(mu_);
  KeyState& k = keys_[key];
  const KeyLimits& l = k.limits;
  const Clock::time_point now = now_();
  expire(k, now);
  if (l.max_concurrent > 0 && k.in_flight >= l.max_concurrent) {
    a.refusal = Refusal::Concurrent;
    a.message = fmt::format("this API key may have {} request(s) in flight at once; retry when one has finished",
                            l.max_concurrent);
    return a;
  }
  if (l.tokens_per_minute > 0) {
    if (tokens > l.tokens_per_minute) {
      a.refusal = Refusal::TooLarge;
      a.message = fmt::format(
          "the request reserves {} tokens (prompt + max_tokens), more than this API key's limit of {} tokens per "
          "minute; lower max_tokens or shorten the prompt",
          tokens, l.tokens_per_minute);
      return a;
    }
    if (k.window_tokens + tokens > l.tokens_per_minute) {
      // The earliest moment enough of the oldest reservations have left the window.
      std::int64_t left = k.window_tokens;
      Clock::time_point free_at = now;
      for (const Reservation& r : k.window) {
        left -= r.tokens;
        free_at = r.at + kWindow;
        if (left + tokens <= l.tokens_per_minute) break;
      }
      const auto wait = std::chrono::ceil<std::chrono::seconds>(free_at - now);
      a.refusal = Refusal::Tokens;
      a.retry_after = std::max(wait, std::chrono::seconds(1));
      a.message = fmt::format(
          "this API key used {} of its {} tokens per minute; the request reserves {} (prompt + max_tokens); retry in "
          "{} s",
          k.window_tokens, l.tokens_per_minute, tokens, a.retry_after->count());
      return a;
    }
  }
  ++k.in_flight;
  const std::uint64_t seq = k.next_seq++;
  std::int64_t reserved = 0;
  if (l.tokens_per_minute > 0) {
    reserved = tokens;
    k.window.push_back(Reservation{now, seq, tokens});
    k.window_tokens += tokens;
  }
  a.lease = KeyLease(this, key, seq, reserved);
  return a;
}

void KeyLimiter::release(std::size_t key, std::uint64_t seq, std::int64_t reserved, std::int64_t used) {
  std::lock_guard lock(mu_);
  KeyState& k = keys_[key];
  PD_CHECK(k.in_flight > 0);
  --k.in_flight;
  const std::int64_t refund = reserved - std::clamp<std::int64_t>(used, 0, reserved);
  if (refund == 0) return;
  // The reservation is still in the window unless it is over a minute old (then nothing to correct).
  const auto it = std::lower_bound(k.window.begin(), k.window.end(), seq,
                                   [](const Reservation& r, std::uint64_t s) { return r.seq < s; });
  if (it == k.window.end() || it->seq != seq) return;
  it->tokens -= refund;
  k.window_tokens -= refund;
}

KeyLimiter::Usage KeyLimiter::usage(std::size_t key) {
  std::lock_guard lock(mu_);
  if (key >= keys_.size()) return {};
  KeyState& k = keys_[key];
  expire(k, now_());
  return Usage{k.in_flight, k.window_tokens};
}

}  // namespace pd::router
