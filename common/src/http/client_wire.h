#pragma once
// What the blocking (http_client.cpp) and asynchronous (async_http_client.cpp) clients share: the
// request they write, the response head they read, and the errors they report.
// Thread rules: pure functions.

#include <fmt/format.h>

#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "pd/common/http_client.h"
#include "pd/common/result.h"

namespace pd::http::detail {

/// Bytes read per step of a streamed body.
inline constexpr std::size_t kStreamReadBytes = 16 << 10;

/// A malformed response (as opposed to a connection that ended early).
inline bool isHttpSyntaxError(const boost::beast::error_code& ec) {
  namespace bhttp = boost::beast::http;
  static const auto& category = bhttp::make_error_code(bhttp::error::bad_method).category();
  return ec.category() == category && ec != bhttp::error::end_of_stream && ec != bhttp::error::partial_message;
}

/// The Beast message for `request` to host:port: Host and User-Agent added unless given, a
/// Content-Length for a body (and for every POST/PUT).
inline void buildRequest(const ClientRequest& request, std::string_view host, std::uint16_t port,
                         boost::beast::http::request<boost::beast::http::string_body>& req) {
  namespace bhttp = boost::beast::http;
  req = {};
  const auto verb = bhttp::string_to_verb(request.method);
  if (verb == bhttp::verb::unknown) {
    req.method_string(request.method);
  } else {
    req.method(verb);
  }
  req.target(request.target);
  req.version(11);
  for (const auto& h : request.headers) req.insert(h.name, h.value);
  if (req.find(bhttp::field::host) == req.end()) req.set(bhttp::field::host, fmt::format("{}:{}", host, port));
  if (req.find(bhttp::field::user_agent) == req.end()) req.set(bhttp::field::user_agent, "pdserve");
  req.body() = request.body;
  if (!request.body.empty() || request.method == "POST" || request.method == "PUT") req.prepare_payload();
}

/// Status and headers of a response head (the body is the caller's).
template <class Message>
ClientResponse toResponse(const Message& msg) {
  ClientResponse r;
  r.status = static_cast<int>(msg.result_int());
  for (const auto& f : msg) r.headers.push_back({std::string(f.name_string()), std::string(f.value())});
  return r;
}

inline Error cancelledError(std::string_view host, std::uint16_t port) {
  return makeError(ErrorCode::Cancelled, fmt::format("http {}:{}: cancelled", host, port));
}

/// The error of a failed `what` ("request", "response", ...) on a connection that was not
/// cancelled: Timeout, Corrupt (over the body limit, or malformed) or PeerFailed.
inline Error transportError(const boost::beast::error_code& ec, std::string_view what, std::string_view host,
                            std::uint16_t port) {
  namespace bhttp = boost::beast::http;
  const std::string where = fmt::format("http {}:{}", host, port);
  if (ec == boost::beast::error::timeout) {
    return makeError(ErrorCode::Timeout, fmt::format("{}: {} did not finish before the deadline", where, what));
  }
  if (ec == bhttp::error::body_limit) {
    return makeError(ErrorCode::Corrupt, fmt::format("{}: response body larger than the client limit", where));
  }
  if (isHttpSyntaxError(ec)) {
    return makeError(ErrorCode::Corrupt, fmt::format("{}: malformed response: {}", where, ec.message()));
  }
  return makeError(ErrorCode::PeerFailed, fmt::format("{}: {} failed: {}", where, what, ec.message()));
}

}  // namespace pd::http::detail
