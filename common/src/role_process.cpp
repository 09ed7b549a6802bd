// One supervised pdserve role process (role_process.h).
#include "pd/common/role_process.h"

#include <poll.h>
#include <signal.h>

#include <algorithm>
#include <charconv>

namespace pd::proc {

std::optional<ReadyLine> parseReadyLine(std::string_view line) {
  if (!line.starts_with(kReadyPrefix)) return std::nullopt;
  const auto field = [&](std::string_view name) -> std::optional<std::string> {
    const std::string key = " " + std::string(name) + "=";
    const auto pos = line.find(key);
    if (pos == std::string_view::npos) return std::nullopt;
    auto value = line.substr(pos + key.size());
    return std::string(value.substr(0, value.find(' ')));
  };
  auto url = field("url");
  if (!url || url->empty()) return std::nullopt;
  return ReadyLine{field("role").value_or(""), std::move(*url)};
}

std::string hostPortOf(std::string_view url) {
  constexpr std::string_view kScheme = "http://";
  if (url.starts_with(kScheme)) url.remove_prefix(kScheme.size());
  return std::string(url);
}

Result<std::unique_ptr<RoleProcess>> RoleProcess::spawn(RoleProcessOptions options) {
  SpawnOptions so;
  so.argv = options.argv;
  so.env = options.env;
  so.capture_stdout = true;
  so.capture_stderr = options.capture_stderr;
  PD_ASSIGN_OR_RETURN(auto process, Subprocess::spawn(so));
  return std::unique_ptr<RoleProcess>(new RoleProcess(std::move(process), std::move(options)));
}

RoleProcess::RoleProcess(std::unique_ptr<Subprocess> process, RoleProcessOptions options)
    : process_(std::move(process)), options_(std::move(options)), reader_([this] { readOutput(); }) {}

RoleProcess::~RoleProcess() {
  // Killing the child ends its output, so the reader sees the end of both streams.
  if (!process_->poll()) {
    process_->signal(SIGKILL);
    process_->wait(std::chrono::seconds{10});
  }
  if (reader_.joinable()) reader_.join();
}

void RoleProcess::readOutput() {
  LineReader out(process_->stdoutFd());
  std::optional<LineReader> err;
  if (process_->stderrFd() >= 0) err.emplace(process_->stderrFd());
  const auto on_stdout = [&](const std::string& line) {
    if (auto ready = parseReadyLine(line)) {
      std::lock_guard lock(mutex_);
      if (url_.empty()) url_ = ready->url;
      changed_.notify_all();
    }
    if (options_.on_line) options_.on_line(OutputStream::Stdout, line);
  };
  const auto on_stderr = [&](const std::string& line) {
    if (options_.on_line) options_.on_line(OutputStream::Stderr, line);
  };
  while (!out.eof() || (err && !err->eof())) {
    std::vector<pollfd> fds;
    if (!out.eof()) fds.push_back({process_->stdoutFd(), POLLIN, 0});
    if (err && !err->eof()) fds.push_back({process_->stderrFd(), POLLIN, 0});
    ::poll(fds.data(), fds.size(), 500);
    if (!out.eof()) out.drain(on_stdout);
    if (err && !err->eof()) err->drain(on_stderr);
    if (out.eof()) {
      std::lock_guard lock(mutex_);
      if (!closed_) {
        closed_ = true;
        changed_.notify_all();
      }
    }
  }
}

Status RoleProcess::waitReady(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::string name = options_.argv.size() > 1 ? options_.argv[1] : options_.argv.front();
  std::unique_lock lock(mutex_);
  while (url_.empty()) {
    if (closed_) {
      lock.unlock();
      // Its stdout ended: it exited (or is about to); give it a moment to be reaped.
      const auto status = process_->wait(std::chrono::seconds{5});
      return makeError(ErrorCode::PeerFailed,
                       "pdserve " + name + " exited before it was ready" +
                           (status ? " (status " + std::to_string(*status) + ")" : std::string()));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return makeError(ErrorCode::Timeout,
                       "pdserve " + name + " was not ready within " + std::to_string(timeout.count()) + " ms");
    }
    // The child may also exit without closing stdout (a grandchild holds it): look every 200 ms.
    changed_.wait_until(lock, std::min(deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds{200}));
    if (url_.empty() && process_->poll()) {
      return makeError(ErrorCode::PeerFailed, "pdserve " + name + " exited before it was ready (status " +
                                                  std::to_string(*process_->poll()) + ")");
    }
  }
  return okStatus();
}

bool RoleProcess::ready() const {
  std::lock_guard lock(mutex_);
  return !url_.empty();
}

std::string RoleProcess::url() const {
  std::lock_guard lock(mutex_);
  return url_;
}

std::string RoleProcess::host() const {
  const std::string hp = hostPort();
  return hp.substr(0, hp.rfind(':'));
}

std::uint16_t RoleProcess::port() const {
  const std::string hp = hostPort();
  const auto colon = hp.rfind(':');
  if (colon == std::string::npos) return 0;
  unsigned value = 0;
  const auto [end, ec] = std::from_chars(hp.data() + colon + 1, hp.data() + hp.size(), value);
  if (ec != std::errc() || end != hp.data() + hp.size() || value > 65535) return 0;
  return static_cast<std::uint16_t>(value);
}

std::optional<int> RoleProcess::stop(std::chrono::milliseconds timeout) {
  if (auto status = process_->poll()) return status;
  process_->signal(SIGCONT);
  process_->signal(SIGTERM);
  if (auto status = process_->wait(timeout)) return status;
  process_->signal(SIGKILL);
  process_->wait(std::chrono::seconds{10});
  return std::nullopt;
}

}  // namespace pd::proc
