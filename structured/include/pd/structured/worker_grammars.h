#pragma once
/// What a worker needs to honour an output constraint from the internal API
/// (worker_api::DecodeOpen / PrefillSubmit `constraint` and `tool_call_format`): the generation
/// vocabulary of the worker's tokenizer and a GrammarCache per tool-call format, so the same
/// constraint compiles once per worker (docs/structured-outputs.md, "Serving").
///
/// Errors: load() passes on the tokenizer's and the vocabulary's errors. compile() answers
/// InvalidArgument for a constraint text or format that does not decode, and the Grammar's
/// InvalidArgument / Unsupported for one that does not compile: the worker refuses the request
/// with them (a 400 at the router, which compiled the same constraint before).
///
/// Thread rules: immutable after load() but for the caches, which are thread-safe; compile() may
/// be called from any thread.

#include <cstddef>
#include <filesystem>
#include <memory>
#include <optional>
#include <string_view>

#include "pd/common/result.h"
#include "pd/structured/grammar.h"
#include "pd/structured/response_constraint.h"
#include "pd/structured/token_vocabulary.h"

namespace pd::structured {

/// The grammar options every process of a deployment compiles with (the router validates with
/// the same ones): at most two whitespace bytes in one place, no cap on strings.
[[nodiscard]] GrammarOptions servingGrammarOptions();

/// "deepseek_v3" / "deepseek_v31" -> the format; empty -> DeepSeekV3; anything else nullopt.
[[nodiscard]] std::optional<ToolCallFormat> parseToolCallFormat(std::string_view name);

class WorkerGrammars {
 public:
  /// The vocabulary of the tokenizer in `tokenizer_dir` (tokenizer.json), masks sized for
  /// `model_vocab_size` ids. `cache_capacity` compiled grammars are kept per format.
  [[nodiscard]] static Result<std::shared_ptr<const WorkerGrammars>> load(const std::filesystem::path& tokenizer_dir,
                                                                          std::size_t model_vocab_size,
                                                                          std::size_t cache_capacity = 64);
  /// The same over a vocabulary already built (tests, benchmarks).
  WorkerGrammars(std::shared_ptr<const TokenVocabulary> vocabulary, std::size_t cache_capacity);

  /// The grammar of an encoded constraint (encodeConstraint's text) in `tool_call_format`.
  /// Null for an empty `constraint_json` or a Kind::None constraint (free text).
  [[nodiscard]] Result<std::shared_ptr<const Grammar>> compile(std::string_view constraint_json,
                                                               std::string_view tool_call_format) const;

  [[nodiscard]] const TokenVocabulary& vocabulary() const { return *vocabulary_; }

 private:
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  // mutable: the caches are thread-safe and only memoize compile()'s pure result.
  mutable GrammarCache v3_;
  mutable GrammarCache v31_;
};

/// A worker's grammar for one internal-API request: null when `constraint_json` is empty;
/// Unsupported when the worker has no vocabulary (`grammars` null); else compile()'s answer.
[[nodiscard]] Result<std::shared_ptr<const Grammar>> requestGrammar(const WorkerGrammars* grammars,
                                                                    std::string_view constraint_json,
                                                                    std::string_view tool_call_format);

}  // namespace pd::structured
