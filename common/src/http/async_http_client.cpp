#include "pd/common/async_http_client.h"

#include <fmt/format.h>

#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <optional>
#include <utility>
#include <vector>

#include "client_wire.h"
#include "pd/common/check.h"

namespace pd::http {

namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

using detail::kStreamReadBytes;
using detail::toResponse;

/// The client's state, owned jointly by the AsyncClient handle and the operations in flight.
/// Everything but `cancelled_` and `reusable_` is touched on `strand_` only.
class AsyncClient::Impl : public std::enable_shared_from_this<Impl> {
 public:
  Impl(const net::any_io_executor& executor, std::string host, std::uint16_t port)
      : strand_(net::make_strand(executor)), resolver_(strand_), host_(std::move(host)), port_(port) {}

  void start(ClientRequest request, std::chrono::milliseconds timeout, LineCallback on_line, Done done) {
    auto x = std::make_unique<Exchange>();
    x->request = std::move(request);
    x->deadline = Clock::now() + timeout;
    x->streaming = static_cast<bool>(on_line);
    x->on_line = std::move(on_line);
    x->done = std::move(done);
    reusable_.store(false);
    net::post(strand_, [self = shared_from_this(), x = std::move(x)]() mutable {
      PD_CHECK_MSG(!self->x_, "AsyncClient: one exchange at a time");
      self->x_ = std::move(x);
      self->attempt();
    });
  }

  void cancel() {
    cancelled_.store(true);
    reusable_.store(false);
    net::post(strand_, [self = shared_from_this()] {
      self->resolver_.cancel();
      if (self->stream_) self->stream_->cancel();
    });
  }
  [[nodiscard]] bool cancelled() const { return cancelled_.load(); }
  [[nodiscard]] bool reusable() const { return reusable_.load(); }

 private:
  struct Exchange {
    ClientRequest request;
    Clock::time_point deadline;
    bool streaming = false;
    LineCallback on_line;
    Done done;
    int attempts = 0;
    bool reused = false;  // this attempt runs on a connection an earlier exchange left open
    bhttp::request<bhttp::string_body> message;
    std::optional<bhttp::response_parser<bhttp::string_body>> whole;
    std::optional<bhttp::response_parser<bhttp::buffer_body>> streamed;
    ClientResponse response;
    bool success = false;
    LineSplitter splitter;
    std::array<char, kStreamReadBytes> buf{};
  };

  void attempt() {
    if (cancelled_.load()) return fail(cancelledError());
    ++x_->attempts;
    x_->reused = stream_.has_value();
    if (stream_) return write();
    beast::error_code ec;
    const auto address = net::ip::make_address(host_, ec);
    if (!ec) return connect({tcp::endpoint(address, port_)});
    resolver_.async_resolve(
        host_, std::to_string(port_),
        [self = shared_from_this()](beast::error_code rec, const tcp::resolver::results_type& results) {
          if (rec || results.empty()) {
            if (self->cancelled_.load()) return self->fail(self->cancelledError());
            return self->fail(makeError(ErrorCode::InvalidArgument,
                                        fmt::format("http {}:{}: cannot resolve the host", self->host_, self->port_)));
          }
          std::vector<tcp::endpoint> endpoints;
          for (const auto& r : results) endpoints.push_back(r.endpoint());
          self->connect(endpoints);
        });
  }

  void connect(const std::vector<tcp::endpoint>& endpoints) {
    if (cancelled_.load()) return fail(cancelledError());
    stream_.emplace(strand_);
    stream_->expires_at(x_->deadline);
    stream_->async_connect(endpoints, [self = shared_from_this()](beast::error_code ec, const tcp::endpoint&) {
      if (ec) {
        self->disconnect();
        return self->fail(self->toError(ec, "connect"));
      }
      beast::error_code ignored;
      (void)self->stream_->socket().set_option(tcp::no_delay(true), ignored);
      self->write();
    });
  }

  void write() {
    if (cancelled_.load()) return fail(cancelledError());
    const ClientRequest& request = x_->request;
    auto& req = x_->message;
    detail::buildRequest(request, host_, port_, req);
    stream_->expires_at(x_->deadline);
    bhttp::async_write(*stream_, req, [self = shared_from_this()](beast::error_code ec, std::size_t) {
      if (ec) return self->failedBeforeResponse(ec, false);
      self->readHead();
    });
  }

  void readHead() {
    if (cancelled_.load()) return fail(cancelledError());
    if (!x_->streaming) {
      x_->whole.emplace();
      x_->whole->body_limit(Client::kMaxBodyBytes);
      bhttp::async_read(*stream_, buffer_, *x_->whole, [self = shared_from_this()](beast::error_code ec, std::size_t) {
        if (ec) return self->failedBeforeResponse(ec, self->x_->whole->got_some());
        auto& msg = self->x_->whole->get();
        ClientResponse response = toResponse(msg);
        response.body = std::move(msg.body());
        if (!self->x_->whole->keep_alive()) self->disconnect();
        self->succeed(std::move(response));
      });
      return;
    }
    x_->streamed.emplace();
    x_->streamed->body_limit(boost::none);
    bhttp::async_read_header(*stream_, buffer_, *x_->streamed,
                             [self = shared_from_this()](beast::error_code ec, std::size_t) {
                               if (ec) return self->failedBeforeResponse(ec, self->x_->streamed->got_some());
                               self->x_->response = toResponse(self->x_->streamed->get());
                               self->x_->success = self->x_->response.status >= 200 && self->x_->response.status < 300;
                               self->readBody();
                             });
  }

  void readBody() {
    Exchange& x = *x_;
    auto& parser = *x.streamed;
    if (parser.is_done()) {
      if (x.success && !x.splitter.finish(x.on_line)) x.response.complete = false;
      if (!parser.keep_alive()) disconnect();
      return succeed(std::move(x.response));
    }
    if (cancelled_.load()) return fail(cancelledError());
    parser.get().body().data = x.buf.data();
    parser.get().body().size = x.buf.size();
    bhttp::async_read_some(*stream_, buffer_, parser, [self = shared_from_this()](beast::error_code ec, std::size_t) {
      if (ec == bhttp::error::need_buffer) ec = {};
      if (ec) {
        self->disconnect();
        return self->fail(self->toError(ec, "response body"));
      }
      Exchange& ex = *self->x_;
      const std::size_t n = ex.buf.size() - ex.streamed->get().body().size;
      if (n > 0) {
        if (!ex.success) {
          if (ex.response.body.size() + n > Client::kMaxBodyBytes) {
            self->disconnect();
            return self->fail(makeError(ErrorCode::Corrupt, "http response body larger than the client limit"));
          }
          ex.response.body.append(ex.buf.data(), n);
        } else if (!ex.splitter.feed(std::string_view(ex.buf.data(), n), ex.on_line)) {
          self->disconnect();  // the rest of the stream is unwanted
          ex.response.complete = false;
          return self->succeed(std::move(ex.response));
        }
      }
      self->readBody();
    });
  }

  /// A write or the response head failed. A reused connection the server closed meanwhile fails
  /// before any response byte: that is retried once on a fresh connection.
  void failedBeforeResponse(beast::error_code ec, bool got_some) {
    disconnect();
    if (x_->reused && x_->attempts == 1 && !got_some && ec != beast::error::timeout && !cancelled_.load()) {
      x_->whole.reset();
      x_->streamed.reset();
      return attempt();
    }
    fail(toError(ec, "request"));
  }

  void succeed(ClientResponse response) {
    reusable_.store(stream_.has_value() && !cancelled_.load());
    finish(std::move(response));
  }
  void fail(Error error) {
    disconnect();
    finish(std::move(error));
  }
  void finish(Result<ClientResponse> result) {
    Done done = std::move(x_->done);
    x_.reset();
    done(std::move(result));
  }

  void disconnect() {
    if (stream_) {
      beast::error_code ec;
      (void)stream_->socket().shutdown(tcp::socket::shutdown_both, ec);
      (void)stream_->socket().close(ec);
      stream_.reset();
    }
    buffer_.clear();
    reusable_.store(false);
  }

  Error cancelledError() const { return detail::cancelledError(host_, port_); }

  Error toError(const beast::error_code& ec, std::string_view what) const {
    if (cancelled_.load()) return cancelledError();
    return detail::transportError(ec, what, host_, port_);
  }

  net::strand<net::any_io_executor> strand_;
  tcp::resolver resolver_;
  const std::string host_;
  const std::uint16_t port_;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> reusable_{false};
  std::optional<beast::tcp_stream> stream_;
  beast::flat_buffer buffer_;
  std::unique_ptr<Exchange> x_;  // the exchange in flight
};

AsyncClient::AsyncClient(const boost::asio::any_io_executor& executor, std::string host, std::uint16_t port)
    : impl_(std::make_shared<Impl>(executor, std::move(host), port)) {}

AsyncClient::~AsyncClient() {
  try {
    impl_->cancel();
  } catch (...) {  // NOLINT(bugprone-empty-catch): nothing to do, as said below
    // Posting the interruption allocates. Should that fail, the exchange in flight still sees
    // the cancelled flag (cancel() sets it first) at its next step; a destructor must not throw.
  }
}

void AsyncClient::send(ClientRequest request, std::chrono::milliseconds timeout, Done done) {
  impl_->start(std::move(request), timeout, nullptr, std::move(done));
}

void AsyncClient::streamLines(ClientRequest request, std::chrono::milliseconds timeout, LineCallback on_line,
                              Done done) {
  PD_CHECK_MSG(static_cast<bool>(on_line), "AsyncClient::streamLines needs a line callback");
  impl_->start(std::move(request), timeout, std::move(on_line), std::move(done));
}

void AsyncClient::cancel() {
  impl_->cancel();
}

bool AsyncClient::cancelled() const {
  return impl_->cancelled();
}

bool AsyncClient::reusable() const {
  return impl_->reusable();
}

}  // namespace pd::http
