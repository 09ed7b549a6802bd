#pragma once
// Character classes of the DeepSeek-V3 pre-tokenizer regexes, as of Unicode 16.0 (the
// reference's Oniguruma tables), and strict UTF-8 helpers. Thread-safe: immutable tables.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace pd::tokenizer::detail {

/// Bits of the classes a code point belongs to. Values match unicode_tables.inc.
constexpr std::uint8_t kLetter = 1;       ///< \p{L}
constexpr std::uint8_t kMark = 2;         ///< \p{M}
constexpr std::uint8_t kNumber = 4;       ///< \p{N}
constexpr std::uint8_t kPunctuation = 8;  ///< \p{P}
constexpr std::uint8_t kSymbol = 16;      ///< \p{S}
constexpr std::uint8_t kWhiteSpace = 32;  ///< Oniguruma's \s: the White_Space property (has U+0085, not U+FEFF)

/// The class bits of a code point (0 for unassigned, controls other than white space, ...).
[[nodiscard]] std::uint8_t charClasses(char32_t cp);

/// Decodes one well-formed UTF-8 sequence at text[pos] (the caller validated the text).
/// Returns the code point and advances pos.
[[nodiscard]] inline char32_t decodeUtf8(std::string_view text, std::size_t& pos) {
  const auto b0 = static_cast<unsigned char>(text[pos]);
  if (b0 < 0x80) {
    ++pos;
    return b0;
  }
  if (b0 < 0xE0) {
    const char32_t cp = ((b0 & 0x1Fu) << 6) | (static_cast<unsigned char>(text[pos + 1]) & 0x3Fu);
    pos += 2;
    return cp;
  }
  if (b0 < 0xF0) {
    const char32_t cp = ((b0 & 0x0Fu) << 12) | ((static_cast<unsigned char>(text[pos + 1]) & 0x3Fu) << 6) |
                        (static_cast<unsigned char>(text[pos + 2]) & 0x3Fu);
    pos += 3;
    return cp;
  }
  const char32_t cp = ((b0 & 0x07u) << 18) | ((static_cast<unsigned char>(text[pos + 1]) & 0x3Fu) << 12) |
                      ((static_cast<unsigned char>(text[pos + 2]) & 0x3Fu) << 6) |
                      (static_cast<unsigned char>(text[pos + 3]) & 0x3Fu);
  pos += 4;
  return cp;
}

/// Appends the UTF-8 encoding of a scalar value.
void appendUtf8(std::string& out, char32_t cp);

/// How a UTF-8 validator sees the bytes at `pos`: a well-formed sequence of `length` bytes, or
/// an ill-formed one whose maximal valid prefix has `length` bytes (>= 1), which the lossy decoder
/// replaces by one U+FFFD; `truncated` when that prefix runs to the end of the input (it could
/// still be completed by more bytes).
struct Utf8Step {
  std::size_t length = 0;
  bool valid = false;
  bool truncated = false;
};
[[nodiscard]] Utf8Step utf8Step(std::string_view bytes, std::size_t pos);

/// Offset of the first byte of the first ill-formed sequence, or npos if `bytes` is valid UTF-8.
[[nodiscard]] std::size_t findInvalidUtf8(std::string_view bytes);

/// Rust's String::from_utf8_lossy (the WHATWG decoder): each maximal ill-formed subsequence
/// becomes one U+FFFD. Appends to `out`.
void appendLossyUtf8(std::string& out, std::string_view bytes);

}  // namespace pd::tokenizer::detail
