#pragma once
/// The authenticated internal plane (docs/security.md): one cluster secret, shared by the router
/// and every worker, signs every router -> worker call and every KV descriptor and completion
/// record, so that only holders of the secret can drive a worker or steer its KV transfers.
///
/// - Calls: the sender adds `X-Pdserve-Auth: v1 t=<unix ms> n=<128-bit nonce, hex> s=<hex>` where
///   s = HMAC-SHA-256(secret, "pdserve-call-v1" LF method LF target LF t LF n LF sha256(body)).
///   The receiver refuses (Unauthenticated) a missing or malformed header, a timestamp more than
///   `max_skew` away from its own clock (stale or from the future), a nonce it has already seen
///   within that window (replay), and a wrong signature; the comparison is constant-time.
/// - Blobs (descriptors, completion records): tag(purpose, bytes) = HMAC(secret, "pdserve-" purpose
///   LF bytes); checkTag() compares in constant time. Their freshness comes from the deadline and
///   ids inside them.
///
/// Thread rules: thread-safe (the replay cache has its own lock); share one instance per process.

#include <chrono>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "pd/common/crypto.h"
#include "pd/common/http_message.h"
#include "pd/common/http_server.h"
#include "pd/common/result.h"

namespace pd::metrics {
class Registry;
}  // namespace pd::metrics

namespace pd {

/// The request header carrying a call's signature.
inline constexpr std::string_view kInternalAuthHeader = "X-Pdserve-Auth";
/// Shortest accepted secret (bytes of the file after trailing whitespace is removed).
inline constexpr std::size_t kMinClusterSecretBytes = 32;

struct InternalAuthOptions {
  std::vector<std::uint8_t> secret;  ///< at least kMinClusterSecretBytes
  std::chrono::milliseconds max_skew{30000};
  std::size_t max_remembered_nonces = 1 << 20;  ///< calls within one skew window, at most
  /// Milliseconds since the Unix epoch; empty: the system clock. Tests inject a clock.
  std::function<std::int64_t()> now_ms;
};

class InternalAuth {
 public:
  /// InvalidArgument when the secret is shorter than kMinClusterSecretBytes.
  [[nodiscard]] static Result<std::shared_ptr<InternalAuth>> create(InternalAuthOptions options);

  /// The header value that signs this call.
  [[nodiscard]] std::string sign(std::string_view method, std::string_view target, std::string_view body) const;
  /// OK, or Unauthenticated naming what is wrong (never echoing the header's content).
  [[nodiscard]] Status verify(std::string_view method, std::string_view target, std::string_view body,
                              std::string_view header_value);

  /// A blob's tag under `purpose` ("descriptor", "record", ...).
  [[nodiscard]] crypto::Digest tag(std::string_view purpose, std::span<const std::byte> bytes) const;
  [[nodiscard]] bool checkTag(std::string_view purpose, std::span<const std::byte> bytes,
                              std::span<const std::uint8_t> tag) const;

 private:
  explicit InternalAuth(InternalAuthOptions options) : options_(std::move(options)) {}
  [[nodiscard]] std::int64_t nowMs() const;
  [[nodiscard]] crypto::Digest callMac(std::string_view method, std::string_view target, std::string_view body,
                                       std::string_view t, std::string_view nonce) const;
  // True if `nonce` was new (and is now remembered until `expires_ms`).
  bool remember(const std::string& nonce, std::int64_t now_ms, std::int64_t expires_ms);

  InternalAuthOptions options_;
  std::mutex mu_;
  std::unordered_set<std::string> nonces_;                     // guarded by mu_
  std::deque<std::pair<std::int64_t, std::string>> expiries_;  // guarded by mu_; by expiry
};

/// Reads a cluster secret file (e.g. a mounted Kubernetes Secret). Trailing whitespace is
/// dropped. NotFound / Io when unreadable, InvalidArgument when shorter than
/// kMinClusterSecretBytes. Messages never contain the file's bytes.
[[nodiscard]] Result<std::vector<std::uint8_t>> loadClusterSecret(const std::filesystem::path& file);
/// Writes a new random secret (64 hex characters) to `file`, mode 0600, atomically.
[[nodiscard]] Status writeNewClusterSecret(const std::filesystem::path& file);

/// The verifier of the secret in `secret_file`, or null when the path is empty (no secret: an
/// unauthenticated internal plane). Errors as loadClusterSecret.
[[nodiscard]] Result<std::shared_ptr<InternalAuth>> loadInternalAuth(const std::filesystem::path& secret_file);

/// Adds the signature header to an outgoing call when `auth` is set.
void signRequest(const InternalAuth* auth, std::string_view method, std::string_view target, std::string_view body,
                 http::Headers& headers);

/// Wraps every route whose path starts with `prefix` (default: the internal API) so that a call
/// without a valid signature is answered 401 with a worker_api error body and counted in
/// `pdserve_internal_auth_rejected_total{reason}` (registered in `metrics`, when given). Probe
/// routes (/health, /ready, /metrics) stay open for orchestrators. A null `auth` returns the
/// routes unchanged (an unauthenticated plane; the worker logs a warning at start).
[[nodiscard]] std::vector<http::Route> requireInternalAuth(std::vector<http::Route> routes,
                                                           const std::shared_ptr<InternalAuth>& auth,
                                                           metrics::Registry* metrics,
                                                           std::string_view prefix = "/v1/internal/");

}  // namespace pd
