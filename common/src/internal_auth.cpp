// The authenticated internal plane (internal_auth.h, docs/security.md).
#include "pd/common/internal_auth.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <iterator>
#include <unordered_set>

#include "pd/common/metrics.h"
#include "pd/common/sha256.h"
#include "pd/common/worker_api.h"

namespace pd {
namespace {

// What a cluster secret file must not look like (loadClusterSecret).
constexpr std::string_view kPlaceholderWords[] = {"replace", "changeme", "change-me", "placeholder", "example"};
constexpr std::size_t kMinDistinctSecretChars = 8;

}  // namespace
namespace {

Error unauthenticated(std::string what) {
  return makeError(ErrorCode::Unauthenticated, std::move(what));
}

// "t=123 n=abc s=def" after the "v1 " prefix: finds one field's value.
std::string_view field(std::string_view text, std::string_view key) {
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find(' ', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view item = text.substr(pos, end - pos);
    if (item.size() > key.size() && item.substr(0, key.size()) == key && item[key.size()] == '=') {
      return item.substr(key.size() + 1);
    }
    pos = end + 1;
  }
  return {};
}

bool allHex(std::string_view s) {
  for (const char c : s) {
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

Result<std::shared_ptr<InternalAuth>> InternalAuth::create(InternalAuthOptions options) {
  if (options.secret.size() < kMinClusterSecretBytes) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("the cluster secret must have at least {} bytes", kMinClusterSecretBytes));
  }
  if (options.max_skew.count() <= 0) return makeError(ErrorCode::InvalidArgument, "max_skew must be positive");
  return std::shared_ptr<InternalAuth>(new InternalAuth(std::move(options)));
}

std::int64_t InternalAuth::nowMs() const {
  if (options_.now_ms) return options_.now_ms();
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

crypto::Digest InternalAuth::callMac(std::string_view method, std::string_view target, std::string_view body,
                                     std::string_view t, std::string_view nonce) const {
  const std::string body_hash = sha256Hex(std::as_bytes(std::span(body.data(), body.size())));
  const std::string text = fmt::format("pdserve-call-v1\n{}\n{}\n{}\n{}\n{}", method, target, t, nonce, body_hash);
  return crypto::hmacSha256(options_.secret, text);
}

std::string InternalAuth::sign(std::string_view method, std::string_view target, std::string_view body) const {
  const std::string t = std::to_string(nowMs());
  const std::string nonce = crypto::randomHex128();
  const crypto::Digest mac = callMac(method, target, body, t, nonce);
  return fmt::format("v1 t={} n={} s={}", t, nonce, crypto::toHex(mac));
}

Status InternalAuth::verify(std::string_view method, std::string_view target, std::string_view body,
                            std::string_view header_value) {
  if (header_value.empty()) return unauthenticated("the call is not signed");
  if (header_value.size() > 256 || header_value.substr(0, 3) != "v1 ") {
    return unauthenticated("the call's signature is malformed");
  }
  const std::string_view rest = header_value.substr(3);
  const std::string_view t = field(rest, "t");
  const std::string_view nonce = field(rest, "n");
  const std::string_view sig = field(rest, "s");
  std::int64_t t_ms = 0;
  const auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), t_ms);
  if (t.empty() || ec != std::errc() || ptr != t.data() + t.size() || nonce.size() != 32 || !allHex(nonce) ||
      sig.size() != 64 || !allHex(sig)) {
    return unauthenticated("the call's signature is malformed");
  }
  auto given = crypto::fromHex(sig);
  if (!given.ok()) return unauthenticated("the call's signature is malformed");
  const crypto::Digest expected = callMac(method, target, body, t, nonce);
  if (!crypto::constantTimeEqual(expected, given.value())) return unauthenticated("the call's signature is wrong");
  const std::int64_t now = nowMs();
  const std::int64_t skew = options_.max_skew.count();
  if (t_ms < now - skew || t_ms > now + skew) {
    return unauthenticated("the call's timestamp is outside the accepted window (stale or clock skew)");
  }
  // Checked after the MAC, so that only genuine calls occupy the replay cache.
  if (!remember(std::string(nonce), now, t_ms + skew)) return unauthenticated("the call is a replay");
  return okStatus();
}

bool InternalAuth::remember(const std::string& nonce, std::int64_t now_ms, std::int64_t expires_ms) {
  std::lock_guard lock(mu_);
  while (!expiries_.empty() &&
         (expiries_.front().first < now_ms || expiries_.size() >= options_.max_remembered_nonces)) {
    nonces_.erase(expiries_.front().second);
    expiries_.pop_front();
  }
  if (!nonces_.insert(nonce).second) return false;
  // Expiries arrive nearly in order (t within the skew window); an out-of-order one is kept a
  // little longer than needed, never shorter, so insert it at its sorted place from the back.
  auto it = expiries_.end();
  while (it != expiries_.begin() && std::prev(it)->first > expires_ms) --it;
  expiries_.insert(it, {expires_ms, nonce});
  return true;
}

crypto::Digest InternalAuth::tag(std::string_view purpose, std::span<const std::byte> bytes) const {
  std::string text = fmt::format("pdserve-{}\n", purpose);
  text.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return crypto::hmacSha256(options_.secret, text);
}

bool InternalAuth::checkTag(std::string_view purpose, std::span<const std::byte> bytes,
                            std::span<const std::uint8_t> given) const {
  const crypto::Digest expected = tag(purpose, bytes);
  return crypto::constantTimeEqual(expected, given);
}

Result<std::vector<std::uint8_t>> loadClusterSecret(const std::filesystem::path& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const bool missing = errno == ENOENT;
    return makeError(missing ? ErrorCode::NotFound : ErrorCode::Io,
                     fmt::format("cannot open the cluster secret file {}", file.string()));
  }
  std::string text;
  char chunk[1024];
  bool failed = false;
  for (;;) {
    const ssize_t got = ::read(fd, chunk, sizeof(chunk));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) failed = true;
    if (got <= 0) break;
    text.append(chunk, static_cast<std::size_t>(got));
    if (text.size() > std::size_t{64} * 1024) failed = true;  // not a secret file
    if (failed) break;
  }
  ::close(fd);
  if (failed) return makeError(ErrorCode::Io, fmt::format("cannot read the cluster secret file {}", file.string()));
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  if (text.size() < kMinClusterSecretBytes) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("the cluster secret in {} is shorter than {} bytes",
                                                             file.string(), kMinClusterSecretBytes));
  }
  // A placeholder left in a manifest (deploy/base/cluster-secret) or a few repeated characters
  // protect nothing: refuse to start rather than run a guessable internal plane.
  std::string lower(text.size(), '\0');
  std::transform(text.begin(), text.end(), lower.begin(),
                 [](char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); });
  const bool placeholder = std::any_of(std::begin(kPlaceholderWords), std::end(kPlaceholderWords),
                                       [&](std::string_view w) { return lower.find(w) != std::string::npos; });
  const std::size_t distinct = std::unordered_set<char>(text.begin(), text.end()).size();
  if (placeholder || distinct < kMinDistinctSecretChars) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("the cluster secret in {} looks like a placeholder, not a secret: write a random one "
                                 "there, e.g. `openssl rand -hex 32` (docs/deploy.md)",
                                 file.string()));
  }
  return std::vector<std::uint8_t>(text.begin(), text.end());
}

Status writeNewClusterSecret(const std::filesystem::path& file) {
  const std::string text = crypto::toHex(crypto::randomBytes(32)) + "\n";
  const std::filesystem::path tmp = file.string() + ".tmp" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return makeError(ErrorCode::Io, fmt::format("cannot create the cluster secret file {}", tmp.string()));
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  const bool closed = ::close(fd) == 0;
  if (!written || !closed || ::rename(tmp.c_str(), file.c_str()) != 0) {
    (void)::unlink(tmp.c_str());
    return makeError(ErrorCode::Io, fmt::format("cannot write the cluster secret file {}", file.string()));
  }
  return okStatus();
}

Result<std::shared_ptr<InternalAuth>> loadInternalAuth(const std::filesystem::path& secret_file) {
  if (secret_file.empty()) return std::shared_ptr<InternalAuth>();
  PD_ASSIGN_OR_RETURN(std::vector<std::uint8_t> secret, loadClusterSecret(secret_file));
  InternalAuthOptions options;
  options.secret = std::move(secret);
  return InternalAuth::create(std::move(options));
}

void signRequest(const InternalAuth* auth, std::string_view method, std::string_view target, std::string_view body,
                 http::Headers& headers) {
  if (auth == nullptr) return;
  headers.push_back({std::string(kInternalAuthHeader), auth->sign(method, target, body)});
}

std::vector<http::Route> requireInternalAuth(std::vector<http::Route> routes, const std::shared_ptr<InternalAuth>& auth,
                                             metrics::Registry* metrics, std::string_view prefix) {
  if (!auth) return routes;
  metrics::Family<metrics::Counter>* rejected = nullptr;
  if (metrics != nullptr) {
    rejected =
        &metrics->counter("pdserve_internal_auth_rejected_total",
                          "Internal calls refused for a missing, stale, replayed or wrong signature", {"reason"});
  }
  for (auto& route : routes) {
    if (route.path.substr(0, prefix.size()) != prefix) continue;
    route.handler = [inner = std::move(route.handler), auth, rejected](http::Request request, http::Exchange exchange) {
      const Status ok = auth->verify(request.method, request.target, request.body, request.header(kInternalAuthHeader));
      if (!ok.ok()) {
        if (rejected != nullptr) {
          const std::string& m = ok.error().message;
          const char* reason = m.find("not signed") != std::string::npos  ? "unsigned"
                               : m.find("replay") != std::string::npos    ? "replay"
                               : m.find("timestamp") != std::string::npos ? "stale"
                               : m.find("malformed") != std::string::npos ? "malformed"
                                                                          : "bad_signature";
          rejected->labels({reason}).inc();
        }
        exchange.respond(http::Response::withBody(401, "application/json", worker_api::errorJson(ok.error())));
        return;
      }
      inner(std::move(request), std::move(exchange));
    };
  }
  return routes;
}

}  // namespace pd
