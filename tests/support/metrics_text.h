#pragma once
// Reading a process's Prometheus /metrics in end-to-end tests: one scrape, one sample lookup.
// Thread rules: free functions, no shared state.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "pd/common/http_client.h"

namespace pd::test {

/// The value of the sample `series` — its name and labels exactly as rendered, e.g.
/// `name{a="b"}` — in a Prometheus text body: the first line that starts with `series` and a
/// space. nullopt when there is none.
inline std::optional<double> sampleValue(std::string_view body, std::string_view series) {
  const std::string prefix = std::string(series) + " ";
  for (std::size_t at = body.find(prefix); at != std::string_view::npos; at = body.find(prefix, at + 1)) {
    if (at == 0 || body[at - 1] == '\n') return std::stod(std::string(body.substr(at + prefix.size())));
  }
  return std::nullopt;
}

/// GET /metrics on host:port: the body, or nullopt when the call fails or is not answered 200.
inline std::optional<std::string> scrapeMetrics(const std::string& host, std::uint16_t port) {
  http::Client client(host, port);
  http::ClientRequest req;
  req.method = "GET";
  req.target = "/metrics";
  auto response = client.send(req, std::chrono::seconds(10));
  if (!response.ok() || response->status != 200) return std::nullopt;
  return std::move(response->body);
}

}  // namespace pd::test
