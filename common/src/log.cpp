#include "pd/common/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace pd::log {
namespace {
std::atomic<Level> g_level{Level::Info};
std::mutex g_write_mutex;

char levelLetter(Level l) {
  switch (l) {
    case Level::Debug:
      return 'D';
    case Level::Info:
      return 'I';
    case Level::Warn:
      return 'W';
    case Level::Error:
      return 'E';
    case Level::Off:
      return '-';
  }
  return '?';
}
}  // namespace

void setLevel(Level l) {
  g_level.store(l, std::memory_order_relaxed);
}
Level level() {
  return g_level.load(std::memory_order_relaxed);
}

bool parseLevel(std::string_view text, Level* out) {
  if (text == "debug") {
    *out = Level::Debug;
    return true;
  }
  if (text == "info") {
    *out = Level::Info;
    return true;
  }
  if (text == "warn") {
    *out = Level::Warn;
    return true;
  }
  if (text == "error") {
    *out = Level::Error;
    return true;
  }
  if (text == "off") {
    *out = Level::Off;
    return true;
  }
  return false;
}

void write(Level l, std::string_view component, std::string_view message) {
  const auto now = std::chrono::system_clock::now();
  const std::time_t secs = std::chrono::system_clock::to_time_t(now);
  const auto millis = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&secs, &tm);
  const std::string line =
      fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z {} [{}] {}\n", tm.tm_year + 1900, tm.tm_mon + 1,
                  tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, millis, levelLetter(l), component, message);
  const std::lock_guard<std::mutex> lock(g_write_mutex);
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace pd::log
