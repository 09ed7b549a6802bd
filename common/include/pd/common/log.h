#pragma once
/// Logging: one line per event, "2026-11-29T11:03:32.123Z I [component] message", to stderr.
/// Thread-safe (one write per line). The level is process-wide, set once from config.

#include <fmt/format.h>

#include <string_view>

namespace pd::log {

enum class Level { Debug = 0, Info = 1, Warn = 2, Error = 3, Off = 4 };

void setLevel(Level level);
[[nodiscard]] Level level();
/// Parses "debug" | "info" | "warn" | "error" | "off".
[[nodiscard]] bool parseLevel(std::string_view text, Level* out);

void write(Level level, std::string_view component, std::string_view message);

template <class... Args>
void debug(std::string_view component, fmt::format_string<Args...> f, Args&&... args) {
  if (level() <= Level::Debug) write(Level::Debug, component, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void info(std::string_view component, fmt::format_string<Args...> f, Args&&... args) {
  if (level() <= Level::Info) write(Level::Info, component, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void warn(std::string_view component, fmt::format_string<Args...> f, Args&&... args) {
  if (level() <= Level::Warn) write(Level::Warn, component, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void error(std::string_view component, fmt::format_string<Args...> f, Args&&... args) {
  if (level() <= Level::Error) write(Level::Error, component, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace pd::log
