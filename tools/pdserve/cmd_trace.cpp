// pdserve trace: one request's timeline from a --trace.file (docs/observability.md), as a table
// across the processes that recorded it: the spans of every trace holding a span whose
// pd.request_id is REQUEST_ID (or whose trace id it is), in tree order, with start offsets and
// durations. Lines that are not OTLP JSON are skipped and counted.
#include <fmt/format.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "cli.h"

namespace pd::cli {
namespace {

namespace json = boost::json;

struct SpanRow {
  std::string trace_id, span_id, parent, name, service, request_id;
  std::uint64_t start = 0, end = 0;
};

std::string str(const json::value* v) {
  return v != nullptr && v->is_string() ? std::string(v->as_string()) : std::string();
}

std::uint64_t nanos(const json::value* v) {
  const std::string s = str(v);
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }) && s.size() < 20
             ? std::stoull(s)
             : 0;
}

// The spans of one OTLP JSON line; false when the line is not one.
bool readLine(const std::string& line, std::vector<SpanRow>& out) {
  boost::system::error_code ec;
  const json::value doc = json::parse(line, ec);
  const auto* rs = !ec && doc.is_object() ? doc.as_object().if_contains("resourceSpans") : nullptr;
  if (rs == nullptr || !rs->is_array()) return false;
  for (const auto& r : rs->as_array()) {
    if (!r.is_object()) return false;
    std::string service;
    const auto* res = r.as_object().if_contains("resource");
    const auto* attrs = res != nullptr && res->is_object() ? res->as_object().if_contains("attributes") : nullptr;
    for (const auto& a : attrs != nullptr && attrs->is_array() ? attrs->as_array() : json::array{}) {
      if (a.is_object() && str(a.as_object().if_contains("key")) == "service.name") {
        const auto* v = a.as_object().if_contains("value");
        service = v != nullptr && v->is_object() ? str(v->as_object().if_contains("stringValue")) : "";
      }
    }
    const auto* scopes = r.as_object().if_contains("scopeSpans");
    for (const auto& sc : scopes != nullptr && scopes->is_array() ? scopes->as_array() : json::array{}) {
      const auto* spans = sc.is_object() ? sc.as_object().if_contains("spans") : nullptr;
      for (const auto& s : spans != nullptr && spans->is_array() ? spans->as_array() : json::array{}) {
        if (!s.is_object()) return false;
        const auto& o = s.as_object();
        SpanRow row{str(o.if_contains("traceId")),
                    str(o.if_contains("spanId")),
                    str(o.if_contains("parentSpanId")),
                    str(o.if_contains("name")),
                    service,
                    "",
                    nanos(o.if_contains("startTimeUnixNano")),
                    nanos(o.if_contains("endTimeUnixNano"))};
        const auto* sa = o.if_contains("attributes");
        for (const auto& a : sa != nullptr && sa->is_array() ? sa->as_array() : json::array{}) {
          if (!a.is_object() || str(a.as_object().if_contains("key")) != "pd.request_id") continue;
          const auto* v = a.as_object().if_contains("value");
          row.request_id = v != nullptr && v->is_object() ? str(v->as_object().if_contains("stringValue")) : "";
        }
        out.push_back(std::move(row));
      }
    }
  }
  return true;
}

void printTree(const std::vector<SpanRow>& spans, const std::string& parent, int depth, std::uint64_t t0,
               std::set<std::string>& printed) {
  for (const SpanRow& s : spans) {
    if (s.parent != parent || !printed.insert(s.span_id).second) continue;
    std::printf("%10.3f %12.3f  %-16s %*s%s\n", static_cast<double>(s.start - t0) / 1e6,
                static_cast<double>(s.end - s.start) / 1e6, s.service.c_str(), 2 * depth, "", s.name.c_str());
    printTree(spans, s.span_id, depth + 1, t0, printed);
  }
}

}  // namespace

int runTrace(const std::vector<std::string>& args) {
  std::filesystem::path file;
  config::OptionSet set("trace_cmd");
  set.add("file", &file, "the JSON lines file spans were written to (--trace.file of the roles)");
  auto loaded = loadCommandOptions(
      "usage: pdserve trace REQUEST_ID --file SPANS.jsonl\n"
      "Prints one request's spans (every process that recorded them) as a table: start (ms from the first span),\n"
      "duration (ms), service and span, children indented under their parents.",
      {&set}, args);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (loaded->positionals.size() != 1 || file.empty()) {
    return reportFailure(makeError(ErrorCode::InvalidArgument, "give one REQUEST_ID and --file"));
  }
  const std::string& wanted = loaded->positionals[0];
  std::ifstream in(file);
  if (!in) return reportFailure(makeError(ErrorCode::Io, "cannot read " + file.string()));
  std::vector<SpanRow> all;
  int skipped = 0;
  for (std::string line; std::getline(in, line);) skipped += readLine(line, all) ? 0 : 1;
  std::set<std::string> traces;
  for (const SpanRow& s : all) {
    if (s.request_id == wanted || s.trace_id == wanted) traces.insert(s.trace_id);
  }
  if (traces.empty()) return reportFailure(makeError(ErrorCode::NotFound, "no span of request " + wanted));
  for (const std::string& trace : traces) {
    std::vector<SpanRow> spans;
    std::set<std::string> ids;
    for (const SpanRow& s : all) {
      if (s.trace_id == trace) spans.push_back(s), ids.insert(s.span_id);
    }
    std::sort(spans.begin(), spans.end(), [](const SpanRow& a, const SpanRow& b) { return a.start < b.start; });
    const std::uint64_t t0 = spans.front().start;
    std::printf("trace %s: %zu spans\n%10s %12s  %-16s %s\n", trace.c_str(), spans.size(), "start ms", "duration ms",
                "service", "span");
    std::set<std::string> printed;
    // Roots: spans whose parent is not in the file (the router's, or none).
    for (const SpanRow& s : spans) {
      if (!ids.contains(s.parent)) printTree(spans, s.parent, 0, t0, printed);
    }
  }
  if (skipped > 0) std::fprintf(stderr, "pdserve trace: %d lines were not OTLP JSON\n", skipped);
  return 0;
}

}  // namespace pd::cli
