#pragma once
/// The JSONL filters behind `pdserve tokenize | detokenize | chat-template`, for debugging
/// prompts with the same tokenizer and chat template the router uses:
///  - tokenize: {"text": "..."} -> {"ids": [...]} (optionally with the BOS id first);
///  - detokenize: {"ids": [...]} -> {"text": "..."} (one lossy UTF-8 decode, as Hugging Face);
///  - chat-template: {"messages": [...], "add_generation_prompt": bool, "tools": [...],
///    "chat_template_kwargs": {...}} -> {"rendered": "...", "ids": [...]}.
/// One output line per non-blank input line, in order. A line that cannot be processed (bad
/// JSON, a missing field, text that is not UTF-8, an id outside the vocabulary, a template error)
/// gets {"error": "..."} on the output, the same message on the error stream, and the run's exit
/// code becomes 2. Blank lines are skipped.
///
/// Thread rules: a TextFilter is immutable after create(); answer() may run on any thread.

#include <cstdio>
#include <filesystem>
#include <istream>
#include <memory>
#include <string>
#include <string_view>

#include "pd/common/result.h"

namespace pd::tools {

enum class TextFilterKind { Tokenize, Detokenize, ChatTemplate };

struct TextFilterConfig {
  TextFilterKind kind = TextFilterKind::Tokenize;
  /// Folder with tokenizer.json (+ tokenizer_config.json); empty: the fetched DeepSeek-V3 one.
  std::filesystem::path tokenizer_dir;
  bool add_bos = false;       ///< tokenize: prepend the BOS id
  bool skip_special = false;  ///< detokenize: drop special tokens
};

class TextFilter {
 public:
  /// Loads the tokenizer (and for chat-template its template); a missing tokenizer says how to
  /// fetch one.
  [[nodiscard]] static Result<TextFilter> create(const TextFilterConfig& cfg);
  ~TextFilter();
  TextFilter(TextFilter&&) noexcept;
  TextFilter& operator=(TextFilter&&) noexcept;
  TextFilter(const TextFilter&) = delete;
  TextFilter& operator=(const TextFilter&) = delete;

  /// The JSON answer to one input line (no newline); InvalidArgument with the message for the
  /// {"error"} line.
  [[nodiscard]] Result<std::string> answer(std::string_view line) const;

  /// Filters every line of `in` onto `out` (errors also on `err`, prefixed "pdserve COMMAND: line
  /// N: "); 0, or 2 when any line failed.
  [[nodiscard]] int run(std::istream& in, std::FILE* out, std::FILE* err) const;

 private:
  struct State;
  explicit TextFilter(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace pd::tools
