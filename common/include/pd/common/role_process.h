#pragma once
/// One pdserve role process (`pdserve router|prefill|decode|up ...`) seen from the process that
/// supervises it: `pdserve up`, `pdserve bench router` and the end-to-end tests. The child is
/// started with its command line, is ready once it prints its one `PDSERVE_READY role=R url=U`
/// line on stdout (which gives its address), and is stopped with SIGTERM (it drains) and SIGKILL
/// after a deadline. A background thread reads the child's stdout (and stderr when captured) line
/// by line, hands every line to `on_line` and notes the READY line.
///
/// Thread rules: the RoleProcess is one owner thread's (spawn, waitReady, signal, poll, stop);
/// `on_line` runs on the reader thread (it must not call back into this object); url(), ready(),
/// hostPort(), host() and port() may be called from any thread.

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "pd/common/result.h"
#include "pd/common/subprocess.h"

namespace pd::proc {

/// What starts every role's readiness line.
inline constexpr std::string_view kReadyPrefix = "PDSERVE_READY ";

/// The fields of a readiness line ("PDSERVE_READY role=decode url=http://127.0.0.1:40123 ...").
struct ReadyLine {
  std::string role;
  std::string url;  ///< "http://host:port"
};
/// Parses one stdout line; nullopt unless it is a readiness line with a url.
[[nodiscard]] std::optional<ReadyLine> parseReadyLine(std::string_view line);

/// "http://127.0.0.1:40123" -> "127.0.0.1:40123" (a url without a scheme is returned as is).
[[nodiscard]] std::string hostPortOf(std::string_view url);

/// Which of the child's streams a line came from.
enum class OutputStream { Stdout, Stderr };

struct RoleProcessOptions {
  /// The whole command line: argv[0] is the executable's path, then the role and its flags.
  std::vector<std::string> argv;
  /// Added to (or replacing in) this process's environment.
  std::vector<std::pair<std::string, std::string>> env;
  /// Capture stderr and hand its lines to `on_line`; else the child writes to this process's.
  bool capture_stderr = false;
  /// Every line the child prints (the READY line included), on the reader thread. May be empty.
  std::function<void(OutputStream, const std::string&)> on_line;
};

class RoleProcess {
 public:
  /// Starts the child; returns at once (waitReady() waits for its READY line). Io when the
  /// process cannot be started.
  [[nodiscard]] static Result<std::unique_ptr<RoleProcess>> spawn(RoleProcessOptions options);
  /// SIGKILLs and reaps a child still running, then joins the reader thread.
  ~RoleProcess();
  RoleProcess(const RoleProcess&) = delete;
  RoleProcess& operator=(const RoleProcess&) = delete;
  RoleProcess(RoleProcess&&) = delete;
  RoleProcess& operator=(RoleProcess&&) = delete;

  /// Blocks until the READY line came (ok), the child exited or closed its stdout first
  /// (PeerFailed, naming its exit status), or `timeout` passed (Timeout).
  [[nodiscard]] Status waitReady(std::chrono::milliseconds timeout);
  /// True once the READY line came. Thread-safe.
  [[nodiscard]] bool ready() const;
  /// The url of the READY line ("http://host:port"); empty before it. Thread-safe.
  [[nodiscard]] std::string url() const;
  /// "host:port" of url().
  [[nodiscard]] std::string hostPort() const { return hostPortOf(url()); }
  [[nodiscard]] std::string host() const;
  /// 0 before the READY line.
  [[nodiscard]] std::uint16_t port() const;

  [[nodiscard]] pid_t pid() const { return process_->pid(); }
  /// Sends `signal` unless the child was reaped already (false then).
  bool signal(int signal) { return process_->signal(signal); }
  /// The exit status once the child exited (reaping it; see Subprocess::poll); never blocks.
  std::optional<int> poll() { return process_->poll(); }
  /// As poll(), waiting up to `timeout`.
  std::optional<int> wait(std::chrono::milliseconds timeout) { return process_->wait(timeout); }
  /// SIGCONT + SIGTERM (the role drains), then waits up to `timeout`; SIGKILL after it. The
  /// exit status; nullopt when the child had to be killed.
  std::optional<int> stop(std::chrono::milliseconds timeout);

 private:
  explicit RoleProcess(std::unique_ptr<Subprocess> process, RoleProcessOptions options);
  void readOutput();

  std::unique_ptr<Subprocess> process_;
  RoleProcessOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::string url_;      // guarded by mutex_
  bool closed_ = false;  // guarded by mutex_: stdout reached its end
  std::thread reader_;   // last: starts once everything it reads exists
};

}  // namespace pd::proc
