#pragma once
/// W3C Trace Context (https://www.w3.org/TR/trace-context/): trace and span ids, the
/// `traceparent` header's strict parser and its formatter.
///
/// The parser never trusts its input: anything that is not a well-formed header (wrong length,
/// upper-case or non-hex digits, an all-zero id, version ff, a version-00 header with trailing
/// bytes) yields nullopt, and the caller starts a new trace. Later versions are read as the
/// specification asks: the first four fields, then '-' or the end.
///
/// Ids come from the operating system's CSPRNG (pd/common/crypto.h) and are never all zero.
///
/// Thread rules: values and pure functions; thread-safe.

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace pd::trace {

/// The request header that carries a span context between processes.
inline constexpr std::string_view kTraceparentHeader = "traceparent";

/// 16 bytes; all zero means "no trace".
struct TraceId {
  std::array<std::uint8_t, 16> bytes{};

  [[nodiscard]] bool valid() const;
  /// 32 lower-case hex digits.
  [[nodiscard]] std::string hex() const;
  friend bool operator==(const TraceId&, const TraceId&) = default;
};

/// 8 bytes; all zero means "no span" (a root span's parent).
struct SpanId {
  std::array<std::uint8_t, 8> bytes{};

  [[nodiscard]] bool valid() const;
  /// 16 lower-case hex digits.
  [[nodiscard]] std::string hex() const;
  friend bool operator==(const SpanId&, const SpanId&) = default;
};

/// The `sampled` bit of the trace flags.
inline constexpr std::uint8_t kSampledFlag = 0x01;

/// What crosses a process boundary: the trace, the caller's span and the flags.
struct SpanContext {
  TraceId trace_id;
  SpanId span_id;
  std::uint8_t flags = 0;

  [[nodiscard]] bool valid() const { return trace_id.valid() && span_id.valid(); }
  [[nodiscard]] bool sampled() const { return (flags & kSampledFlag) != 0; }
  friend bool operator==(const SpanContext&, const SpanContext&) = default;
};

/// A new random trace id (never all zero).
[[nodiscard]] TraceId newTraceId();
/// A new random span id (never all zero).
[[nodiscard]] SpanId newSpanId();

/// Parses a `traceparent` value; nullopt unless it is well-formed and valid (see the file
/// comment). Optional whitespace around the value (the header grammar's OWS) is allowed.
[[nodiscard]] std::optional<SpanContext> parseTraceparent(std::string_view header);
/// "00-<trace id>-<span id>-<flags>"; only the sampled bit of the flags is written.
[[nodiscard]] std::string formatTraceparent(const SpanContext& context);

/// Parses hex ids as they appear in OTLP JSON and traceparent (lower-case only); nullopt for
/// anything else, including all-zero ids.
[[nodiscard]] std::optional<TraceId> parseTraceId(std::string_view hex);
[[nodiscard]] std::optional<SpanId> parseSpanId(std::string_view hex);

}  // namespace pd::trace
