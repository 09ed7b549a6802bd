// Shared helpers of the `pdserve bench` subcommands (bench_util.h).
#include "bench_util.h"

#include <fmt/format.h>
#include <time.h>

#include <algorithm>
#include <charconv>
#include <memory>

namespace pd::cli {

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

}  // namespace pd::cli
