#pragma once
/// The log's line format and its structured lines (pd/common/log.h writes the plain ones).
///
/// Format::Text: "2026-11-29T11:03:32.123Z I [component] message key=value ...".
/// Format::Json (`--log.format json`): every line, plain or structured, is one JSON object:
/// {"ts":"2026-11-29T11:03:32.123Z","level":"info","component":"...","msg":"...", fields...}.
///
/// Thread rules: thread-safe; the format is process-wide, set once from config before threads start.

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "pd/common/log.h"

namespace pd::log {

enum class Format { Text, Json };

void setFormat(Format format);
[[nodiscard]] Format format();
/// Parses "text" | "json".
[[nodiscard]] bool parseFormat(std::string_view text, Format* out);

/// A named value of a structured line.
struct Field {
  std::string key;
  std::variant<std::string, std::int64_t, double, bool> value;
};

/// A structured line: `message` and `fields` as members of the JSON object, or in text as
/// "message key=value ..." (a string value is quoted and escaped when it holds a space, a quote,
/// '=' or a control character; doubles have 3 decimals). Keys are identifiers chosen by the
/// caller; values are escaped, and bytes that are not UTF-8 become U+FFFD in JSON.
void write(Level level, std::string_view component, std::string_view message, const std::vector<Field>& fields);

/// The line write() emits at `at_ms` (Unix milliseconds) in the current format, without the
/// newline (for tests).
[[nodiscard]] std::string formatLine(std::int64_t at_ms, Level level, std::string_view component,
                                     std::string_view message, const std::vector<Field>& fields = {});

}  // namespace pd::log
