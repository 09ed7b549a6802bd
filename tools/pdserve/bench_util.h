#pragma once
/// Helpers shared by the `pdserve bench` subcommands that measure the CPU engine against
/// ceilings measured in the same run (cmd_bench_engine.cpp, cmd_bench_decode.cpp): timing, CPU
/// time, the read-bandwidth probe, and list options.
/// Thread rules: main thread only (the probe runs on the given thread pool).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "pd/common/model/kernels.h"
#include "pd/common/model/thread_pool.h"
#include "pd/common/result.h"

namespace pd::cli {

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

}  // namespace pd::cli
