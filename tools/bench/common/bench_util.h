#pragma once
/// Helpers shared by the `pdserve bench` benchmarks that measure the CPU engine against
/// ceilings measured in the same run (bench engine, bench decode): timing, CPU time, the
/// read-bandwidth probe, and list options; and the one ucx_perftest runner of the benches that
/// compare with it (bench kv, bench comm).
/// Thread rules: main thread only (the probe runs on the given thread pool).

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pd/common/result.h"
#include "pd/engine/kernels.h"
#include "pd/engine/thread_pool.h"

namespace pd::bench {

using BenchClock = std::chrono::steady_clock;

/// Seconds since `t`.
[[nodiscard]] double secondsSince(BenchClock::time_point t);

/// CPU seconds this process has used (all threads).
[[nodiscard]] double processCpuSeconds();

/// Best-of-5 read bandwidth of a streaming pass over `bytes` with every thread of `pool`, in
/// bytes/s (one read of each cache line, first-touched by the threads that read it).
[[nodiscard]] double measureReadBandwidth(model::ThreadPool& pool, const model::KernelTable& k, std::size_t bytes);

/// "1,4,16" -> {1, 4, 16}; every entry >= 1. InvalidArgument naming `option` otherwise.
[[nodiscard]] Result<std::vector<std::int64_t>> parsePositiveList(const std::string& text, const std::string& option);

/// Environment entries for a child, as UCX_<name>=<value> (e.g. {"TLS", "tcp,sm"}).
using UcxEnv = std::vector<std::pair<std::string, std::string>>;

/// Starts `argv` (PATH search) with stdout and stderr to `stdout_fd` and the environment plus
/// `ucx` (replacing UCX_<name> variables already set); nullopt when it cannot start.
[[nodiscard]] std::optional<pid_t> spawnWithUcxEnv(const std::vector<std::string>& argv, const UcxEnv& ucx,
                                                   int stdout_fd);

/// Waits for `pid` up to `timeout`; kills it after that. True when it exited with status 0.
bool reapWithin(pid_t pid, std::chrono::milliseconds timeout);

}  // namespace pd::bench
