#pragma once
/// Text safety at a JSON boundary: checking what clients send (UTF-8 validity, lone UTF-16
/// surrogate escapes) and writing text as JSON that every client can parse, whatever bytes it
/// holds (the detokenizer's output, file names, error messages). The project's one JSON string
/// escaper is appendJsonString / jsonString.
///
/// Invalid UTF-8 is replaced with U+FFFD, one per maximal ill-formed subpart (the Unicode /
/// WHATWG "replacement of maximal subparts" practice, which is also what the tokenizer's lossy
/// decode does). The streaming sanitizer holds back an incomplete sequence at the end of a piece
/// until the next piece completes it, so streaming and non-streaming give the same text.
///
/// Thread rules: free functions are pure; one Utf8StreamSanitizer per stream, one thread at a time.

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace pd {

/// True if `text` is well-formed UTF-8 (no overlongs, surrogates or code points past U+10FFFF).
[[nodiscard]] bool isValidUtf8(std::string_view text);

/// Byte offset of the first invalid UTF-8 sequence, or nullopt if the text is valid.
[[nodiscard]] std::optional<std::size_t> firstInvalidUtf8(std::string_view text);

/// True if the JSON text contains a `\uD800`-`\uDFFF` escape that is not part of a proper
/// high-low pair. Only meaningful for text that is otherwise valid JSON (a backslash occurs only
/// inside strings there).
[[nodiscard]] bool hasLoneSurrogateEscape(std::string_view json);

/// Appends `text` with invalid UTF-8 replaced by U+FFFD.
void appendSanitizedUtf8(std::string& out, std::string_view text);
[[nodiscard]] std::string sanitizeUtf8(std::string_view text);

/// Appends `text` as a JSON string literal (with quotes): `"` `\` and control characters escaped,
/// invalid UTF-8 replaced by U+FFFD. The result is always valid JSON and valid UTF-8.
void appendJsonString(std::string& out, std::string_view text);
/// `text` as a JSON string literal (with quotes); see appendJsonString.
[[nodiscard]] std::string jsonString(std::string_view text);

/// Sanitizes a stream of text pieces; see the file comment.
class Utf8StreamSanitizer {
 public:
  /// The sanitized text that `piece` completes (possibly empty while a sequence is incomplete).
  [[nodiscard]] std::string push(std::string_view piece);
  /// Flushes a held-back incomplete sequence as U+FFFD (empty if none). Call once at the end.
  [[nodiscard]] std::string finish();

 private:
  std::string carry_;
};

}  // namespace pd
