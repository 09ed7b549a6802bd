#include <fmt/format.h>

#include <cmath>
#include <string>

#include "pd/common/json_text.h"
#include "pd/trace/span_data.h"

namespace pd::trace {
namespace {

std::string unixNanos(TimePoint t) {
  return std::to_string(std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count());
}

void appendValue(std::string& out, const AttributeValue& value) {
  if (const auto* s = std::get_if<std::string>(&value)) {
    out += "{\"stringValue\":";
    appendJsonString(out, *s);
  } else if (const auto* i = std::get_if<std::int64_t>(&value)) {
    out += "{\"intValue\":\"" + std::to_string(*i) + "\"";
  } else if (const auto* d = std::get_if<double>(&value)) {
    out += "{\"doubleValue\":";
    // JSON has no NaN or infinities; the protobuf JSON mapping writes them as strings.
    if (std::isnan(*d)) {
      out += "\"NaN\"";
    } else if (std::isinf(*d)) {
      out += *d > 0 ? "\"Infinity\"" : "\"-Infinity\"";
    } else {
      out += fmt::format("{}", *d);
    }
  } else {
    out += std::get<bool>(value) ? "{\"boolValue\":true" : "{\"boolValue\":false";
  }
  out += '}';
}

void appendAttributes(std::string& out, const std::vector<Attribute>& attributes) {
  out += '[';
  for (std::size_t i = 0; i < attributes.size(); ++i) {
    if (i > 0) out += ',';
    out += "{\"key\":";
    appendJsonString(out, attributes[i].key);
    out += ",\"value\":";
    appendValue(out, attributes[i].value);
    out += '}';
  }
  out += ']';
}

void appendSpan(std::string& out, const SpanData& span) {
  out += "{\"traceId\":\"" + span.context.trace_id.hex() + "\",\"spanId\":\"" + span.context.span_id.hex() + "\"";
  if (span.parent_span_id.valid()) out += ",\"parentSpanId\":\"" + span.parent_span_id.hex() + "\"";
  out += ",\"flags\":" + std::to_string(span.context.flags);
  out += ",\"name\":";
  appendJsonString(out, span.name);
  out += ",\"kind\":" + std::to_string(static_cast<int>(span.kind));
  out += ",\"startTimeUnixNano\":\"" + unixNanos(span.start) + "\"";
  out += ",\"endTimeUnixNano\":\"" + unixNanos(span.end) + "\"";
  out += ",\"attributes\":";
  appendAttributes(out, span.attributes);
  if (!span.links.empty()) {
    out += ",\"links\":[";
    for (std::size_t i = 0; i < span.links.size(); ++i) {
      if (i > 0) out += ',';
      out +=
          "{\"traceId\":\"" + span.links[i].trace_id.hex() + "\",\"spanId\":\"" + span.links[i].span_id.hex() + "\"}";
    }
    out += ']';
  }
  // Status codes: 0 UNSET, 2 ERROR.
  out += ",\"status\":{";
  if (span.error) {
    out += "\"code\":2,\"message\":";
    appendJsonString(out, span.status_message);
  }
  out += "}}";
}

}  // namespace

std::string encodeOtlpJson(const Resource& resource, std::span<const SpanData> spans) {
  std::string out = "{\"resourceSpans\":[{\"resource\":{\"attributes\":";
  std::vector<Attribute> attributes;
  attributes.reserve(resource.attributes.size() + 1);
  attributes.push_back({"service.name", resource.service_name});
  attributes.insert(attributes.end(), resource.attributes.begin(), resource.attributes.end());
  appendAttributes(out, attributes);
  out += "},\"scopeSpans\":[{\"scope\":{\"name\":";
  appendJsonString(out, kScopeName);
  out += "},\"spans\":[";
  for (std::size_t i = 0; i < spans.size(); ++i) {
    if (i > 0) out += ',';
    appendSpan(out, spans[i]);
  }
  out += "]}]}]}";
  return out;
}

}  // namespace pd::trace
