#pragma once
// The tests' OTLP/HTTP JSON collector: a pd http::Server on 127.0.0.1 (port 0) taking POST
// /v1/traces (an ExportTraceServiceRequest) and keeping every span it received, with its
// service name. A body it cannot read is answered 400 and counted.
// Thread rules: thread-safe (the server's threads add spans; the test reads them).
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "pd/common/http_server.h"

namespace pd::test {

struct ReceivedSpan {
  std::string service;
  std::string name;
  std::string trace_id;
  std::string span_id;
  std::string parent_span_id;
  std::uint64_t start_ns = 0;
  std::uint64_t end_ns = 0;
  bool error = false;
  /// Attribute values as text (a string's value, an int's decimal digits, else the JSON).
  std::map<std::string, std::string> attributes;
  /// OTLP links: (trace id, span id) of each linked span.
  std::vector<std::pair<std::string, std::string>> links;
  [[nodiscard]] double ms() const { return static_cast<double>(end_ns - start_ns) / 1e6; }
};

// The test's OTLP/HTTP JSON collector: POST /v1/traces.
class OtlpReceiver {
 public:
  OtlpReceiver() {
    http::Route route{"POST", "/v1/traces", [this](const http::Request& r, http::Exchange ex) {
                        const bool ok = parse(r.body);
                        ex.respond(http::Response::withBody(ok ? 200 : 400, "application/json", "{}"));
                      }};
    auto server = http::Server::start({}, {route});
    EXPECT_TRUE(server.ok());
    if (server.ok()) server_ = std::move(*server);
  }
  [[nodiscard]] std::string url() const { return "http://127.0.0.1:" + std::to_string(server_->port()); }
  std::vector<ReceivedSpan> spans() {
    std::lock_guard lock(mu_);
    return spans_;
  }
  int bad_requests() {
    std::lock_guard lock(mu_);
    return bad_;
  }

 private:
  bool parse(const std::string& body) {
    boost::system::error_code ec;
    const boost::json::value doc = boost::json::parse(body, ec);
    std::lock_guard lock(mu_);
    if (ec || !doc.is_object()) return ++bad_, false;
    for (const auto& rs : doc.at("resourceSpans").as_array()) {
      std::string service;
      for (const auto& a : rs.at("resource").at("attributes").as_array()) {
        if (a.at("key").as_string() == "service.name")
          service = boost::json::value_to<std::string>(a.at("value").at("stringValue"));
      }
      for (const auto& ss : rs.at("scopeSpans").as_array()) {
        for (const auto& s : ss.at("spans").as_array()) {
          ReceivedSpan r;
          r.service = service;
          r.name = boost::json::value_to<std::string>(s.at("name"));
          r.trace_id = boost::json::value_to<std::string>(s.at("traceId"));
          r.span_id = boost::json::value_to<std::string>(s.at("spanId"));
          if (const auto* p = s.as_object().if_contains("parentSpanId"))
            r.parent_span_id = boost::json::value_to<std::string>(*p);
          r.start_ns = std::stoull(boost::json::value_to<std::string>(s.at("startTimeUnixNano")));
          r.end_ns = std::stoull(boost::json::value_to<std::string>(s.at("endTimeUnixNano")));
          r.error = s.at("status").as_object().contains("code");
          if (const auto* attrs = s.as_object().if_contains("attributes")) {
            for (const auto& a : attrs->as_array()) {
              const auto& v = a.at("value").as_object();
              const auto* str = v.if_contains("stringValue");
              const auto* num = v.if_contains("intValue");
              r.attributes[boost::json::value_to<std::string>(a.at("key"))] =
                  str != nullptr   ? boost::json::value_to<std::string>(*str)
                  : num != nullptr ? boost::json::value_to<std::string>(*num)
                                   : boost::json::serialize(v);
            }
          }
          if (const auto* links = s.as_object().if_contains("links")) {
            for (const auto& l : links->as_array()) {
              r.links.emplace_back(boost::json::value_to<std::string>(l.at("traceId")),
                                   boost::json::value_to<std::string>(l.at("spanId")));
            }
          }
          spans_.push_back(std::move(r));
        }
      }
    }
    return true;
  }

  std::mutex mu_;
  std::vector<ReceivedSpan> spans_;  // guarded by mu_
  int bad_ = 0;                      // guarded by mu_
  std::unique_ptr<http::Server> server_;
};

}  // namespace pd::test
