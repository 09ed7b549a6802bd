#pragma once
/// How a pdserve role process takes its stop signals: SIGTERM and SIGINT are blocked in every
/// thread and taken synchronously (sigwait / sigtimedwait) by the thread that runs the role, so a
/// signal never interrupts a server thread and a second Ctrl-C can cut a drain short.
/// Thread rules: blockStopSignals() before any other thread exists; the waits on the one thread
/// that runs the role.

#include <signal.h>

#include <chrono>
#include <functional>
#include <string>
#include <string_view>

#include "pd/common/result.h"

namespace pd::proc {

/// Blocks SIGTERM and SIGINT in the calling thread (and every thread it starts later); returns
/// that set. Call before any other thread exists.
sigset_t blockStopSignals();

/// Waits for one of `signals` and returns it. Meanwhile, when `check` is set, calls it every
/// 200 ms and, the first time it fails, `on_failure` with its error (then stops checking): the
/// tensor-parallel watchdog of the worker roles (a rank that exited, a dropped connection).
int waitForSignalWatching(const sigset_t& signals, const std::function<Status()>& check,
                          const std::function<void(const Error&)>& on_failure);

/// How a role's drain ended.
enum class DrainEnd { Idle, Timeout, SecondSignal };

/// The drain wait of the roles: calls `idle` (which may block briefly, up to ~50 ms, and returns
/// true once nothing is in flight) until it is true, `timeout` passes, or one of `signals`
/// arrives again (a second Ctrl-C). Logs the two early ends with `what_is_left()`.
DrainEnd waitForDrain(const std::function<bool()>& idle, const sigset_t& signals, std::chrono::milliseconds timeout,
                      std::string_view component, const std::function<std::string()>& what_is_left);

}  // namespace pd::proc
