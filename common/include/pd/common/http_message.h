#pragma once
/// Plain HTTP message values shared by the HTTP server and client (http_server.h,
/// http_client.h). No Boost here: the wire code lives in common/src/http/.
/// Thread rules: values; no shared state.

#include <string>
#include <string_view>
#include <vector>

namespace pd::http {

struct Header {
  std::string name;
  std::string value;
};
/// Headers in wire order. Names compare case-insensitively.
using Headers = std::vector<Header>;

/// The first value of header `name` (case-insensitive), or empty when absent.
[[nodiscard]] std::string_view findHeader(const Headers& headers, std::string_view name);
/// ASCII case-insensitive equality.
[[nodiscard]] bool equalsIgnoreCase(std::string_view a, std::string_view b);
/// "OK", "Not Found", ... for a status code; "Unknown" for codes without a standard phrase.
[[nodiscard]] std::string_view reasonPhrase(int status);

/// A request as a handler sees it: the whole body has been read (within the size limit).
struct Request {
  std::string method;  ///< "GET", "POST", ... as sent
  std::string target;  ///< path and query as sent
  std::string path;    ///< target up to '?'
  std::string query;   ///< after '?', empty if none
  Headers headers;
  std::string body;
  std::string remote;  ///< peer address, "ip:port"

  [[nodiscard]] std::string_view header(std::string_view name) const { return findHeader(headers, name); }
};

/// A whole (non-streamed) response. Content-Length, Date-less framing and Connection are added
/// by the server; CR and LF in header names or values are replaced by spaces.
struct Response {
  int status = 200;
  Headers headers;
  std::string body;

  [[nodiscard]] static Response withBody(int status, std::string content_type, std::string body);
};

}  // namespace pd::http
