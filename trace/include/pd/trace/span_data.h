#pragma once
/// A finished span as the exporters see it, and its OTLP/HTTP JSON encoding.
///
/// OTLP JSON (opentelemetry-proto's JSON mapping of ExportTraceServiceRequest): lowerCamelCase
/// field names, trace and span ids as lower-case hex, 64-bit integers (timestamps, int
/// attributes) as decimal strings, enums (span kind, status code) as integers.
///
/// Thread rules: values and pure functions; thread-safe.

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "pd/trace/trace_context.h"

namespace pd::trace {

using Clock = std::chrono::system_clock;
using TimePoint = Clock::time_point;

/// OTLP's SpanKind values.
enum class SpanKind { Internal = 1, Server = 2, Client = 3 };

using AttributeValue = std::variant<std::string, std::int64_t, double, bool>;

struct Attribute {
  std::string key;
  AttributeValue value;
};

struct SpanData {
  SpanContext context;    ///< this span's trace, id and flags
  SpanId parent_span_id;  ///< all zero for a root span
  std::string name;
  SpanKind kind = SpanKind::Internal;
  TimePoint start;
  TimePoint end;
  std::vector<Attribute> attributes;
  /// OTLP span links: other spans this one relates to besides its parent (such as the decode
  /// worker's decode.kv_record, a child of the prefill worker's completion span, linking its
  /// decode.request). Encoded as `links` (traceId, spanId) only when not empty.
  std::vector<SpanContext> links;
  bool error = false;          ///< OTLP status ERROR (else UNSET)
  std::string status_message;  ///< with error
};

/// Who emits the spans: OTLP's Resource (`service.name` plus more attributes).
struct Resource {
  std::string service_name;
  std::vector<Attribute> attributes;
};

/// The instrumentation scope every pdserve span is reported under.
inline constexpr std::string_view kScopeName = "pdserve";

/// One ExportTraceServiceRequest: one resourceSpans for `resource`, one scopeSpans, `spans`.
[[nodiscard]] std::string encodeOtlpJson(const Resource& resource, std::span<const SpanData> spans);

}  // namespace pd::trace
