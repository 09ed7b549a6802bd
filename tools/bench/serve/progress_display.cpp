// The tty progress bar of bench serve (progress_display.h).
#include "bench/serve/progress_display.h"

#include <cstdio>

#include "bench/serve/report.h"

namespace pd::bench {

ProgressDisplay::ProgressDisplay(std::string label, const LevelProgress& progress)
    : label_(std::move(label)), progress_(progress), start_(std::chrono::steady_clock::now()) {
  thread_ = std::thread([this] { loop(); });
}

ProgressDisplay::~ProgressDisplay() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  std::fputs("\r\x1b[K", stderr);
  std::fflush(stderr);
}

void ProgressDisplay::loop() {
  std::unique_lock lock(mutex_);
  bool was_warming = true;
  while (!stop_) {
    const bool warming = progress_.warming_up.load();
    if (was_warming && !warming) start_ = std::chrono::steady_clock::now();
    was_warming = warming;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const auto line =
        progressLine(label_, progress_.done.load(), progress_.total.load(), progress_.failed.load(),
                     elapsed > 0 ? static_cast<double>(progress_.output_tokens.load()) / elapsed : 0, warming);
    std::fprintf(stderr, "\r%s\x1b[K", line.c_str());
    std::fflush(stderr);
    cv_.wait_for(lock, std::chrono::milliseconds(200), [this] { return stop_; });
  }
}

}  // namespace pd::bench
