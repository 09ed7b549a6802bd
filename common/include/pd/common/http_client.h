#pragma once
/// A blocking HTTP/1.1 client for one server (host:port) over one reused keep-alive connection:
/// whole request/response, and streamed responses read line by line or as server-sent events.
/// Every call has a deadline covering connect, send and the whole response.
///
/// Errors (Result): PeerFailed (cannot connect, connection reset or closed early), Timeout (the
/// deadline passed), Corrupt (not a valid HTTP response, or one over the size limit),
/// InvalidArgument (a host that does not resolve), Cancelled (after cancel()). An HTTP error
/// status is not an error: it comes back as a response with that status.
///
/// Thread rules: not thread-safe, except cancel(); use one Client per thread (they are cheap).
/// Calls block the calling thread, which runs the client's own io_context.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "pd/common/http_message.h"
#include "pd/common/result.h"

namespace pd::http {

struct ClientRequest {
  std::string method = "GET";
  std::string target = "/";
  Headers headers;  ///< Host, User-Agent and Content-Length are added unless given
  std::string body;
};

struct ClientResponse {
  int status = 0;
  Headers headers;
  /// The whole body for send(); for the stream calls, the body of a non-2xx response only
  /// (a 2xx body goes to the callback instead).
  std::string body;
  /// False when a stream callback asked to stop before the response ended.
  bool complete = true;

  [[nodiscard]] std::string_view header(std::string_view name) const { return findHeader(headers, name); }
};

/// One server-sent event (https://html.spec.whatwg.org/multipage/server-sent-events.html).
struct SseEvent {
  std::string event;  ///< empty for the default "message" type
  std::string data;   ///< data lines joined with '\n'
  std::string id;
};

/// Return false to stop reading; the connection is then closed.
using LineCallback = std::function<bool(std::string_view line)>;
using EventCallback = std::function<bool(const SseEvent& event)>;

class Client {
 public:
  /// Largest response body send() accepts.
  static constexpr std::size_t kMaxBodyBytes = 64 << 20;

  /// Connects lazily, on the first call.
  Client(std::string host, std::uint16_t port);
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  Client(Client&&) noexcept;
  Client& operator=(Client&&) noexcept;
  ~Client();

  /// Sends `request` and reads the whole response.
  [[nodiscard]] Result<ClientResponse> send(const ClientRequest& request, std::chrono::milliseconds timeout);
  /// Sends `request`; a 2xx body is handed to `on_line` line by line (without "\r\n" or "\n") as
  /// it arrives; a final unterminated line is handed over at the end.
  [[nodiscard]] Result<ClientResponse> streamLines(const ClientRequest& request, std::chrono::milliseconds timeout,
                                                   const LineCallback& on_line);
  /// Sends `request`; a 2xx body is parsed as server-sent events, each handed to `on_event`.
  /// Comment lines are skipped; an event cut off by the end of the stream is dropped.
  [[nodiscard]] Result<ClientResponse> streamEvents(const ClientRequest& request, std::chrono::milliseconds timeout,
                                                    const EventCallback& on_event);
  /// Closes the connection now (the next call reconnects).
  void disconnect();
  /// Thread-safe, non-blocking (the one call that may come from another thread while a call
  /// runs): the call in progress fails with Cancelled as soon as its current read, write or
  /// connect is interrupted, and every later call fails with Cancelled at once. The client must
  /// stay alive until this returns.
  void cancel();
  /// True once cancel() was called (such a client must not be reused, e.g. from a pool).
  [[nodiscard]] bool cancelled() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

/// Splits a byte stream into lines ("\n" or "\r\n" terminated). Thread rules: one thread.
class LineSplitter {
 public:
  /// Calls `on_line` for each complete line in `data`; stops and returns false as soon as it does.
  bool feed(std::string_view data, const LineCallback& on_line);
  /// Hands over a trailing unterminated line, if any.
  bool finish(const LineCallback& on_line);

 private:
  std::string partial_;
};

/// Assembles server-sent events from lines. Thread rules: one thread.
class SseParser {
 public:
  /// Feeds one line; dispatches an event on a blank line. Returns the callback's answer (true
  /// when nothing was dispatched).
  bool feedLine(std::string_view line, const EventCallback& on_event);

 private:
  SseEvent current_;
  bool has_data_ = false;
};

}  // namespace pd::http
