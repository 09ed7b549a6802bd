#pragma once
// Waits until a router answers GET /ready with 200: its READY line comes before its first health
// polls, so a request sent right after READY can find no worker in rotation (503).
// Thread rules: free function; blocking.

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "pd/common/http_client.h"

namespace pd::test {

/// True once GET /ready answered 200 within `timeout`.
inline bool waitRouterServing(const std::string& host, std::uint16_t port,
                              std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  using Clock = std::chrono::steady_clock;
  for (const auto until = Clock::now() + timeout; Clock::now() < until;) {
    http::Client client(host, port);
    http::ClientRequest req;
    req.target = "/ready";
    auto r = client.send(req, std::chrono::seconds(5));
    if (r.ok() && r->status == 200) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // polling an event we cannot subscribe to
  }
  return false;
}

}  // namespace pd::test
