// Shared helpers of the `pdserve bench` subcommands (bench_util.h).
#include "bench/common/bench_util.h"

#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
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

Result<std::vector<std::int64_t>> parsePositiveList(const std::string& text, const std::string& option) {
  std::vector<std::int64_t> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    std::int64_t v = 0;
    const auto res = std::from_chars(text.data() + pos, text.data() + end, v);
    if (res.ec != std::errc() || res.ptr != text.data() + end || v < 1) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("{}: bad list '{}'", option, text));
    }
    out.push_back(v);
    pos = end + 1;
  }
  return out;
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

}  // namespace pd::bench
