#pragma once
/// Per-API-key admission limits of the router (docs/api.md, "Per-key limits"): how many requests
/// of one key may be in flight at once, and how many tokens it may use in any 60-second window.
///
/// Tokens are reserved at admission — the prompt plus max_tokens, the most the request can use —
/// and corrected to what it used (prompt plus generated tokens) when it ends. The window is
/// exact, not a token bucket: a request is admitted only if the tokens of the requests admitted
/// in the last 60 s, plus its own reservation, stay within the limit. A refusal says when to
/// retry: for tokens, the seconds until enough earlier reservations leave the window; for
/// concurrency the end of a request cannot be foreseen, so it carries none (the caller sends its
/// default Retry-After). A request whose reservation alone exceeds the limit is refused as too
/// large (retrying cannot help).
///
/// Thread rules: KeyLimiter is thread-safe (one mutex; nothing blocks while holding it). A Lease
/// belongs to one request; finish() and its destructor may run on any thread. The limiter must
/// outlive its leases.

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace pd::router {

/// One key's limits; 0 means unlimited.
struct KeyLimits {
  std::int64_t max_concurrent = 0;
  std::int64_t tokens_per_minute = 0;
  [[nodiscard]] bool any() const { return max_concurrent > 0 || tokens_per_minute > 0; }
  friend bool operator==(const KeyLimits&, const KeyLimits&) = default;
};

class KeyLimiter;

/// A request holding a concurrency slot and a token reservation of one key. Move-only. The
/// destructor ends it as finish() with the reservation unchanged (the conservative charge).
class KeyLease {
 public:
  KeyLease() = default;  ///< holds nothing (a key without limits, or authentication off)
  ~KeyLease();
  KeyLease(KeyLease&& other) noexcept;
  KeyLease& operator=(KeyLease&& other) noexcept;
  KeyLease(const KeyLease&) = delete;
  KeyLease& operator=(const KeyLease&) = delete;

  /// Frees the slot and corrects the reservation to `used_tokens` (clamped to [0, reserved]).
  /// Only the first call counts.
  void finish(std::int64_t used_tokens);

 private:
  friend class KeyLimiter;
  KeyLease(KeyLimiter* limiter, std::size_t key, std::uint64_t seq, std::int64_t reserved)
      : limiter_(limiter), key_(key), seq_(seq), reserved_(reserved) {}

  KeyLimiter* limiter_ = nullptr;
  std::size_t key_ = 0;
  std::uint64_t seq_ = 0;
  std::int64_t reserved_ = 0;
};

/// Why a request was not admitted.
enum class KeyRefusal {
  Concurrent,  ///< max_concurrent requests of the key are in flight
  Tokens,      ///< the window has no room for the reservation now
  TooLarge,    ///< the reservation alone exceeds tokens_per_minute
};

/// The verdict of KeyLimiter::admit(): a lease, or a refusal with its reason, the seconds until a
/// retry can succeed (Tokens only; at least 1) and a message for the client.
struct KeyAdmission {
  std::optional<KeyLease> lease;
  KeyRefusal refusal = KeyRefusal::Concurrent;
  std::optional<std::chrono::seconds> retry_after;
  std::string message;
};

class KeyLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  using Lease = KeyLease;
  using Refusal = KeyRefusal;
  using Admission = KeyAdmission;
  /// The token window.
  static constexpr std::chrono::seconds kWindow{60};

  /// `limits[i]` is the limits of key i (ApiKeySet's index). `now` is the clock (a fake in tests).
  explicit KeyLimiter(std::vector<KeyLimits> limits, std::function<Clock::time_point()> now = Clock::now);
  KeyLimiter(const KeyLimiter&) = delete;
  KeyLimiter& operator=(const KeyLimiter&) = delete;
  KeyLimiter(KeyLimiter&&) = delete;
  KeyLimiter& operator=(KeyLimiter&&) = delete;
  ~KeyLimiter() = default;

  /// Admits one request of key `key` that reserves `tokens` (prompt + max_tokens, >= 1). A key
  /// out of range or without limits gets an empty lease at once.
  [[nodiscard]] Admission admit(std::size_t key, std::int64_t tokens);

  /// What key `key` holds now (tests, metrics): requests in flight and tokens in the window.
  struct Usage {
    std::int64_t in_flight = 0;
    std::int64_t window_tokens = 0;
  };
  [[nodiscard]] Usage usage(std::size_t key);

 private:
  struct Reservation {
    Clock::time_point at;
    std::uint64_t seq = 0;
    std::int64_t tokens = 0;
  };
  struct KeyState {
    KeyLimits limits;
    std::int64_t in_flight = 0;
    std::deque<Reservation> window;  // admission order: `at` and `seq` both increase
    std::int64_t window_tokens = 0;  // sum of window[].tokens
    std::uint64_t next_seq = 0;
  };

  friend class KeyLease;
  void release(std::size_t key, std::uint64_t seq, std::int64_t reserved, std::int64_t used);
  // Drops the reservations that left the window by `now`. Caller holds mu_.
  static void expire(KeyState& k, Clock::time_point now);

  const std::function<Clock::time_point()> now_;
  std::mutex mu_;
  std::vector<KeyState> keys_;  // guarded by mu_ (the vector itself never changes size)
};

}  // namespace pd::router
