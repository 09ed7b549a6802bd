#include "pd/trace/trace_context.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "pd/common/crypto.h"

namespace pd::trace {
namespace {

constexpr char kHexDigits[] = "0123456789abcdef";

// Lower-case hex only: the specification forbids upper case in traceparent.
int hexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

template <std::size_t N>
bool decodeHex(std::string_view text, std::array<std::uint8_t, N>& out) {
  if (text.size() != 2 * N) return false;
  for (std::size_t i = 0; i < N; ++i) {
    const int hi = hexValue(text[2 * i]);
    const int lo = hexValue(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<std::uint8_t>((hi << 4) | lo);
  }
  return true;
}

template <std::size_t N>
std::string encodeHex(const std::array<std::uint8_t, N>& bytes) {
  std::string out(2 * N, '0');
  for (std::size_t i = 0; i < N; ++i) {
    out[2 * i] = kHexDigits[bytes[i] >> 4];
    out[2 * i + 1] = kHexDigits[bytes[i] & 0x0f];
  }
  return out;
}

template <std::size_t N>
bool allZero(const std::array<std::uint8_t, N>& bytes) {
  return std::all_of(bytes.begin(), bytes.end(), [](std::uint8_t b) { return b == 0; });
}

/// `out.size()` bytes from the OS CSPRNG, drawn 512 at a time per thread: a span id then costs
/// a copy instead of a system call (the router starts about ten spans per request). The buffer
/// never outlives an exec, and each byte is handed out once.
void randomFill(std::span<std::uint8_t> out) {
  thread_local std::vector<std::uint8_t> pool;
  thread_local std::size_t used = 0;
  if (pool.size() - used < out.size()) {
    pool = crypto::randomBytes(512);
    used = 0;
  }
  std::memcpy(out.data(), pool.data() + used, out.size());
  std::memset(pool.data() + used, 0, out.size());  // what was handed out does not stay behind
  used += out.size();
}

template <class Id>
Id randomId() {
  Id id;
  do {
    randomFill(id.bytes);
  } while (!id.valid());
  return id;
}

std::string_view trimOws(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

}  // namespace

bool TraceId::valid() const {
  return !allZero(bytes);
}
std::string TraceId::hex() const {
  return encodeHex(bytes);
}
bool SpanId::valid() const {
  return !allZero(bytes);
}
std::string SpanId::hex() const {
  return encodeHex(bytes);
}

TraceId newTraceId() {
  return randomId<TraceId>();
}
SpanId newSpanId() {
  return randomId<SpanId>();
}

std::optional<SpanContext> parseTraceparent(std::string_view header) {
  // version(2) '-' trace-id(32) '-' parent-id(16) '-' flags(2) = 55 characters.
  constexpr std::size_t kLength = 55;
  const std::string_view s = trimOws(header);
  if (s.size() < kLength) return std::nullopt;
  std::array<std::uint8_t, 1> version{};
  if (!decodeHex(s.substr(0, 2), version) || version[0] == 0xff) return std::nullopt;
  // Version 00 is exactly 55 characters; a later version may append "-..." fields we ignore.
  if (version[0] == 0 && s.size() != kLength) return std::nullopt;
  if (s.size() > kLength && s[kLength] != '-') return std::nullopt;
  if (s[2] != '-' || s[35] != '-' || s[52] != '-') return std::nullopt;
  SpanContext ctx;
  std::array<std::uint8_t, 1> flags{};
  if (!decodeHex(s.substr(3, 32), ctx.trace_id.bytes) || !decodeHex(s.substr(36, 16), ctx.span_id.bytes) ||
      !decodeHex(s.substr(53, 2), flags)) {
    return std::nullopt;
  }
  if (!ctx.valid()) return std::nullopt;
  ctx.flags = flags[0];
  return ctx;
}

std::string formatTraceparent(const SpanContext& context) {
  std::string out = "00-";
  out += context.trace_id.hex();
  out += '-';
  out += context.span_id.hex();
  out += context.sampled() ? "-01" : "-00";
  return out;
}

std::optional<TraceId> parseTraceId(std::string_view hex) {
  TraceId id;
  if (!decodeHex(hex, id.bytes) || !id.valid()) return std::nullopt;
  return id;
}

std::optional<SpanId> parseSpanId(std::string_view hex) {
  SpanId id;
  if (!decodeHex(hex, id.bytes) || !id.valid()) return std::nullopt;
  return id;
}

}  // namespace pd::trace
