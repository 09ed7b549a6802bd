#include "pd/common/json_text.h"

#include <cstdint>

namespace pd {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

enum class Kind { Valid, Invalid, Incomplete };
struct Step {
  Kind kind;
  std::size_t length;  ///< Valid: the character; Invalid: the maximal subpart; Incomplete: bytes left
};

/// Classifies the UTF-8 sequence starting at `i` (well-formed sequences: Unicode table 3-7).
Step step(std::string_view s, std::size_t i) {
  const auto b = static_cast<std::uint8_t>(s[i]);
  if (b < 0x80) return {Kind::Valid, 1};
  std::size_t need = 0;
  std::uint8_t lo = 0x80;
  std::uint8_t hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b == 0xE0) {
    need = 2;
    lo = 0xA0;  // no overlongs
  } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
    need = 2;
  } else if (b == 0xED) {
    need = 2;
    hi = 0x9F;  // no surrogates
  } else if (b == 0xF0) {
    need = 3;
    lo = 0x90;
  } else if (b >= 0xF1 && b <= 0xF3) {
    need = 3;
  } else if (b == 0xF4) {
    need = 3;
    hi = 0x8F;  // nothing past U+10FFFF
  } else {
    return {Kind::Invalid, 1};
  }
  for (std::size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return {Kind::Incomplete, k};
    const auto c = static_cast<std::uint8_t>(s[i + k]);
    const std::uint8_t l = k == 1 ? lo : 0x80;
    const std::uint8_t h = k == 1 ? hi : 0xBF;
    if (c < l || c > h) return {Kind::Invalid, k};
  }
  return {Kind::Valid, need + 1};
}

int hexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/// The code unit of a `\uXXXX` escape at `i` (pointing at the backslash), or -1.
int escapedUnit(std::string_view s, std::size_t i) {
  if (i + 6 > s.size() || s[i] != '\\' || s[i + 1] != 'u') return -1;
  int v = 0;
  for (std::size_t k = 2; k < 6; ++k) {
    const int h = hexValue(s[i + k]);
    if (h < 0) return -1;
    v = v * 16 + h;
  }
  return v;
}

}  // namespace

std::optional<std::size_t> firstInvalidUtf8(std::string_view text) {
  std::size_t i = 0;
  while (i < text.size()) {
    const Step st = step(text, i);
    if (st.kind != Kind::Valid) return i;
    i += st.length;
  }
  return std::nullopt;
}

bool isValidUtf8(std::string_view text) {
  return !firstInvalidUtf8(text).has_value();
}

bool hasLoneSurrogateEscape(std::string_view json) {
  std::size_t i = 0;
  while (i < json.size()) {
    if (json[i] != '\\' || i + 1 >= json.size()) {
      ++i;
      continue;
    }
    const int unit = escapedUnit(json, i);
    if (unit < 0) {
      i += 2;  // another escape (\" \\ \n ...): skip both characters
      continue;
    }
    if (unit >= 0xDC00 && unit <= 0xDFFF) return true;  // a low half first
    if (unit >= 0xD800 && unit <= 0xDBFF) {
      const int next = escapedUnit(json, i + 6);
      if (next < 0xDC00 || next > 0xDFFF) return true;
      i += 12;
      continue;
    }
    i += 6;
  }
  return false;
}

void appendSanitizedUtf8(std::string& out, std::string_view text) {
  std::size_t i = 0;
  while (i < text.size()) {
    const Step st = step(text, i);
    if (st.kind == Kind::Valid) {
      out.append(text.substr(i, st.length));
    } else {
      out.append(kReplacement);
    }
    i += st.length;
  }
}

std::string sanitizeUtf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  appendSanitizedUtf8(out, text);
  return out;
}

void appendJsonString(std::string& out, std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += '"';
  std::size_t i = 0;
  while (i < text.size()) {
    const Step st = step(text, i);
    if (st.kind != Kind::Valid) {
      out.append(kReplacement);
      i += st.length;
      continue;
    }
    if (st.length > 1) {
      out.append(text.substr(i, st.length));
      i += st.length;
      continue;
    }
    const char c = text[i++];
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += "\\u00";
          out += kHex[(static_cast<unsigned char>(c) >> 4) & 0xF];
          out += kHex[static_cast<unsigned char>(c) & 0xF];
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

std::string jsonString(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  appendJsonString(out, text);
  return out;
}

std::string Utf8StreamSanitizer::push(std::string_view piece) {
  std::string data = std::move(carry_);
  carry_.clear();
  data.append(piece);
  std::string out;
  out.reserve(data.size());
  std::size_t i = 0;
  while (i < data.size()) {
    const Step st = step(data, i);
    if (st.kind == Kind::Incomplete) {
      carry_ = data.substr(i);
      break;
    }
    if (st.kind == Kind::Valid) {
      out.append(std::string_view(data).substr(i, st.length));
    } else {
      out.append(kReplacement);
    }
    i += st.length;
  }
  return out;
}

std::string Utf8StreamSanitizer::finish() {
  if (carry_.empty()) return {};
  carry_.clear();
  return std::string(kReplacement);
}

}  // namespace pd
