#pragma once
/// A small streaming JSON writer for responses: strings go through appendJsonString (invalid
/// UTF-8 becomes U+FFFD, so the output always parses), numbers use the shortest round-trip form,
/// and non-finite doubles (which JSON cannot express) are written as a large negative/positive
/// finite value. Commas are tracked; the caller nests begin/end calls correctly (PD_CHECK).
/// Thread rules: one writer per thread.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pd::router {

class JsonWriter {
 public:
  JsonWriter& beginObject();
  JsonWriter& endObject();
  JsonWriter& beginArray();
  JsonWriter& endArray();
  JsonWriter& key(std::string_view name);
  JsonWriter& string(std::string_view text);
  JsonWriter& number(std::int64_t value);
  JsonWriter& number(double value);
  JsonWriter& boolean(bool value);
  JsonWriter& null();
  /// A value that is already JSON (e.g. a cached fragment).
  JsonWriter& raw(std::string_view json);

  /// The document; the writer must be back at the top level.
  [[nodiscard]] std::string take();

 private:
  void separate();

  std::string out_;
  std::vector<bool> has_items_;  ///< per open container: a comma goes before the next item
  bool after_key_ = false;
};

}  // namespace pd::router
