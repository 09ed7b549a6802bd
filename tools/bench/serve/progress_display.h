#pragma once
/// The tty progress bar of `pdserve bench serve`: redraws progressLine() for one level on stderr
/// every 200 ms until destroyed, then clears the line. The tokens/s it shows count from the end
/// of the level's warm-up.
///
/// Thread rules: constructed and destroyed on one thread; it reads `progress` (atomics, written
/// by the sending threads) from its own drawing thread.

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "bench/serve/runner.h"

namespace pd::bench {

class ProgressDisplay {
 public:
  /// Starts drawing; `progress` must outlive this object.
  ProgressDisplay(std::string label, const LevelProgress& progress);
  /// Stops drawing and clears the line.
  ~ProgressDisplay();
  ProgressDisplay(const ProgressDisplay&) = delete;
  ProgressDisplay& operator=(const ProgressDisplay&) = delete;
  ProgressDisplay(ProgressDisplay&&) = delete;
  ProgressDisplay& operator=(ProgressDisplay&&) = delete;

 private:
  void loop();

  std::string label_;
  const LevelProgress& progress_;
  std::chrono::steady_clock::time_point start_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;   // guarded by mutex_
  std::thread thread_;  // last: started after everything it reads
};

}  // namespace pd::bench
