#pragma once
/// An asynchronous HTTP/1.1 client for one server (host:port) over one reused keep-alive
/// connection, running on a caller's executor (e.g. the router's io_context threads) instead of a
/// thread of its own: whole request/response, and streamed responses read line by line. It is the
/// non-blocking twin of http::Client (http_client.h) with the same errors and deadlines.
///
/// Every exchange has a deadline covering connect, send and the whole response. Errors (Result):
/// PeerFailed (cannot connect, connection reset or closed early), Timeout (the deadline passed),
/// Corrupt (not a valid HTTP response, or one over the size limit), InvalidArgument (a host that
/// does not resolve), Cancelled (after cancel()). An HTTP error status is not an error.
///
/// Thread rules: one exchange at a time per client (start the next from `done` or later). send(),
/// streamLines() and cancel() may be called from any thread. Every callback (`on_line`, `done`)
/// runs on the client's strand of the executor, never inside the call that started the exchange;
/// `done` runs exactly once per exchange, also when the client was cancelled or destroyed
/// meanwhile (with Cancelled). Callbacks must not block.

#include <boost/asio/any_io_executor.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "pd/common/http_client.h"
#include "pd/common/result.h"

namespace pd::http {

class AsyncClient {
 public:
  using Done = std::function<void(Result<ClientResponse>)>;

  /// Connects lazily, on the first exchange.
  AsyncClient(const boost::asio::any_io_executor& executor, std::string host, std::uint16_t port);
  AsyncClient(const AsyncClient&) = delete;
  AsyncClient& operator=(const AsyncClient&) = delete;
  AsyncClient(AsyncClient&&) = delete;
  AsyncClient& operator=(AsyncClient&&) = delete;
  /// cancel(): an exchange in flight ends with Cancelled.
  ~AsyncClient();

  /// Sends `request` and reads the whole response (at most Client::kMaxBodyBytes of body).
  void send(ClientRequest request, std::chrono::milliseconds timeout, Done done);
  /// Sends `request`; a 2xx body goes to `on_line` line by line as it arrives (a final
  /// unterminated line at the end); returning false stops reading, closes the connection and
  /// ends the exchange with `complete == false`. A non-2xx body comes back in the response.
  void streamLines(ClientRequest request, std::chrono::milliseconds timeout, LineCallback on_line, Done done);
  /// Thread-safe, idempotent: the exchange in flight ends with Cancelled as soon as its current
  /// operation is interrupted; later exchanges end with Cancelled at once.
  void cancel();
  /// True once cancel() was called (such a client must not go back to a pool).
  [[nodiscard]] bool cancelled() const;
  /// True when no exchange is in flight and the last one left the connection open and reusable.
  [[nodiscard]] bool reusable() const;

  class Impl;

 private:
  std::shared_ptr<Impl> impl_;  // shared with the operations in flight
};

}  // namespace pd::http
