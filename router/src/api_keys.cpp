#include "pd/router/api_keys.h"

#include <fmt/format.h>

#include <cerrno>
#include <charconv>
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

bool isSpace(char c) {
  return c == ' ' || c == '\t' || c == '\r';
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && isSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && isSpace(s.back())) s.remove_suffix(1);
  return s;
}

// The whitespace-separated words of `line`, up to a word starting with '#' (a comment).
std::vector<std::string_view> words(std::string_view line) {
  std::vector<std::string_view> out;
  while (true) {
    line = trim(line);
    if (line.empty() || line.front() == '#') return out;
    std::size_t end = 0;
    while (end < line.size() && !isSpace(line[end])) ++end;
    out.push_back(line.substr(0, end));
    line.remove_prefix(end);
  }
}

// The largest limit accepted: far above any real deployment, far below overflow when summed.
constexpr std::int64_t kMaxLimit = std::int64_t{1} << 40;

// Applies one "name=value" field to `limits`; the error names the line and the field, never the key.
Status applyField(std::string_view field, KeyLimits& limits, const std::string& where) {
  const auto eq = field.find('=');
  const std::string_view name = eq == std::string_view::npos ? field : field.substr(0, eq);
  std::int64_t* target = nullptr;
  if (name == "max_concurrent") target = &limits.max_concurrent;
  if (name == "tokens_per_minute") target = &limits.tokens_per_minute;
  if (target == nullptr || eq == std::string_view::npos) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("{}: after the key only max_concurrent=N and tokens_per_minute=N may follow (a key "
                                 "holds no whitespace)",
                                 where));
  }
  const std::string_view value = field.substr(eq + 1);
  std::int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc() || ptr != value.data() + value.size() || v < 1 || v > kMaxLimit) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("{}: {} must be an integer from 1 to {}", where, name, kMaxLimit));
  }
  *target = v;
  return okStatus();
}

}  // namespace

ApiKeySet::ApiKeySet(const std::vector<std::string>& keys) {
  digests_.reserve(keys.size());
  for (const auto& k : keys) digests_.push_back(digestOf(k));
  limits_.resize(keys.size());
}

ApiKeySet ApiKeySet::withLimits(const std::vector<ApiKey>& keys) {
  ApiKeySet set;
  set.digests_.reserve(keys.size());
  set.limits_.reserve(keys.size());
  for (const auto& k : keys) {
    set.digests_.push_back(digestOf(k.key));
    set.limits_.push_back(k.limits);
  }
  return set;
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
  std::vector<ApiKey> keys;
  std::vector<std::size_t> key_lines;
  std::string line;
  for (std::size_t number = 1; std::getline(in, line); ++number) {
    const std::vector<std::string_view> w = words(line);
    if (w.empty()) continue;
    const std::string where = fmt::format("API key file {} line {}", path.string(), number);
    ApiKey k{std::string(w[0]), {}};
    for (std::size_t i = 1; i < w.size(); ++i) PD_TRY(applyField(w[i], k.limits, where));
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (keys[i].key == k.key) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("{}: repeats the key of line {}", where, key_lines[i]));
      }
    }
    keys.push_back(std::move(k));
    key_lines.push_back(number);
  }
  if (in.bad()) return makeError(ErrorCode::Io, fmt::format("reading API key file {} failed", path.string()));
  if (keys.empty()) {
    return makeError(
        ErrorCode::InvalidArgument,
        fmt::format("API key file {} holds no keys (remove the setting to turn authentication off)", path.string()));
  }
  return withLimits(keys);
}

std::optional<std::size_t> ApiKeySet::find(std::string_view key) const {
  const Digest presented = digestOf(key);
  // Visit every key and every byte; accumulate without branching on secret data. The first
  // match wins: `found` masks later ones.
  std::size_t index = 0;
  std::uint8_t found = 0;
  for (std::size_t k = 0; k < digests_.size(); ++k) {
    const Digest& d = digests_[k];
    std::uint8_t diff = 0;
    for (std::size_t i = 0; i < d.size(); ++i) diff |= static_cast<std::uint8_t>(d[i] ^ presented[i]);
    const auto take =
        static_cast<std::uint8_t>(static_cast<std::uint8_t>(diff == 0) & static_cast<std::uint8_t>(found ^ 1U));
    const std::size_t mask = std::size_t{0} - static_cast<std::size_t>(take);  // all ones when taken
    index = (index & ~mask) | (k & mask);
    found |= take;
  }
  if (found == 0) return std::nullopt;
  return index;
}

std::optional<std::size_t> ApiKeySet::findAuthorization(std::string_view header_value) const {
  constexpr std::string_view kScheme = "bearer ";
  const std::string_view v = trim(header_value);
  if (v.size() <= kScheme.size() || !http::equalsIgnoreCase(v.substr(0, kScheme.size()), kScheme)) {
    (void)find({});  // the same work either way
    return std::nullopt;
  }
  return find(trim(v.substr(kScheme.size())));
}

}  // namespace pd::router
