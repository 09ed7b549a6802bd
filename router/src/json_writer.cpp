#include "json_writer.h"

#include <fmt/format.h>

#include <cmath>

#include "pd/common/check.h"
#include "pd/router/json_text.h"

namespace pd::router {

void JsonWriter::separate() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (!has_items_.empty()) {
    if (has_items_.back()) out_ += ',';
    has_items_.back() = true;
  }
}

JsonWriter& JsonWriter::beginObject() {
  separate();
  out_ += '{';
  has_items_.push_back(false);
  return *this;
}

JsonWriter& JsonWriter::endObject() {
  PD_CHECK(!has_items_.empty() && !after_key_);
  has_items_.pop_back();
  out_ += '}';
  return *this;
}

JsonWriter& JsonWriter::beginArray() {
  separate();
  out_ += '[';
  has_items_.push_back(false);
  return *this;
}

JsonWriter& JsonWriter::endArray() {
  PD_CHECK(!has_items_.empty() && !after_key_);
  has_items_.pop_back();
  out_ += ']';
  return *this;
}

JsonWriter& JsonWriter::key(std::string_view name) {
  PD_CHECK(!has_items_.empty() && !after_key_);
  separate();
  appendJsonString(out_, name);
  out_ += ':';
  after_key_ = true;
  return *this;
}

JsonWriter& JsonWriter::string(std::string_view text) {
  separate();
  appendJsonString(out_, text);
  return *this;
}

JsonWriter& JsonWriter::number(std::int64_t value) {
  separate();
  out_ += fmt::format("{}", value);
  return *this;
}

JsonWriter& JsonWriter::number(double value) {
  separate();
  // JSON has no Infinity/NaN; logprobs of impossible tokens are -inf. -9999 is vLLM's choice.
  if (std::isnan(value)) value = -9999.0;
  if (std::isinf(value)) value = value < 0 ? -9999.0 : 9999.0;
  out_ += fmt::format("{}", value);
  return *this;
}

JsonWriter& JsonWriter::boolean(bool value) {
  separate();
  out_ += value ? "true" : "false";
  return *this;
}

JsonWriter& JsonWriter::null() {
  separate();
  out_ += "null";
  return *this;
}

JsonWriter& JsonWriter::raw(std::string_view json) {
  separate();
  out_ += json;
  return *this;
}

std::string JsonWriter::take() {
  PD_CHECK(has_items_.empty() && !after_key_);
  return std::move(out_);
}

}  // namespace pd::router
