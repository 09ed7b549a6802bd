#include "pd/common/log.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <mutex>

#include "pd/common/json_text.h"
#include "pd/common/log_format.h"

namespace pd::log {
namespace {
std::atomic<Level> g_level{Level::Info};
std::atomic<Format> g_format{Format::Text};
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

std::string_view levelName(Level l) {
  switch (l) {
    case Level::Debug:
      return "debug";
    case Level::Info:
      return "info";
    case Level::Warn:
      return "warn";
    case Level::Error:
      return "error";
    case Level::Off:
      return "off";
  }
  return "?";
}

std::string timestamp(std::int64_t at_ms) {
  const std::time_t secs = static_cast<std::time_t>(at_ms / 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                     tm.tm_hour, tm.tm_min, tm.tm_sec, at_ms % 1000);
}

std::string numberText(double v) {
  if (!std::isfinite(v)) return "null";
  return fmt::format("{:.3f}", v);
}

void appendJsonValue(std::string& out, const Field& f) {
  if (const auto* s = std::get_if<std::string>(&f.value)) return appendJsonString(out, *s);
  if (const auto* i = std::get_if<std::int64_t>(&f.value)) {
    out += std::to_string(*i);
    return;
  }
  if (const auto* d = std::get_if<double>(&f.value)) {
    out += numberText(*d);
    return;
  }
  out += std::get<bool>(f.value) ? "true" : "false";
}

void appendTextValue(std::string& out, const Field& f) {
  if (const auto* s = std::get_if<std::string>(&f.value)) {
    const bool quote = s->empty() || std::any_of(s->begin(), s->end(), [](char c) {
                         return static_cast<unsigned char>(c) <= ' ' || c == '"' || c == '=' || c == '\\' || c == 0x7f;
                       });
    if (quote) return appendJsonString(out, *s);  // escaped: a value cannot break the line
    out += *s;
    return;
  }
  appendJsonValue(out, f);
}

}  // namespace

void setLevel(Level l) {
  g_level.store(l, std::memory_order_relaxed);
}
Level level() {
  return g_level.load(std::memory_order_relaxed);
}

bool parseLevel(std::string_view text, Level* out) {
  for (Level l : {Level::Debug, Level::Info, Level::Warn, Level::Error, Level::Off}) {
    if (text == levelName(l)) {
      *out = l;
      return true;
    }
  }
  return false;
}

void setFormat(Format f) {
  g_format.store(f, std::memory_order_relaxed);
}
Format format() {
  return g_format.load(std::memory_order_relaxed);
}

bool parseFormat(std::string_view text, Format* out) {
  if (text == "text") {
    *out = Format::Text;
    return true;
  }
  if (text == "json") {
    *out = Format::Json;
    return true;
  }
  return false;
}

std::string formatLine(std::int64_t at_ms, Level l, std::string_view component, std::string_view message,
                       const std::vector<Field>& fields) {
  std::string line;
  if (format() == Format::Json) {
    line = "{\"ts\":\"" + timestamp(at_ms) + "\",\"level\":\"" + std::string(levelName(l)) + "\",\"component\":";
    appendJsonString(line, component);
    line += ",\"msg\":";
    appendJsonString(line, message);
    for (const Field& f : fields) {
      line += ',';
      appendJsonString(line, f.key);
      line += ':';
      appendJsonValue(line, f);
    }
    line += '}';
    return line;
  }
  line = fmt::format("{} {} [{}] {}", timestamp(at_ms), levelLetter(l), component, message);
  for (const Field& f : fields) {
    line += ' ';
    line += f.key;
    line += '=';
    appendTextValue(line, f);
  }
  return line;
}

void write(Level l, std::string_view component, std::string_view message, const std::vector<Field>& fields) {
  const auto now = std::chrono::system_clock::now();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count();
  std::string line = formatLine(ms, l, component, message, fields);
  line += '\n';
  const std::lock_guard<std::mutex> lock(g_write_mutex);
  std::fwrite(line.data(), 1, line.size(), stderr);
}

void write(Level l, std::string_view component, std::string_view message) {
  write(l, component, message, {});
}

}  // namespace pd::log
