// The two SpanSinks: OTLP/HTTP JSON to a collector and JSON lines in a file.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>

#include "pd/common/http_client.h"
#include "pd/trace/exporter.h"

namespace pd::trace {
namespace {

struct HttpTarget {
  std::string host;
  std::uint16_t port = 80;
  std::string path;
};

Result<HttpTarget> parseHttpUrl(std::string_view url) {
  constexpr std::string_view kScheme = "http://";
  if (url.substr(0, kScheme.size()) != kScheme) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("trace.otlp_url '{}': only http:// URLs are supported", url));
  }
  std::string_view rest = url.substr(kScheme.size());
  const auto slash = rest.find('/');
  std::string_view authority = rest.substr(0, slash);
  HttpTarget t;
  t.path = slash == std::string_view::npos ? std::string() : std::string(rest.substr(slash));
  if (t.path.empty() || t.path == "/") t.path = "/v1/traces";
  std::string_view host = authority;
  if (!authority.empty() && authority.front() == '[') {
    const auto close = authority.find(']');
    if (close == std::string_view::npos) return makeError(ErrorCode::InvalidArgument, "trace.otlp_url: bad IPv6 host");
    host = authority.substr(1, close - 1);
    authority.remove_prefix(close + 1);
    if (!authority.empty() && authority.front() != ':') {
      return makeError(ErrorCode::InvalidArgument, "trace.otlp_url: bad host");
    }
  } else {
    const auto colon = authority.rfind(':');
    host = authority.substr(0, colon);
    authority = colon == std::string_view::npos ? std::string_view() : authority.substr(colon);
  }
  if (host.empty()) return makeError(ErrorCode::InvalidArgument, fmt::format("trace.otlp_url '{}': no host", url));
  t.host = std::string(host);
  if (!authority.empty()) {
    const std::string_view port = authority.substr(1);
    unsigned value = 0;
    const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
    if (ec != std::errc() || end != port.data() + port.size() || value == 0 || value > 65535) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("trace.otlp_url '{}': bad port", url));
    }
    t.port = static_cast<std::uint16_t>(value);
  }
  return t;
}

class OtlpHttpSink final : public SpanSink {
 public:
  OtlpHttpSink(HttpTarget target, Resource resource, std::chrono::milliseconds timeout)
      : target_(std::move(target)),
        resource_(std::move(resource)),
        timeout_(timeout),
        client_(target_.host, target_.port) {}

  [[nodiscard]] std::string_view name() const override { return "otlp"; }

  Status exportBatch(std::span<const SpanData> spans) override {
    http::ClientRequest req;
    req.method = "POST";
    req.target = target_.path;
    req.headers.push_back({"Content-Type", "application/json"});
    req.body = encodeOtlpJson(resource_, spans);
    auto r = client_.send(req, timeout_);
    if (!r.ok()) {
      client_.disconnect();
      return r.error();
    }
    if (r->status < 200 || r->status > 299) {
      return makeError(ErrorCode::PeerFailed, fmt::format("collector answered HTTP {}", r->status));
    }
    return okStatus();
  }

 private:
  HttpTarget target_;
  Resource resource_;
  std::chrono::milliseconds timeout_;
  http::Client client_;
};

// Each line goes out in one write() on an O_APPEND descriptor, so the processes of one
// `pdserve up` may share a file without interleaving their lines.
class JsonLinesFileSink final : public SpanSink {
 public:
  JsonLinesFileSink(int fd, std::filesystem::path path, Resource resource)
      : fd_(fd), path_(std::move(path)), resource_(std::move(resource)) {}
  JsonLinesFileSink(const JsonLinesFileSink&) = delete;
  JsonLinesFileSink& operator=(const JsonLinesFileSink&) = delete;
  JsonLinesFileSink(JsonLinesFileSink&&) = delete;
  JsonLinesFileSink& operator=(JsonLinesFileSink&&) = delete;
  ~JsonLinesFileSink() override { ::close(fd_); }

  [[nodiscard]] std::string_view name() const override { return "file"; }

  Status exportBatch(std::span<const SpanData> spans) override {
    std::string line = encodeOtlpJson(resource_, spans);
    line += '\n';
    const ssize_t n = ::write(fd_, line.data(), line.size());
    if (n != static_cast<ssize_t>(line.size())) {
      return makeError(ErrorCode::Io, fmt::format("cannot write {}: {}", path_.string(),
                                                  n < 0 ? std::strerror(errno) : "short write"));
    }
    return okStatus();
  }

 private:
  int fd_;
  std::filesystem::path path_;
  Resource resource_;
};

}  // namespace

Result<std::unique_ptr<SpanSink>> makeOtlpHttpSink(const std::string& url, Resource resource,
                                                   std::chrono::milliseconds timeout) {
  PD_ASSIGN_OR_RETURN(HttpTarget target, parseHttpUrl(url));
  return std::unique_ptr<SpanSink>(std::make_unique<OtlpHttpSink>(std::move(target), std::move(resource), timeout));
}

Result<std::unique_ptr<SpanSink>> makeJsonLinesFileSink(const std::filesystem::path& path, Resource resource) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    return makeError(ErrorCode::Io, fmt::format("cannot open trace file {}: {}", path.string(), std::strerror(errno)));
  }
  return std::unique_ptr<SpanSink>(std::make_unique<JsonLinesFileSink>(fd, path, std::move(resource)));
}

}  // namespace pd::trace
