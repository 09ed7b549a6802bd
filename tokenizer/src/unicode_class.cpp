#include "unicode_class.h"

#include <array>
#include <string>
#include <unordered_map>
#include <vector>

namespace pd::tokenizer::detail {
namespace {

struct ClassRange {
  char32_t first;
  char32_t last;
  std::uint8_t classes;
};

constexpr ClassRange kRanges[] = {
#include "unicode_tables.inc"
};

constexpr char32_t kCodePoints = 0x110000;
constexpr unsigned kBlockBits = 7;
constexpr unsigned kBlockSize = 1u << kBlockBits;

// Two-stage lookup built once from the ranges: block index per 128 code points, then bytes.
struct ClassTable {
  std::array<std::uint16_t, kCodePoints / kBlockSize> index{};
  std::vector<std::uint8_t> blocks;

  ClassTable() {
    std::vector<std::uint8_t> flat(kCodePoints, 0);
    for (const auto& r : kRanges) {
      for (char32_t cp = r.first; cp <= r.last; ++cp) flat[cp] = r.classes;
    }
    std::unordered_map<std::string, std::uint16_t> seen;
    for (std::size_t b = 0; b < index.size(); ++b) {
      std::string block(reinterpret_cast<const char*>(flat.data() + b * kBlockSize), kBlockSize);
      const auto [it, inserted] = seen.try_emplace(std::move(block), static_cast<std::uint16_t>(seen.size()));
      if (inserted)
        blocks.insert(blocks.end(), flat.begin() + static_cast<std::ptrdiff_t>(b * kBlockSize),
                      flat.begin() + static_cast<std::ptrdiff_t>((b + 1) * kBlockSize));
      index[b] = it->second;
    }
  }
};

const ClassTable& classTable() {
  static const ClassTable table;
  return table;
}

}  // namespace

std::uint8_t charClasses(char32_t cp) {
  if (cp >= kCodePoints) return 0;
  const auto& t = classTable();
  return t.blocks[(static_cast<std::size_t>(t.index[cp >> kBlockBits]) << kBlockBits) | (cp & (kBlockSize - 1))];
}

void appendUtf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

Utf8Step utf8Step(std::string_view bytes, std::size_t pos) {
  const auto at = [&](std::size_t i) { return static_cast<unsigned char>(bytes[i]); };
  const unsigned char b0 = at(pos);
  if (b0 < 0x80) return {1, true, false};
  std::size_t need = 0;
  unsigned char lo = 0x80;
  unsigned char hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {1, false, false};  // continuation byte, C0, C1 or F5..FF: never starts a sequence
  }
  std::size_t len = 1;
  for (std::size_t k = 0; k < need; ++k) {
    if (pos + len >= bytes.size()) return {len, false, true};
    const unsigned char b = at(pos + len);
    const unsigned char min = k == 0 ? lo : 0x80;
    const unsigned char max = k == 0 ? hi : 0xBF;
    if (b < min || b > max) return {len, false, false};
    ++len;
  }
  return {len, true, false};
}

std::size_t findInvalidUtf8(std::string_view bytes) {
  std::size_t pos = 0;
  while (pos < bytes.size()) {
    if (static_cast<unsigned char>(bytes[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const Utf8Step step = utf8Step(bytes, pos);
    if (!step.valid) return pos;
    pos += step.length;
  }
  return std::string_view::npos;
}

void appendLossyUtf8(std::string& out, std::string_view bytes) {
  std::size_t pos = 0;
  std::size_t run = 0;  // start of the current valid stretch
  while (pos < bytes.size()) {
    if (static_cast<unsigned char>(bytes[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const Utf8Step step = utf8Step(bytes, pos);
    if (step.valid) {
      pos += step.length;
      continue;
    }
    out.append(bytes.substr(run, pos - run));
    out.append("\xEF\xBF\xBD");
    pos += step.length;
    run = pos;
  }
  out.append(bytes.substr(run));
}

}  // namespace pd::tokenizer::detail
