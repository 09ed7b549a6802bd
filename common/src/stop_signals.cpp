// Synchronous stop signals of the role processes (stop_signals.h).
#include "pd/common/stop_signals.h"

#include <pthread.h>

#include <ctime>

#include "pd/common/log.h"

namespace pd::proc {

sigset_t blockStopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

int waitForSignalWatching(const sigset_t& signals, const std::function<Status()>& check,
                          const std::function<void(const Error&)>& on_failure) {
  bool watching = static_cast<bool>(check);
  for (;;) {
    const timespec tick{0, 200'000'000};
    const int sig = ::sigtimedwait(&signals, nullptr, watching ? &tick : nullptr);
    if (sig > 0) return sig;
    if (!watching) continue;
    if (Status s = check(); !s.ok()) {
      on_failure(s.error());
      watching = false;
    }
  }
}

DrainEnd waitForDrain(const std::function<bool()>& idle, const sigset_t& signals, std::chrono::milliseconds timeout,
                      std::string_view component, const std::function<std::string()>& what_is_left) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!idle()) {
    if (std::chrono::steady_clock::now() >= deadline) {
      log::warn(component, "drain timeout ({} ms) passed: aborting {}", timeout.count(), what_is_left());
      return DrainEnd::Timeout;
    }
    const timespec zero{0, 0};
    if (::sigtimedwait(&signals, nullptr, &zero) > 0) {
      log::warn(component, "second signal: aborting {}", what_is_left());
      return DrainEnd::SecondSignal;
    }
  }
  return DrainEnd::Idle;
}

}  // namespace pd::proc
