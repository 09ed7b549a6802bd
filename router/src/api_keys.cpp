#include "pd/router/api_keys.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <span>

#include "pd/common/http_message.h"
#include "pd/common/sha256.h"

namespace pd::router {
namespace {

std::array<std::uint8_t, 32> digestOf(std::string_view key) {
  Sha256 h;
  h.update(std::as_bytes(std::span(key.data(), key.size())));
  return h.finish();
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

}  // namespace

ApiKeySet::ApiKeySet(const std::vector<std::string>& keys) {
  digests_.reserve(keys.size());
  for (const auto& k : keys) digests_.push_back(digestOf(k));
}

Result<ApiKeySet> ApiKeySet::fromFile(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return makeError(ErrorCode::NotFound, fmt::format("API key file {} does not exist", path.string()));
  }
  std::ifstream in(path);
  if (!in)
    return makeError(ErrorCode::Io,
                     fmt::format("cannot open API key file {}: {}", path.string(), std::strerror(errno)));
  std::vector<std::string> keys;
  std::string line;
  while (std::getline(in, line)) {
    const std::string_view t = trim(line);
    if (t.empty() || t.front() == '#') continue;
    keys.emplace_back(t);
  }
  if (in.bad()) return makeError(ErrorCode::Io, fmt::format("reading API key file {} failed", path.string()));
  if (keys.empty()) {
    return makeError(
        ErrorCode::InvalidArgument,
        fmt::format("API key file {} holds no keys (remove the setting to turn authentication off)", path.string()));
  }
  return ApiKeySet(keys);
}

bool ApiKeySet::accepts(std::string_view key) const {
  const Digest presented = digestOf(key);
  // Visit every key and every byte; accumulate without branching on secret data.
  std::uint8_t any_match = 0;
  for (const Digest& d : digests_) {
    std::uint8_t diff = 0;
    for (std::size_t i = 0; i < d.size(); ++i) diff |= static_cast<std::uint8_t>(d[i] ^ presented[i]);
    any_match |= static_cast<std::uint8_t>(diff == 0);
  }
  return any_match != 0;
}

bool ApiKeySet::acceptsAuthorization(std::string_view header_value) const {
  constexpr std::string_view kScheme = "bearer ";
  const std::string_view v = trim(header_value);
  if (v.size() <= kScheme.size() || !http::equalsIgnoreCase(v.substr(0, kScheme.size()), kScheme)) {
    (void)accepts({});  // the same work either way
    return false;
  }
  return accepts(trim(v.substr(kScheme.size())));
}

}  // namespace pd::router
