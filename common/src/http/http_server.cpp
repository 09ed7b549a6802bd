#include "pd/common/http_server.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <condition_variable>
#include <exception>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>

#include "pd/common/io_threads.h"
#include "pd/common/log.h"

namespace pd::http {

namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

constexpr std::string_view kLog = "http";
// While a response is pending the server reads ahead to notice a disconnect; it stops reading
// (and relies on write errors) once this many pipelined bytes are waiting.
constexpr std::size_t kMonitorCap = 64 << 10;
constexpr std::size_t kMonitorRead = 4096;
// After answering with Connection: close, unread request bytes are drained this long so the
// client sees the response instead of a reset.
constexpr auto kLingerTime = std::chrono::seconds(2);

std::string sanitizeHeaderText(std::string_view text) {
  std::string out(text);
  for (char& c : out) {
    if (c == '\r' || c == '\n' || c == '\0') c = ' ';
  }
  return out;
}

bool isFramingHeader(std::string_view name) {
  return equalsIgnoreCase(name, "content-length") || equalsIgnoreCase(name, "transfer-encoding") ||
         equalsIgnoreCase(name, "connection") || equalsIgnoreCase(name, "server");
}

/// Status line, the caller's headers and the server's own; ends with the blank line.
std::string serializeHead(int status, const Headers& headers, std::string_view server_name, bool keep_alive,
                          std::optional<std::size_t> content_length, bool chunked) {
  std::string out = fmt::format("HTTP/1.1 {} {}\r\n", status, reasonPhrase(status));
  for (const auto& h : headers) {
    if (isFramingHeader(h.name)) continue;
    out += sanitizeHeaderText(h.name);
    out += ": ";
    out += sanitizeHeaderText(h.value);
    out += "\r\n";
  }
  out += fmt::format("Server: {}\r\n", server_name);
  if (content_length) out += fmt::format("Content-Length: {}\r\n", *content_length);
  if (chunked) out += "Transfer-Encoding: chunked\r\n";
  out += keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
  out += "\r\n";
  return out;
}

/// A request the parser rejected (as opposed to a closed or failed connection).
bool isHttpSyntaxError(const beast::error_code& ec) {
  static const auto& category = bhttp::make_error_code(bhttp::error::bad_method).category();
  return ec.category() == category && ec != bhttp::error::end_of_stream && ec != bhttp::error::partial_message &&
         ec != bhttp::error::need_more && ec != bhttp::error::need_buffer;
}

Response defaultErrorResponse(int status, std::string_view message) {
  return Response::withBody(status, "text/plain; charset=utf-8",
                            fmt::format("{} {}: {}\n", status, reasonPhrase(status), message));
}

}  // namespace

namespace detail {

class Session;

/// What the server shares with its sessions. Sessions hold it by shared_ptr and declare it first,
/// so the io_context outlives every socket and timer, even a session kept alive by an Exchange
/// copy after the server is gone.
struct ServerState {
  ServerState(ServerOptions opts, std::shared_ptr<IoThreads> io_threads, bool owns)
      : io(std::move(io_threads)), owns_io(owns), options(std::move(opts)) {}

  Response errorResponse(int status, std::string_view message) const {
    return options.error_responder ? options.error_responder(status, message) : defaultErrorResponse(status, message);
  }
  /// False once the server is stopping (the caller then drops the connection).
  bool addSession(const std::shared_ptr<Session>& s) {
    std::lock_guard lock(mu);
    if (stopping) return false;
    sessions.emplace(s.get(), s);
    return true;
  }
  void removeSession(Session* s) {
    std::lock_guard lock(mu);
    sessions.erase(s);
    cv.notify_all();
  }

  std::shared_ptr<IoThreads> io;  // first: every socket and timer of the server lives on it
  const bool owns_io;             // the server started `io` (and stops it) rather than sharing one
  const ServerOptions options;
  std::map<std::string, std::map<std::string, Handler>> routes;  // path -> method -> handler
  mutable std::mutex mu;
  std::condition_variable cv;
  std::unordered_map<Session*, std::shared_ptr<Session>> sessions;
  bool stopping = false;
};

/// The state of one response, shared by the session (strand) and the Exchange copies (any
/// thread). Every post to the session happens under `mu`, so a post never follows the session's
/// close: once `gone` or `Done` is set nothing more is posted.
class ExchangeCore : public std::enable_shared_from_this<ExchangeCore> {
 public:
  enum class Phase { Waiting, Whole, Streaming, Ended, Done };

  ExchangeCore(std::shared_ptr<Session> session, bool chunked, bool head)
      : session_(std::move(session)), chunked_(chunked), head_(head) {}

  bool respond(Response response);
  bool beginStream(int status, Headers headers);
  bool write(std::string data);
  void end();
  bool gone() const {
    std::lock_guard lock(mu_);
    return gone_;
  }
  void onGone(std::function<void()> callback) {
    {
      std::lock_guard lock(mu_);
      if (!gone_) {
        on_gone_ = std::move(callback);
        return;
      }
    }
    if (callback) callback();
  }
  /// The last Exchange copy is gone.
  void abandon();

  // Session side (strand).
  /// Marks the exchange gone if incomplete; returns the callback to run (outside any lock).
  std::function<void()> markGone() {
    std::lock_guard lock(mu_);
    if (gone_ || phase_ == Phase::Done) return {};
    gone_ = true;
    session_.reset();
    return std::move(on_gone_);
  }
  void markDone() {
    std::lock_guard lock(mu_);
    phase_ = Phase::Done;
    session_.reset();
    on_gone_ = nullptr;
  }
  void wrote(std::size_t payload_bytes) {
    std::lock_guard lock(mu_);
    queued_bytes_ -= payload_bytes;
  }
  [[nodiscard]] bool chunked() const { return chunked_; }
  /// A HEAD request answered by a GET route: the head goes out, the body never does.
  [[nodiscard]] bool head() const { return head_; }

 private:
  mutable std::mutex mu_;
  std::shared_ptr<Session> session_;  // the connection stays open while its response is pending
  Phase phase_ = Phase::Waiting;
  bool gone_ = false;
  std::function<void()> on_gone_;
  std::size_t queued_bytes_ = 0;
  const bool chunked_;
  const bool head_;
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(std::shared_ptr<ServerState> state, tcp::socket socket)
      : state_(std::move(state)),
        socket_(std::move(socket)),
        read_timer_(socket_.get_executor()),
        write_timer_(socket_.get_executor()) {
    beast::error_code ec;
    const auto ep = socket_.remote_endpoint(ec);
    if (!ec) remote_ = fmt::format("{}:{}", ep.address().to_string(), ep.port());
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  Session(Session&&) = delete;
  Session& operator=(Session&&) = delete;
  ~Session() = default;

  template <class F>
  void post(F&& f) {
    net::post(socket_.get_executor(), std::forward<F>(f));
  }

  void start() {
    post([self = shared_from_this()] { self->waitForRequest(); });
  }

  /// Server stop, phase one: idle connections close; busy ones close after their response.
  void shutdownGracefully() {
    closing_ = true;
    if (idle_) close();
  }
  /// Server stop, phase two: close now; a pending handler is told its client is gone.
  void forceClose() { close(); }

  // Called (posted) by ExchangeCore; each checks that `core` is still this connection's.
  void sendWhole(const std::shared_ptr<ExchangeCore>& core, const Response& response);
  void sendStreamHead(const std::shared_ptr<ExchangeCore>& core, int status, const Headers& headers);
  void sendChunk(const std::shared_ptr<ExchangeCore>& core, const std::string& data);
  void sendStreamEnd(const std::shared_ptr<ExchangeCore>& core);
  void abortStream(const std::shared_ptr<ExchangeCore>& core) {
    if (core == current_) close();
  }
  const ServerState& state() const { return *state_; }

 private:
  void waitForRequest();
  void readHeader();
  void onHeader(beast::error_code ec);
  void readBody();
  void onBody(beast::error_code ec);
  void failRead(beast::error_code ec);
  void dispatch();
  void startMonitor();
  void onMonitor(beast::error_code ec, std::size_t n);
  void enqueue(std::string_view bytes, std::size_t payload, bool final);
  void startWrite();
  void onWrite(beast::error_code ec);
  void finishExchange();
  /// Answers an error the server produces itself before any handler runs, then closes.
  void failRequest(int status, std::string_view message);
  void lingerThenClose();
  void close();
  void armRead(std::chrono::milliseconds d);
  void armWrite(std::chrono::milliseconds d);
  void disarmRead() {
    ++read_gen_;
    read_timer_.cancel();
  }

  std::shared_ptr<ServerState> state_;  // first member: released last
  tcp::socket socket_;
  net::steady_timer read_timer_;
  net::steady_timer write_timer_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::string remote_;
  std::shared_ptr<ExchangeCore> current_;
  std::string out_pending_;
  std::string out_writing_;
  std::size_t pending_payload_ = 0;
  std::size_t writing_payload_ = 0;
  std::uint64_t read_gen_ = 0;
  std::uint64_t write_gen_ = 0;
  std::uint64_t requests_ = 0;
  bool final_queued_ = false;
  bool write_final_ = false;
  bool writing_ = false;
  bool keep_alive_ = false;
  bool closing_ = false;
  bool closed_ = false;
  bool idle_ = false;
  bool monitoring_ = false;
  bool resume_after_monitor_ = false;
  bool lingering_ = false;
};

bool ExchangeCore::respond(Response response) {
  std::lock_guard lock(mu_);
  if (gone_ || phase_ != Phase::Waiting) return false;
  phase_ = Phase::Whole;
  session_->post([s = session_, core = shared_from_this(), r = std::move(response)] { s->sendWhole(core, r); });
  return true;
}

bool ExchangeCore::beginStream(int status, Headers headers) {
  std::lock_guard lock(mu_);
  if (gone_ || phase_ != Phase::Waiting) return false;
  phase_ = Phase::Streaming;
  session_->post([s = session_, core = shared_from_this(), status, h = std::move(headers)] {
    s->sendStreamHead(core, status, h);
  });
  return true;
}

bool ExchangeCore::write(std::string data) {
  std::lock_guard lock(mu_);
  if (gone_ || phase_ != Phase::Streaming) return false;
  if (data.empty()) return true;  // an empty chunk would end the stream
  queued_bytes_ += data.size();
  if (queued_bytes_ > session_->state().options.max_buffered_stream_bytes) {
    // The client reads slower than we produce: treat it as gone rather than buffer without bound.
    phase_ = Phase::Ended;
    session_->post([s = session_, core = shared_from_this()] { s->abortStream(core); });
    return false;
  }
  session_->post([s = session_, core = shared_from_this(), d = std::move(data)] { s->sendChunk(core, d); });
  return true;
}

void ExchangeCore::end() {
  std::lock_guard lock(mu_);
  if (gone_ || phase_ != Phase::Streaming) return;
  phase_ = Phase::Ended;
  session_->post([s = session_, core = shared_from_this()] { s->sendStreamEnd(core); });
}

void ExchangeCore::abandon() {
  std::lock_guard lock(mu_);
  if (gone_) return;
  if (phase_ == Phase::Waiting) {
    phase_ = Phase::Whole;
    session_->post([s = session_, core = shared_from_this()] {
      s->sendWhole(core, s->state().errorResponse(500, "the request handler did not answer"));
    });
  } else if (phase_ == Phase::Streaming) {
    phase_ = Phase::Ended;
    session_->post([s = session_, core = shared_from_this()] { s->abortStream(core); });
  }
}

void Session::armRead(std::chrono::milliseconds d) {
  const std::uint64_t gen = ++read_gen_;
  read_timer_.expires_after(d);
  read_timer_.async_wait([self = shared_from_this(), gen](beast::error_code ec) {
    if (ec || gen != self->read_gen_ || self->closed_) return;
    log::debug(kLog, "{}: read deadline passed; closing", self->remote_);
    self->close();
  });
}

void Session::armWrite(std::chrono::milliseconds d) {
  const std::uint64_t gen = ++write_gen_;
  write_timer_.expires_after(d);
  write_timer_.async_wait([self = shared_from_this(), gen](beast::error_code ec) {
    if (ec || gen != self->write_gen_ || self->closed_) return;
    log::debug(kLog, "{}: write deadline passed; closing", self->remote_);
    self->close();
  });
}

void Session::waitForRequest() {
  if (closed_) return;
  if (closing_) {
    close();
    return;
  }
  parser_.emplace();
  parser_->body_limit(state_->options.max_body_bytes);
  parser_->header_limit(static_cast<std::uint32_t>(state_->options.max_header_bytes));
  if (buffer_.size() > 0) {
    readHeader();
    return;
  }
  idle_ = true;
  armRead(requests_ == 0 ? state_->options.header_timeout : state_->options.idle_timeout);
  socket_.async_wait(tcp::socket::wait_read, [self = shared_from_this()](beast::error_code ec) {
    self->idle_ = false;
    if (ec || self->closed_) {
      self->close();
      return;
    }
    self->readHeader();
  });
}

void Session::readHeader() {
  if (closing_ && buffer_.size() == 0) {
    close();
    return;
  }
  armRead(state_->options.header_timeout);
  bhttp::async_read_header(socket_, buffer_, *parser_,
                           [self = shared_from_this()](beast::error_code ec, std::size_t) { self->onHeader(ec); });
}

void Session::onHeader(beast::error_code ec) {
  disarmRead();
  if (closed_) return;
  if (ec) return failRead(ec);
  const auto& req = parser_->get();
  if (equalsIgnoreCase(std::string_view(req[bhttp::field::expect]), "100-continue") && !parser_->is_done()) {
    auto cont = std::make_shared<std::string>("HTTP/1.1 100 Continue\r\n\r\n");
    armWrite(state_->options.write_timeout);
    net::async_write(socket_, net::buffer(*cont),
                     [self = shared_from_this(), cont](beast::error_code wec, std::size_t) {
                       ++self->write_gen_;
                       self->write_timer_.cancel();
                       if (wec || self->closed_) return self->close();
                       self->readBody();
                     });
    return;
  }
  readBody();
}

void Session::readBody() {
  if (parser_->is_done()) return dispatch();
  armRead(state_->options.body_timeout);
  bhttp::async_read(socket_, buffer_, *parser_,
                    [self = shared_from_this()](beast::error_code ec, std::size_t) { self->onBody(ec); });
}

void Session::onBody(beast::error_code ec) {
  disarmRead();
  if (closed_) return;
  if (ec) return failRead(ec);
  dispatch();
}

void Session::failRead(beast::error_code ec) {
  if (ec == bhttp::error::body_limit) return failRequest(413, "the request body is larger than the limit");
  if (ec == bhttp::error::header_limit) return failRequest(431, "the request headers are larger than the limit");
  if (isHttpSyntaxError(ec)) return failRequest(400, "malformed HTTP request");
  close();  // the peer left, the deadline passed or the socket failed: nobody to answer
}

void Session::dispatch() {
  auto msg = parser_->release();
  parser_.reset();
  ++requests_;
  keep_alive_ = msg.keep_alive() && !closing_;

  Request req;
  req.method = std::string(msg.method_string());
  req.target = std::string(msg.target());
  const auto q = req.target.find('?');
  req.path = req.target.substr(0, q);
  if (q != std::string::npos) req.query = req.target.substr(q + 1);
  req.headers.reserve(static_cast<std::size_t>(std::distance(msg.begin(), msg.end())));
  for (const auto& f : msg) req.headers.push_back({std::string(f.name_string()), std::string(f.value())});
  req.body = std::move(msg.body());
  req.remote = remote_;

  const auto path_it = state_->routes.find(req.path);
  const Handler* handler = nullptr;
  bool head = false;
  if (path_it != state_->routes.end()) {
    const auto& by_method = path_it->second;
    if (const auto m = by_method.find(req.method); m != by_method.end()) {
      handler = &m->second;
    } else if (const auto get = by_method.find("GET"); req.method == "HEAD" && get != by_method.end()) {
      // HEAD is GET without the body (RFC 9110 §9.3.2): probes such as /health answer it.
      handler = &get->second;
      head = true;
    }
  }
  current_ = std::make_shared<ExchangeCore>(shared_from_this(), msg.version() >= 11, head);
  startMonitor();
  Exchange exchange(current_);

  if (path_it == state_->routes.end()) {
    exchange.respond(state_->errorResponse(404, "no such endpoint"));
    return;
  }
  if (handler == nullptr) {
    Response r = state_->errorResponse(405, "method not allowed on this endpoint");
    std::string allow;
    for (const auto& [m, h] : path_it->second) allow += (allow.empty() ? "" : ", ") + m;
    if (path_it->second.count("GET") != 0 && path_it->second.count("HEAD") == 0) allow += ", HEAD";
    r.headers.push_back({"Allow", allow});
    exchange.respond(std::move(r));
    return;
  }
  try {
    (*handler)(std::move(req), exchange);
  } catch (const std::exception& e) {
    log::error(kLog, "handler for {} threw: {}", path_it->first, e.what());
    exchange.respond(state_->errorResponse(500, "internal error"));
  }
}

void Session::startMonitor() {
  if (lingering_) buffer_.consume(buffer_.size());
  if (monitoring_ || closed_ || buffer_.size() >= kMonitorCap) return;
  monitoring_ = true;
  socket_.async_read_some(buffer_.prepare(kMonitorRead),
                          [self = shared_from_this()](beast::error_code ec, std::size_t n) { self->onMonitor(ec, n); });
}

void Session::onMonitor(beast::error_code ec, std::size_t n) {
  monitoring_ = false;
  if (closed_) return;
  if (!ec) {
    buffer_.commit(n);  // pipelined bytes: parsed after this response (or discarded when lingering)
  } else if (ec != net::error::operation_aborted || lingering_) {
    if (!lingering_) log::debug(kLog, "{}: client went away while its response was pending", remote_);
    close();
    return;
  }
  if (resume_after_monitor_ && !lingering_) {
    resume_after_monitor_ = false;
    waitForRequest();
  } else if (lingering_ || current_) {
    startMonitor();
  }
}

void Session::sendWhole(const std::shared_ptr<ExchangeCore>& core, const Response& response) {
  if (core != current_ || closed_) return;
  if (closing_) keep_alive_ = false;
  std::string bytes = serializeHead(response.status, response.headers, state_->options.server_name, keep_alive_,
                                    response.body.size(), false);
  if (!core->head()) bytes += response.body;
  enqueue(bytes, 0, true);
}

void Session::sendStreamHead(const std::shared_ptr<ExchangeCore>& core, int status, const Headers& headers) {
  if (core != current_ || closed_) return;
  if (closing_ || !core->chunked()) keep_alive_ = false;  // HTTP/1.0: the stream ends at close
  enqueue(serializeHead(status, headers, state_->options.server_name, keep_alive_, std::nullopt, core->chunked()), 0,
          false);
}

void Session::sendChunk(const std::shared_ptr<ExchangeCore>& core, const std::string& data) {
  if (core != current_ || closed_) return;
  const std::size_t payload = data.size();
  if (core->head()) return core->wrote(payload);
  if (!core->chunked()) return enqueue(data, payload, false);
  std::string framed = fmt::format("{:x}\r\n", payload);
  framed += data;
  framed += "\r\n";
  enqueue(framed, payload, false);
}

void Session::sendStreamEnd(const std::shared_ptr<ExchangeCore>& core) {
  if (core != current_ || closed_) return;
  enqueue(core->chunked() && !core->head() ? std::string("0\r\n\r\n") : std::string(), 0, true);
}

void Session::enqueue(std::string_view bytes, std::size_t payload, bool final) {
  out_pending_ += bytes;
  pending_payload_ += payload;
  if (final) final_queued_ = true;
  if (!writing_) startWrite();
}

void Session::startWrite() {
  writing_ = true;
  out_writing_.swap(out_pending_);
  out_pending_.clear();
  writing_payload_ = pending_payload_;
  pending_payload_ = 0;
  write_final_ = final_queued_;
  final_queued_ = false;
  armWrite(state_->options.write_timeout);
  net::async_write(socket_, net::buffer(out_writing_),
                   [self = shared_from_this()](beast::error_code ec, std::size_t) { self->onWrite(ec); });
}

void Session::onWrite(beast::error_code ec) {
  ++write_gen_;
  write_timer_.cancel();
  writing_ = false;
  if (closed_) return;
  if (ec) {
    log::debug(kLog, "{}: write failed: {}", remote_, ec.message());
    close();
    return;
  }
  if (current_) current_->wrote(writing_payload_);
  out_writing_.clear();
  if (write_final_) return finishExchange();
  if (!out_pending_.empty() || final_queued_) startWrite();
}

void Session::finishExchange() {
  if (current_) current_->markDone();
  current_.reset();
  // The request was read in full, so closing now loses nothing the client sent.
  if (!keep_alive_ || closing_) return close();
  if (monitoring_) {
    resume_after_monitor_ = true;
    beast::error_code ec;
    (void)socket_.cancel(ec);
    return;
  }
  waitForRequest();
}

void Session::failRequest(int status, std::string_view message) {
  keep_alive_ = false;
  const Response r = state_->errorResponse(status, message);
  auto bytes = std::make_shared<std::string>(
      serializeHead(r.status, r.headers, state_->options.server_name, false, r.body.size(), false) + r.body);
  armWrite(state_->options.write_timeout);
  writing_ = true;
  net::async_write(socket_, net::buffer(*bytes), [self = shared_from_this(), bytes](beast::error_code ec, std::size_t) {
    ++self->write_gen_;
    self->write_timer_.cancel();
    self->writing_ = false;
    if (ec || self->closed_) return self->close();
    self->lingerThenClose();
  });
}

void Session::lingerThenClose() {
  // Half-close, then read and discard until the client closes too (or the linger time is up),
  // so a client still sending its body gets our response rather than a connection reset.
  lingering_ = true;
  beast::error_code ec;
  (void)socket_.shutdown(tcp::socket::shutdown_send, ec);
  if (ec) return close();
  armRead(std::chrono::duration_cast<std::chrono::milliseconds>(kLingerTime));
  if (!monitoring_) startMonitor();
}

void Session::close() {
  if (closed_) return;
  closed_ = true;
  ++read_gen_;
  ++write_gen_;
  read_timer_.cancel();
  write_timer_.cancel();
  beast::error_code ec;
  (void)socket_.shutdown(tcp::socket::shutdown_both, ec);
  (void)socket_.close(ec);
  std::function<void()> on_gone;
  if (current_) on_gone = current_->markGone();
  current_.reset();
  state_->removeSession(this);
  if (on_gone) on_gone();
}

}  // namespace detail

class Exchange::Owner {
 public:
  explicit Owner(std::shared_ptr<detail::ExchangeCore> core) : core_(std::move(core)) {}
  Owner(const Owner&) = delete;
  Owner& operator=(const Owner&) = delete;
  Owner(Owner&&) = delete;
  Owner& operator=(Owner&&) = delete;
  ~Owner() {
    try {
      core_->abandon();
    } catch (const std::exception& e) {
      log::error(kLog, "answering an abandoned exchange failed: {}", e.what());
    }
  }
  detail::ExchangeCore& core() { return *core_; }

 private:
  std::shared_ptr<detail::ExchangeCore> core_;
};

Exchange::Exchange(std::shared_ptr<detail::ExchangeCore> core) : owner_(std::make_shared<Owner>(std::move(core))) {}

bool Exchange::respond(Response response) {
  return owner_->core().respond(std::move(response));
}
bool Exchange::beginStream(int status, Headers headers) {
  return owner_->core().beginStream(status, std::move(headers));
}
bool Exchange::write(std::string data) {
  return owner_->core().write(std::move(data));
}
void Exchange::end() {
  owner_->core().end();
}
bool Exchange::clientGone() const {
  return owner_->core().gone();
}
void Exchange::onClientGone(std::function<void()> callback) {
  owner_->core().onGone(std::move(callback));
}

class Server::Impl {
 public:
  explicit Impl(std::shared_ptr<detail::ServerState> state)
      : state_(std::move(state)),
        acceptor_(net::make_strand(state_->io->context())),
        backoff_(acceptor_.get_executor()) {}
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  Impl(Impl&&) = delete;
  Impl& operator=(Impl&&) = delete;
  ~Impl() {
    try {
      stop(std::chrono::milliseconds{0});
    } catch (const std::exception& e) {
      log::error(kLog, "stopping the HTTP server failed: {}", e.what());
    }
  }

  Status listen() {
    const ServerOptions& o = state_->options;
    beast::error_code ec;
    net::ip::address address = net::ip::make_address(o.host, ec);
    if (ec) {
      tcp::resolver resolver(state_->io->context());
      auto results = resolver.resolve(o.host, std::to_string(o.port), ec);
      if (ec || results.empty()) {
        return makeError(ErrorCode::InvalidArgument, fmt::format("cannot resolve listen host '{}'", o.host));
      }
      address = results.begin()->endpoint().address();
    }
    const tcp::endpoint endpoint(address, o.port);
    const std::string where = fmt::format("{}:{}", o.host, o.port);
    if (acceptor_.open(endpoint.protocol(), ec); ec) {
      return makeError(ErrorCode::Io, fmt::format("open socket for {}: {}", where, ec.message()));
    }
    if (acceptor_.set_option(net::socket_base::reuse_address(true), ec); ec) {
      return makeError(ErrorCode::Io, fmt::format("SO_REUSEADDR on {}: {}", where, ec.message()));
    }
    if (acceptor_.bind(endpoint, ec); ec) {
      return makeError(ErrorCode::Io, fmt::format("bind {}: {}", where, ec.message()));
    }
    if (acceptor_.listen(net::socket_base::max_listen_connections, ec); ec) {
      return makeError(ErrorCode::Io, fmt::format("listen on {}: {}", where, ec.message()));
    }
    port_ = acceptor_.local_endpoint(ec).port();
    return okStatus();
  }

  void run() {
    net::post(acceptor_.get_executor(), [this] { accept(); });
  }

  void stop(std::chrono::milliseconds drain) {
    if (stopped_.exchange(true)) return;
    {
      std::lock_guard lock(state_->mu);
      state_->stopping = true;
    }
    // Closed on its strand, and waited for: with a shared io_context the threads go on after
    // stop(), so nothing may still be about to touch this object when it is destroyed.
    // The promise is kept in a second post: it runs after the completions close() queued.
    std::promise<void> closed;
    net::post(acceptor_.get_executor(), [this, &closed] {
      beast::error_code ec;
      (void)acceptor_.close(ec);
      backoff_.cancel();
      net::post(acceptor_.get_executor(), [&closed] { closed.set_value(); });
    });
    if (state_->io->context().stopped()) {
      beast::error_code ec;  // no thread runs the loop any more: nothing else touches the acceptor
      (void)acceptor_.close(ec);
    } else {
      closed.get_future().wait();
    }
    forEachSession([](const std::shared_ptr<detail::Session>& s) { s->shutdownGracefully(); });
    {
      std::unique_lock lock(state_->mu);
      state_->cv.wait_for(lock, drain, [&] { return state_->sessions.empty(); });
    }
    for (;;) {
      forEachSession([](const std::shared_ptr<detail::Session>& s) { s->forceClose(); });
      std::unique_lock lock(state_->mu);
      if (state_->cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return state_->sessions.empty(); })) break;
    }
    if (state_->owns_io) state_->io->stop();
  }

  net::any_io_executor executor() const { return state_->io->executor(); }

  std::uint16_t port() const { return port_; }
  std::size_t connectionCount() const {
    std::lock_guard lock(state_->mu);
    return state_->sessions.size();
  }

 private:
  void accept() {
    acceptor_.async_accept(net::make_strand(state_->io->context()), [this](beast::error_code ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted || !acceptor_.is_open()) return;
      if (!ec) {
        if (connectionCount() >= state_->options.max_connections) {
          log::warn(kLog, "connection limit {} reached; refusing a connection", state_->options.max_connections);
          beast::error_code ignored;
          (void)socket.close(ignored);
        } else {
          beast::error_code ignored;
          (void)socket.set_option(tcp::no_delay(true), ignored);
          auto session = std::make_shared<detail::Session>(state_, std::move(socket));
          if (!state_->addSession(session)) return;
          session->start();
        }
      } else if (ec == net::error::no_descriptors || ec == boost::system::errc::too_many_files_open_in_system ||
                 ec == net::error::no_buffer_space || ec == net::error::no_memory) {
        // Out of fds (or kernel memory): the pending connection stays in the backlog and the
        // next accept would fail at once. Pause instead of spinning a core and flooding the log.
        ++accept_failures_;
        const auto now = std::chrono::steady_clock::now();
        if (now - last_accept_log_ >= std::chrono::seconds(1)) {
          log::warn(kLog, "accept failed {} time(s) since the last report: {}; pausing {} ms", accept_failures_,
                    ec.message(), kAcceptBackoff.count());
          accept_failures_ = 0;
          last_accept_log_ = now;
        }
        backoff_.expires_after(kAcceptBackoff);
        backoff_.async_wait([this](beast::error_code wait_ec) {
          if (wait_ec == net::error::operation_aborted || !acceptor_.is_open()) return;
          accept();
        });
        return;
      } else {
        log::warn(kLog, "accept failed: {}", ec.message());
      }
      accept();
    });
  }

  template <class F>
  void forEachSession(F f) {
    std::vector<std::shared_ptr<detail::Session>> snapshot;
    {
      std::lock_guard lock(state_->mu);
      for (const auto& [p, s] : state_->sessions) snapshot.push_back(s);
    }
    for (auto& s : snapshot) s->post([s, f] { f(s); });
  }

  std::shared_ptr<detail::ServerState> state_;  // shared with sessions: see ServerState
  tcp::acceptor acceptor_;
  net::steady_timer backoff_;          // on the acceptor's strand: the pause after an fd-limit failure
  std::uint64_t accept_failures_ = 0;  // acceptor strand only
  std::chrono::steady_clock::time_point last_accept_log_;  // acceptor strand only
  std::uint16_t port_ = 0;
  std::atomic<bool> stopped_{false};
};

std::uint64_t raiseFdLimit() {
  static std::mutex mu;
  std::lock_guard lock(mu);
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  if (limit.rlim_cur < limit.rlim_max) {
    const rlim_t before = limit.rlim_cur;
    limit.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &limit) == 0) {
      log::info(kLog, "raised the open file limit from {} to {}", static_cast<std::uint64_t>(before),
                static_cast<std::uint64_t>(limit.rlim_cur));
    } else {
      limit.rlim_cur = before;
    }
  }
  return static_cast<std::uint64_t>(limit.rlim_cur);
}

Result<std::unique_ptr<Server>> Server::start(ServerOptions options, std::vector<Route> routes) {
  raiseFdLimit();
  if (options.io_threads < 1) return makeError(ErrorCode::InvalidArgument, "io_threads must be at least 1");
  if (options.max_body_bytes == 0) return makeError(ErrorCode::InvalidArgument, "max_body_bytes must be positive");
  std::shared_ptr<IoThreads> io = options.io;
  const bool owns_io = !io;
  if (owns_io) {
    PD_ASSIGN_OR_RETURN(io, IoThreads::start(options.io_threads, std::string(kLog)));
  }
  options.io.reset();  // the state holds it once, first among its members
  auto state = std::make_shared<detail::ServerState>(std::move(options), std::move(io), owns_io);
  for (auto& r : routes) {
    if (!r.handler)
      return makeError(ErrorCode::InvalidArgument, fmt::format("route {} {} has no handler", r.method, r.path));
    auto& by_method = state->routes[r.path];
    if (by_method.count(r.method) != 0) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("duplicate route {} {}", r.method, r.path));
    }
    by_method.emplace(r.method, std::move(r.handler));
  }
  auto impl = std::make_unique<Impl>(state);
  PD_TRY(impl->listen());
  impl->run();
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;
std::uint16_t Server::port() const {
  return impl_->port();
}
std::size_t Server::connectionCount() const {
  return impl_->connectionCount();
}
void Server::stop(std::chrono::milliseconds drain) {
  impl_->stop(drain);
}
boost::asio::any_io_executor Server::executor() const {
  return impl_->executor();
}

}  // namespace pd::http
