#pragma once
/// PD_CHECK: always-on invariant checks. A failed check is a bug: it prints file:line and the
/// condition, then aborts. Never use it for input that a user or peer can get wrong; return a
/// Result for that (see result.h). Thread-safe.

namespace pd::detail {
[[noreturn]] void checkFailed(const char* file, int line, const char* condition, const char* message);
}  // namespace pd::detail

#define PD_CHECK(cond)                                               \
  do {                                                               \
    if (!(cond)) [[unlikely]] {                                      \
      ::pd::detail::checkFailed(__FILE__, __LINE__, #cond, nullptr); \
    }                                                                \
  } while (false)

#define PD_CHECK_MSG(cond, msg)                                    \
  do {                                                             \
    if (!(cond)) [[unlikely]] {                                    \
      ::pd::detail::checkFailed(__FILE__, __LINE__, #cond, (msg)); \
    }                                                              \
  } while (false)
