#pragma once
/// An HTTP/1.1 server (Boost.Beast underneath, kept out of this header) for the router's public
/// API and the workers' internal APIs.
///
/// - N io threads run one io_context; each connection is serialized on its own strand. The
///   io_context is the server's own, or one shared with the caller (ServerOptions::io: the router
///   runs its HTTP server and its clients to the workers on the same threads).
/// - Keep-alive; one request at a time per connection (pipelined bytes wait their turn).
/// - Limits enforced while reading: header bytes (431), body bytes (413, also when the
///   Content-Length announces too much, before reading it), deadlines for the idle wait between
///   requests, the header and the body; a peer that misses one is disconnected.
/// - Handlers answer with a whole response or a chunked stream (server-sent events), from any
///   thread, now or later. While a response is pending the server keeps reading the socket, so a
///   client that goes away is noticed at once and the handler is told (Exchange::onClientGone),
///   even when nothing is being written.
/// - A stream whose client reads too slowly (more than `max_buffered_stream_bytes` queued, or a
///   write taking longer than `write_timeout`) is treated as a gone client.
/// - HEAD on a path that has a GET route (and no HEAD route) runs the GET handler and sends its
///   status and headers without the body, as probes (`curl -I /health`) expect.
/// - At the fd limit (EMFILE/ENFILE) accepting pauses for kAcceptBackoff instead of spinning, with
///   one log line per second at most; raiseFdLimit() lifts the soft limit to the hard one.
/// - stop(): stops accepting, closes idle connections, lets in-flight responses finish until the
///   drain deadline, then closes the rest (their handlers see onClientGone) and joins the threads.
///
/// Thread rules: create() and stop() from a thread that is not one of the server's io threads.
/// Handlers run on io threads and must not block; Exchange is thread-safe. A shared io_context
/// must keep running until stop() returned (stop() waits on it).

#include <boost/asio/any_io_executor.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pd/common/http_message.h"
#include "pd/common/result.h"

namespace pd::http {

class IoThreads;

namespace detail {
class ExchangeCore;
}  // namespace detail

/// The reply channel of one request. A cheap copyable handle: all copies refer to the same
/// exchange, and the handler may keep copies on other threads (a generation's token sink).
///
/// Exactly one of respond() or beginStream()/write()/end() answers. If the last copy is dropped
/// before the response completes, the server answers 500 (nothing sent yet) or cuts the
/// connection (stream started, so the client sees a truncated stream rather than a hang).
///
/// Thread rules: thread-safe. Calls made from one thread reach the wire in order.
class Exchange {
 public:
  /// Sends a whole response. False if a response was already begun or the client is gone.
  bool respond(Response response);
  /// Begins a chunked response (Transfer-Encoding: chunked). False as for respond().
  bool beginStream(int status, Headers headers);
  /// Queues one piece of the stream (sent as one chunk, or coalesced with its neighbours).
  /// False if the stream is not begun, already ended, or the client is gone / too slow.
  bool write(std::string data);
  /// Ends the stream with the terminating chunk; the connection then serves its next request.
  void end();
  /// True once the client disconnected, was cut for being slow, or the server stopped, before
  /// the response completed.
  [[nodiscard]] bool clientGone() const;
  /// Sets the function run once when the client goes away before the response completes.
  /// It runs on an io thread without locks held, or right here if the client is already gone.
  /// Replaces an earlier callback. Keep it short: abort the work, do not answer.
  void onClientGone(std::function<void()> callback);

  explicit Exchange(std::shared_ptr<detail::ExchangeCore> core);

 private:
  class Owner;
  // Shared by every copy; its destructor (the last copy gone) answers for an abandoned exchange.
  std::shared_ptr<Owner> owner_;
};

/// How long the accept loop pauses after running out of file descriptors.
inline constexpr std::chrono::milliseconds kAcceptBackoff{75};

/// Raises this process's soft RLIMIT_NOFILE to its hard limit (a server holds one fd per
/// connection) and returns the soft limit now in force. Server::start() calls it. Thread-safe.
std::uint64_t raiseFdLimit();

/// A route handler: gets the request (moved in) and its exchange. Runs on an io thread.
using Handler = std::function<void(Request request, Exchange exchange)>;

struct Route {
  std::string method;  ///< "GET", "POST", ...
  std::string path;    ///< exact match against Request::path
  Handler handler;
};

/// Builds the body of an error the server itself answers (400 malformed request, 404, 405, 413,
/// 431, 500 for an abandoned exchange or a throwing handler). The default answers one line of
/// plain text; the router installs OpenAI-style JSON. Must not echo request input. Called on io
/// threads.
using ErrorResponder = std::function<Response(int status, std::string_view message)>;

struct ServerOptions {
  std::string host = "127.0.0.1";  ///< numeric address or a resolvable name
  std::uint16_t port = 0;          ///< 0: any free port; see Server::port()
  int io_threads = 2;              ///< threads of the server's own io_context (unused with `io`)
  /// Run on these shared threads instead of starting its own; stop() then leaves them running
  /// (their owner stops them after the server).
  std::shared_ptr<IoThreads> io;
  std::size_t max_body_bytes = 8 << 20;
  std::size_t max_header_bytes = 16 << 10;
  std::size_t max_connections = 10000;              ///< more are closed at accept
  std::chrono::milliseconds idle_timeout{60000};    ///< waiting for a request's first byte
  std::chrono::milliseconds header_timeout{10000};  ///< first byte to end of headers
  std::chrono::milliseconds body_timeout{30000};    ///< end of headers to end of body
  std::chrono::milliseconds write_timeout{30000};   ///< each write to the socket
  std::size_t max_buffered_stream_bytes = 8 << 20;  ///< queued, unsent stream bytes
  std::string server_name = "pdserve";              ///< the Server header
  ErrorResponder error_responder;                   ///< empty: plain-text errors
};

class Server {
 public:
  /// Binds, listens and starts the io threads. Errors: InvalidArgument (bad options or
  /// duplicate route), Io (address in use, cannot bind). Routes are fixed from here on.
  [[nodiscard]] static Result<std::unique_ptr<Server>> start(ServerOptions options, std::vector<Route> routes);

  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  Server(Server&&) = delete;
  Server& operator=(Server&&) = delete;
  /// stop() with no drain time if it was not called.
  ~Server();

  /// The bound port (the chosen one when ServerOptions::port was 0).
  [[nodiscard]] std::uint16_t port() const;
  /// Open connections right now (for tests and metrics).
  [[nodiscard]] std::size_t connectionCount() const;
  /// Graceful stop; see the file comment. Idempotent; blocks until every connection is closed
  /// and, when the server owns its io threads, until they are joined.
  void stop(std::chrono::milliseconds drain = std::chrono::milliseconds{0});
  /// The executor of the server's io_context (for timers and clients on the same threads).
  [[nodiscard]] boost::asio::any_io_executor executor() const;

  class Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pd::http
