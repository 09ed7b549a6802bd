// Shared helpers of the `pdserve bench` subcommands (bench_util.h).
#include "bench/common/bench_util.h"

#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>

extern char** environ;  // NOLINT(readability-redundant-declaration)

namespace pd::bench {

double secondsSince(BenchClock::time_point t) {
  return std::chrono::duration<double>(BenchClock::now() - t).count();
}

double processCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

double measureReadBandwidth(model::ThreadPool& pool, const model::KernelTable& k, std::size_t bytes) {
  const std::size_t n = bytes / sizeof(float);
  std::unique_ptr<float[]> buf(new float[n]);
  pool.parallelFor(static_cast<std::int64_t>(n), 1 << 20, [&](std::int64_t b, std::int64_t e) {
    std::fill(buf.get() + b, buf.get() + e, 1.0F);  // first touch by the threads that read it
  });
  const std::int64_t chunk = 1 << 16;  // 256 KiB per task
  const auto tasks = static_cast<std::int64_t>((n + chunk - 1) / chunk);
  std::vector<float> sink(static_cast<std::size_t>(tasks));
  double best = 0.0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = BenchClock::now();
    pool.run(tasks, [&](std::int64_t t) {
      const std::int64_t b = t * chunk;
      const std::int64_t len = std::min<std::int64_t>(chunk, static_cast<std::int64_t>(n) - b);
      sink[static_cast<std::size_t>(t)] = k.dot(buf.get() + b, buf.get() + b, len);  // one read of each line
    });
    best = std::max(best, static_cast<double>(n * sizeof(float)) / secondsSince(t0));
  }
  return best;
}

Result<std::vector<std::int64_t>> positiveIntegers(std::string_view text) {
  std::vector<std::int64_t> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t end = text.find(',', pos);
    if (end == std::string_view::npos) end = text.size();
    std::int64_t v = 0;
    const auto res = std::from_chars(text.data() + pos, text.data() + end, v);
    if (res.ec != std::errc() || res.ptr != text.data() + end || v < 1) {
      return makeError(ErrorCode::InvalidArgument, std::string(text.substr(pos, end - pos)));
    }
    out.push_back(v);
    pos = end + 1;
  }
  return out;
}

Result<std::vector<std::int64_t>> parsePositiveList(const std::string& text, const std::string& option) {
  auto list = positiveIntegers(text);
  if (!list.ok()) return makeError(ErrorCode::InvalidArgument, fmt::format("{}: bad list '{}'", option, text));
  return list;
}

std::optional<pid_t> spawnWithUcxEnv(const std::vector<std::string>& argv, const UcxEnv& ucx, int stdout_fd) {
  std::vector<std::string> env_storage;
  for (char** e = environ; *e != nullptr; ++e) {
    const bool overridden = std::any_of(ucx.begin(), ucx.end(), [&](const auto& kv) {
      const std::string prefix = fmt::format("UCX_{}=", kv.first);
      return std::strncmp(*e, prefix.c_str(), prefix.size()) == 0;
    });
    if (!overridden) env_storage.emplace_back(*e);
  }
  for (const auto& [name, value] : ucx) env_storage.push_back(fmt::format("UCX_{}={}", name, value));
  std::vector<char*> envp;
  envp.reserve(env_storage.size() + 1);
  for (auto& e : env_storage) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = argv;
  std::vector<char*> argp;
  argp.reserve(args.size() + 1);
  for (auto& a : args) argp.push_back(a.data());
  argp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, stdout_fd, STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, stdout_fd, STDERR_FILENO);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, argp[0], &actions, nullptr, argp.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return std::nullopt;
  return pid;
}

bool reapWithin(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = BenchClock::now() + timeout;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (BenchClock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

namespace {

int freeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

std::string slurp(std::FILE* f) {
  std::string text;
  if (std::fseek(f, 0, SEEK_SET) != 0) return text;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) text.append(buf, n);
  return text;
}

}  // namespace

Result<std::string> runPerftestPair(const std::string& perftest, const std::vector<std::string>& client_args,
                                    const UcxEnv& ucx) {
  for (int attempt = 0; attempt < 5; ++attempt) {
    const std::string port = std::to_string(freeLoopbackPort());
    std::FILE* server_out = std::tmpfile();
    std::FILE* client_out = std::tmpfile();
    if (server_out == nullptr || client_out == nullptr) {
      if (server_out != nullptr) std::fclose(server_out);
      if (client_out != nullptr) std::fclose(client_out);
      return makeError(ErrorCode::Io, "tmpfile");
    }
    const auto server = spawnWithUcxEnv({perftest, "-p", port}, ucx, fileno(server_out));
    if (!server) {
      std::fclose(server_out);
      std::fclose(client_out);
      return makeError(ErrorCode::NotFound, fmt::format("cannot run '{}' (ucx-utils)", perftest));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let the server listen
    std::vector<std::string> argv = {perftest, "127.0.0.1", "-p", port};
    argv.insert(argv.end(), client_args.begin(), client_args.end());
    const auto client = spawnWithUcxEnv(argv, ucx, fileno(client_out));
    const bool ok = client && reapWithin(*client, std::chrono::seconds(120));
    (void)reapWithin(*server, std::chrono::seconds(ok ? 10 : 1));
    std::string text = slurp(client_out);
    std::fclose(server_out);
    std::fclose(client_out);
    if (ok) return text;
  }
  return makeError(ErrorCode::Internal, "ucx_perftest failed 5 times");
}

std::vector<std::string> lastCsvRow(std::string_view text) {
  const auto last = text.find_last_not_of("\n ");
  if (last == std::string_view::npos) return {};
  const auto start = text.rfind('\n', last);
  const std::string_view line = text.substr(start == std::string_view::npos ? 0 : start + 1,
                                            last + 1 - (start == std::string_view::npos ? 0 : start + 1));
  std::vector<std::string> cols;
  for (std::size_t p = 0; p <= line.size();) {
    const std::size_t c = std::min(line.find(',', p), line.size());
    cols.emplace_back(line.substr(p, c - p));
    p = c + 1;
  }
  return cols;
}

}  // namespace pd::bench
