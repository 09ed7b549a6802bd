#include "pd/common/http_client.h"

#include <fmt/format.h>

#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <optional>
#include <utility>

#include "client_wire.h"

namespace pd::http {

namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

using detail::kStreamReadBytes;
using detail::toResponse;

bool LineSplitter::feed(std::string_view data, const LineCallback& on_line) {
  while (!data.empty()) {
    const auto nl = data.find('\n');
    if (nl == std::string_view::npos) {
      partial_.append(data);
      return true;
    }
    std::string_view line;
    if (partial_.empty()) {
      line = data.substr(0, nl);
    } else {
      partial_.append(data.substr(0, nl));
      line = partial_;
    }
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const bool go_on = on_line(line);
    partial_.clear();
    data.remove_prefix(nl + 1);
    if (!go_on) return false;
  }
  return true;
}

bool LineSplitter::finish(const LineCallback& on_line) {
  if (partial_.empty()) return true;
  std::string line = std::move(partial_);
  partial_.clear();
  if (!line.empty() && line.back() == '\r') line.pop_back();
  return on_line(line);
}

bool SseParser::feedLine(std::string_view line, const EventCallback& on_event) {
  if (line.empty()) {
    if (!has_data_) {
      current_ = SseEvent{};
      return true;
    }
    SseEvent event = std::move(current_);
    current_ = SseEvent{};
    has_data_ = false;
    return on_event(event);
  }
  if (line.front() == ':') return true;  // comment
  std::string_view field = line;
  std::string_view value;
  if (const auto colon = line.find(':'); colon != std::string_view::npos) {
    field = line.substr(0, colon);
    value = line.substr(colon + 1);
    if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  }
  if (field == "data") {
    if (has_data_) current_.data += '\n';
    current_.data.append(value);
    has_data_ = true;
  } else if (field == "event") {
    current_.event = std::string(value);
  } else if (field == "id") {
    current_.id = std::string(value);
  }
  return true;
}

class Client::Impl {
 public:
  Impl(std::string host, std::uint16_t port) : host_(std::move(host)), port_(port) {}

  Result<ClientResponse> send(const ClientRequest& request, std::chrono::milliseconds timeout) {
    if (cancelled_.load()) return cancelledError();
    const auto deadline = Clock::now() + timeout;
    for (int attempt = 0;; ++attempt) {
      const bool reused = stream_.has_value();
      PD_TRY(ensureConnected(deadline));
      beast::error_code ec = writeRequest(request, deadline);
      bhttp::response_parser<bhttp::string_body> parser;
      parser.body_limit(kMaxBodyBytes);
      if (!ec) {
        ec = run([&](auto handler) { bhttp::async_read(*stream_, buffer_, parser, std::move(handler)); });
      }
      if (ec) {
        disconnect();
        // A reused connection the server closed meanwhile fails before any response byte: retry once.
        if (reused && attempt == 0 && !parser.got_some() && ec != beast::error::timeout) continue;
        return toError(ec, "request");
      }
      auto& msg = parser.get();
      ClientResponse response = toResponse(msg);
      response.body = std::move(msg.body());
      if (!parser.keep_alive()) disconnect();
      return response;
    }
  }

  Result<ClientResponse> stream(const ClientRequest& request, std::chrono::milliseconds timeout,
                                const LineCallback& on_line) {
    if (cancelled_.load()) return cancelledError();
    const auto deadline = Clock::now() + timeout;
    for (int attempt = 0;; ++attempt) {
      const bool reused = stream_.has_value();
      PD_TRY(ensureConnected(deadline));
      beast::error_code ec = writeRequest(request, deadline);
      bhttp::response_parser<bhttp::buffer_body> parser;
      parser.body_limit(boost::none);
      if (!ec) {
        ec = run([&](auto handler) { bhttp::async_read_header(*stream_, buffer_, parser, std::move(handler)); });
      }
      if (ec) {
        disconnect();
        if (reused && attempt == 0 && !parser.got_some() && ec != beast::error::timeout) continue;
        return toError(ec, "request");
      }
      ClientResponse response = toResponse(parser.get());
      const bool success = response.status >= 200 && response.status < 300;
      LineSplitter splitter;
      std::array<char, kStreamReadBytes> buf{};
      while (!parser.is_done()) {
        parser.get().body().data = buf.data();
        parser.get().body().size = buf.size();
        ec = run([&](auto handler) { bhttp::async_read_some(*stream_, buffer_, parser, std::move(handler)); });
        if (ec == bhttp::error::need_buffer) ec = {};
        if (ec) {
          disconnect();
          return toError(ec, "response body");
        }
        const std::size_t n = buf.size() - parser.get().body().size;
        if (n == 0) continue;
        if (!success) {
          if (response.body.size() + n > kMaxBodyBytes) {
            disconnect();
            return makeError(ErrorCode::Corrupt, "http response body larger than the client limit");
          }
          response.body.append(buf.data(), n);
        } else if (!splitter.feed(std::string_view(buf.data(), n), on_line)) {
          disconnect();  // the rest of the stream is unwanted
          response.complete = false;
          return response;
        }
      }
      if (success && !splitter.finish(on_line)) response.complete = false;
      if (!parser.keep_alive()) disconnect();
      return response;
    }
  }

  void disconnect() {
    if (stream_) {
      beast::error_code ec;
      (void)stream_->socket().shutdown(tcp::socket::shutdown_both, ec);
      (void)stream_->socket().close(ec);
      stream_.reset();
    }
    buffer_.clear();
  }

  [[nodiscard]] bool cancelled() const { return cancelled_.load(); }

  void cancel() {
    cancelled_.store(true);
    // Runs on the calling thread inside the io_context (posting is thread-safe).
    net::post(ioc_, [this] { interrupt(); });
  }

 private:
  void interrupt() {
    if (stream_) stream_->cancel();
  }

  Result<ClientResponse> cancelledError() const { return detail::cancelledError(host_, port_); }

  /// Starts an async operation with a completion handler and runs the io_context until it is done.
  template <class Start>
  beast::error_code run(Start&& start) {
    beast::error_code result;
    bool done = false;
    start([&result, &done](beast::error_code ec, auto&&...) {
      result = ec;
      done = true;
    });
    if (cancelled_.load()) interrupt();  // a cancel() that came between two operations
    ioc_.restart();
    ioc_.run();
    PD_CHECK_MSG(done, "client operation did not complete");
    return result;
  }

  Status ensureConnected(Clock::time_point deadline) {
    if (stream_) return okStatus();
    const std::string where = fmt::format("{}:{}", host_, port_);
    beast::error_code ec;
    std::vector<tcp::endpoint> endpoints;
    const auto address = net::ip::make_address(host_, ec);
    if (!ec) {
      endpoints.emplace_back(address, port_);
    } else {
      tcp::resolver resolver(ioc_);
      net::steady_timer timer(ioc_, deadline);
      tcp::resolver::results_type results;
      timer.async_wait([&](beast::error_code tec) {
        if (!tec) resolver.cancel();
      });
      ec = run([&](auto handler) {
        resolver.async_resolve(
            host_, std::to_string(port_),
            [&results, &timer, h = std::move(handler)](beast::error_code rec, tcp::resolver::results_type r) mutable {
              results = std::move(r);
              timer.cancel();
              h(rec);
            });
      });
      if (ec == net::error::operation_aborted) {
        return makeError(ErrorCode::Timeout, fmt::format("http {}: resolving the host took past the deadline", where));
      }
      if (ec || results.empty()) {
        return makeError(ErrorCode::InvalidArgument, fmt::format("http {}: cannot resolve the host", where));
      }
      for (const auto& r : results) endpoints.push_back(r.endpoint());
    }
    stream_.emplace(ioc_);
    stream_->expires_at(deadline);
    ec = run([&](auto handler) { stream_->async_connect(endpoints, std::move(handler)); });
    if (ec) {
      disconnect();
      return toError(ec, "connect").error();
    }
    (void)stream_->socket().set_option(tcp::no_delay(true), ec);
    return okStatus();
  }

  beast::error_code writeRequest(const ClientRequest& request, Clock::time_point deadline) {
    bhttp::request<bhttp::string_body> req;
    detail::buildRequest(request, host_, port_, req);
    stream_->expires_at(deadline);
    return run([&](auto handler) { bhttp::async_write(*stream_, req, std::move(handler)); });
  }

  Result<ClientResponse> toError(const beast::error_code& ec, std::string_view what) const {
    if (cancelled_.load()) return cancelledError();
    return detail::transportError(ec, what, host_, port_);
  }

  std::string host_;
  std::uint16_t port_;
  std::atomic<bool> cancelled_{false};
  net::io_context ioc_{1};
  std::optional<beast::tcp_stream> stream_;
  beast::flat_buffer buffer_;
};

Client::Client(std::string host, std::uint16_t port) : impl_(std::make_unique<Impl>(std::move(host), port)) {}
Client::Client(Client&&) noexcept = default;
Client& Client::operator=(Client&&) noexcept = default;
Client::~Client() = default;

Result<ClientResponse> Client::send(const ClientRequest& request, std::chrono::milliseconds timeout) {
  return impl_->send(request, timeout);
}

Result<ClientResponse> Client::streamLines(const ClientRequest& request, std::chrono::milliseconds timeout,
                                           const LineCallback& on_line) {
  return impl_->stream(request, timeout, on_line);
}

Result<ClientResponse> Client::streamEvents(const ClientRequest& request, std::chrono::milliseconds timeout,
                                            const EventCallback& on_event) {
  SseParser parser;
  return impl_->stream(request, timeout, [&](std::string_view line) { return parser.feedLine(line, on_event); });
}

void Client::disconnect() {
  impl_->disconnect();
}

void Client::cancel() {
  impl_->cancel();
}

bool Client::cancelled() const {
  return impl_->cancelled();
}

}  // namespace pd::http
