// Child processes with captured output (subprocess.h).
#include "pd/common/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <thread>

extern char** environ;  // NOLINT(readability-redundant-declaration)

namespace pd::proc {

namespace {

int decodeStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 255;
}

void closeFd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

}  // namespace

Result<std::unique_ptr<Subprocess>> Subprocess::spawn(const SpawnOptions& options) {
  if (options.argv.empty()) return makeError(ErrorCode::InvalidArgument, "spawn: empty argv");
  // Everything the child needs is built before fork(): only async-signal-safe calls follow it.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string_view entry(*e);
    const auto eq = entry.find('=');
    bool replaced = false;
    for (const auto& [key, value] : options.env) {
      if (eq != std::string_view::npos && entry.substr(0, eq) == key) replaced = true;
    }
    if (!replaced) env_strings.emplace_back(entry);
  }
  for (const auto& [key, value] : options.env) env_strings.push_back(std::string(key).append("=").append(value));
  std::vector<char*> envp;
  envp.reserve(env_strings.size() + 1);
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_strings = options.argv;
  std::vector<char*> argv;
  argv.reserve(argv_strings.size() + 1);
  for (auto& a : argv_strings) argv.push_back(a.data());
  argv.push_back(nullptr);

  std::array<int, 2> out{-1, -1};
  std::array<int, 2> err{-1, -1};
  const auto fail = [&](const char* what) {
    const int saved = errno;
    for (int* fd : {&out[0], &out[1], &err[0], &err[1]}) closeFd(*fd);
    return makeError(ErrorCode::Io,
                     std::string("spawn ") + options.argv[0] + ": " + what + ": " + std::strerror(saved));
  };
  if (options.capture_stdout && ::pipe2(out.data(), O_CLOEXEC) != 0) return fail("pipe");
  if (options.capture_stderr && ::pipe2(err.data(), O_CLOEXEC) != 0) return fail("pipe");
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return fail("fork");
  if (pid == 0) {
    // Child: die with the parent (and do not miss a parent that died before this line).
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(126);
    if (out[1] >= 0) ::dup2(out[1], STDOUT_FILENO);
    if (err[1] >= 0) ::dup2(err[1], STDERR_FILENO);
    // A signal mask or ignored signals inherited from a supervisor thread must not leak in.
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::signal(SIGPIPE, SIG_DFL);
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  auto child = std::unique_ptr<Subprocess>(new Subprocess());
  child->pid_ = pid;
  closeFd(out[1]);
  closeFd(err[1]);
  child->stdout_fd_ = out[0];
  child->stderr_fd_ = err[0];
  return child;
}

Subprocess::~Subprocess() {
  if (pid_ > 0 && !exit_status_) {
    ::kill(pid_, SIGCONT);
    ::kill(pid_, SIGKILL);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
  closeFd(stdout_fd_);
  closeFd(stderr_fd_);
}

bool Subprocess::signal(int sig) {
  if (pid_ <= 0 || exit_status_) return false;
  return ::kill(pid_, sig) == 0;
}

std::optional<int> Subprocess::poll() {
  if (exit_status_) return exit_status_;
  int status = 0;
  const pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) exit_status_ = decodeStatus(status);
  return exit_status_;
}

std::optional<int> Subprocess::wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (auto s = poll()) return s;
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
}

void Subprocess::closeStdout() {
  closeFd(stdout_fd_);
}

void Subprocess::closeStderr() {
  closeFd(stderr_fd_);
}

bool LineReader::fill(std::chrono::milliseconds timeout) {
  if (eof_ || fd_ < 0) {
    eof_ = true;
    return false;
  }
  pollfd p{fd_, POLLIN, 0};
  const int ready = ::poll(&p, 1, static_cast<int>(timeout.count()));
  if (ready <= 0) return true;
  std::array<char, 4096> chunk{};
  const ssize_t n = ::read(fd_, chunk.data(), chunk.size());
  if (n > 0) {
    buffer_.append(chunk.data(), static_cast<std::size_t>(n));
    return true;
  }
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
  eof_ = true;
  return false;
}

std::optional<std::string> LineReader::take() {
  const auto nl = buffer_.find('\n');
  if (nl == std::string::npos) return std::nullopt;
  std::string line = buffer_.substr(0, nl);
  buffer_.erase(0, nl + 1);
  return line;
}

std::optional<std::string> LineReader::next(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (auto line = take()) return line;
    if (eof_) {
      if (buffer_.empty()) return std::nullopt;
      std::string rest = std::move(buffer_);
      buffer_.clear();
      return rest;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    fill(left);
  }
}

Result<std::string> selfExecutable() {
  std::error_code ec;
  auto path = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return makeError(ErrorCode::Io, "cannot read /proc/self/exe: " + ec.message());
  return path.string();
}

}  // namespace pd::proc
