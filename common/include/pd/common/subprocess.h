#pragma once
/// Child processes for `pdserve up` (a router and its workers) and for end-to-end tests that
/// run the real binaries: spawn with pipes on stdout/stderr, read their output line by line,
/// signal, and reap with a deadline. A child gets SIGKILL when its parent dies (Linux
/// PR_SET_PDEATHSIG), so a crashed supervisor or test never leaves workers behind.
///
/// Thread rules: a Subprocess is used by one thread at a time. LineReader is one thread's.

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pd/common/result.h"

namespace pd::proc {

struct SpawnOptions {
  std::vector<std::string> argv;  ///< argv[0] is the executable's path (no PATH search)
  /// Added to (or replacing in) the parent's environment.
  std::vector<std::pair<std::string, std::string>> env;
  bool capture_stdout = true;  ///< else inherited
  bool capture_stderr = true;  ///< else inherited
};

class Subprocess {
 public:
  /// Starts the child. Io when the pipes or the fork fail; a missing executable shows up as
  /// the child exiting with 127.
  [[nodiscard]] static Result<std::unique_ptr<Subprocess>> spawn(const SpawnOptions& options);
  /// SIGKILLs and reaps a child still running; closes the pipes.
  ~Subprocess();
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  Subprocess(Subprocess&&) = delete;
  Subprocess& operator=(Subprocess&&) = delete;

  [[nodiscard]] pid_t pid() const { return pid_; }
  /// Read ends of the captured pipes (-1 when not captured or closed).
  [[nodiscard]] int stdoutFd() const { return stdout_fd_; }
  [[nodiscard]] int stderrFd() const { return stderr_fd_; }
  /// Sends `signal` unless the child was reaped already. False if it was.
  bool signal(int signal);
  /// The exit status if the child has exited (reaping it): the exit code, or 128 + the signal
  /// number for a child killed by a signal. Never blocks.
  std::optional<int> poll();
  /// As poll(), waiting up to `timeout`.
  std::optional<int> wait(std::chrono::milliseconds timeout);
  /// Closes the read end of the captured stdout/stderr (to stop reading one).
  void closeStdout();
  void closeStderr();

 private:
  Subprocess() = default;
  pid_t pid_ = -1;
  int stdout_fd_ = -1;
  int stderr_fd_ = -1;
  std::optional<int> exit_status_;
};

/// Splits what a file descriptor yields into lines ("\n"-terminated, without it).
class LineReader {
 public:
  explicit LineReader(int fd) : fd_(fd) {}
  /// The next line, waiting up to `timeout`; nullopt on timeout or end of file (then eof()).
  std::optional<std::string> next(std::chrono::milliseconds timeout);
  /// Reads what is available now without waiting; calls `on_line` for each complete line.
  /// Returns false at end of file (the unterminated rest, if any, is handed over first).
  template <class F>
  bool drain(F&& on_line) {
    const bool open = fill(std::chrono::milliseconds{0});
    while (auto line = take()) on_line(*line);
    if (!open && !buffer_.empty()) {
      on_line(buffer_);
      buffer_.clear();
    }
    return open;
  }
  [[nodiscard]] bool eof() const { return eof_; }

 private:
  // Reads once if data arrives within `timeout`. False at end of file.
  bool fill(std::chrono::milliseconds timeout);
  std::optional<std::string> take();

  int fd_;
  std::string buffer_;
  bool eof_ = false;
};

/// The path of the running executable (/proc/self/exe).
[[nodiscard]] Result<std::string> selfExecutable();

}  // namespace pd::proc
