#pragma once
/// Grammar-constrained decoding: a JSON Schema (a documented subset) compiled to a byte-level
/// pushdown automaton, and a per-sequence Matcher that turns the automaton's state into a token
/// mask by walking the vocabulary's byte trie (docs/structured-outputs.md).
///
/// Output shape (what every accepted sequence looks like):
///  - JSON values exactly as the schema allows; object properties appear in the schema's
///    `properties` order (optional ones may be left out); properties the schema does not list are
///    never generated;
///  - whitespace only where JSON allows it (around `{ } [ ] , :` and around the whole value), at
///    most GrammarOptions::max_whitespace bytes of space, tab or newline in each place, so a
///    random-weight model always finishes a value;
///  - numbers have at most 15 integer digits, 15 fraction digits and 2 exponent digits; `\u`
///    escapes never name a surrogate; strings are valid UTF-8;
///  - after the value (and its trailing whitespace) only a stop token is allowed; a stop token is
///    allowed only once the value is complete.
///
/// Errors: compiling fails with InvalidArgument for a schema that is not JSON or not a valid
/// schema, and Unsupported naming the keyword or feature this subset lacks (never a silently
/// ignored constraint); the router turns both into a 400.
///
/// Thread rules: a Grammar is immutable after compile and shared (shared_ptr<const>) by every
/// Matcher of every sequence using the same schema, on any threads. A Matcher belongs to one
/// sequence and is used by one thread at a time (the engine thread that samples it).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/generation.h"
#include "pd/common/result.h"
#include "pd/structured/token_vocabulary.h"
#include "pd/structured/tool_call_parser.h"

namespace pd::structured {

struct GrammarOptions {
  /// Largest whitespace run allowed in one place between JSON tokens (0 = compact JSON only).
  std::uint32_t max_whitespace = 2;
  /// Largest number of characters of a string whose schema sets no maxLength (map keys and the
  /// strings of generic JSON included); 0 = no limit. Without a limit such a string ends only when
  /// the model closes it, which a random-weight model almost never does (docs/structured-outputs.md).
  std::uint32_t unbounded_string_chars = 0;
};

/// One function a tool-call grammar may call: its name and its parameters' JSON Schema.
struct ToolSpec {
  std::string name;
  std::string parameters_json;  ///< "" = any JSON object
};

class Grammar {
 public:
  /// Compiles a JSON Schema (the subset of docs/structured-outputs.md): type (one or a list),
  /// properties, required, additionalProperties (false/true/absent: unlisted properties are never
  /// generated), items, minItems, maxItems, minLength, maxLength, pattern, enum, const, anyOf,
  /// $ref to #/$defs/... or #/definitions/... (not recursive); annotations (title, description,
  /// default, examples, $schema, $id, $comment) are ignored. A schema with no constraints (`{}`
  /// or `true`) is any JSON value; `{"type": "object"}` without properties is any JSON object.
  [[nodiscard]] static Result<std::shared_ptr<const Grammar>> fromJsonSchema(
      std::string_view schema_json, std::shared_ptr<const TokenVocabulary> vocabulary, GrammarOptions options = {});

  /// A tool-call section in the model's own format (tool_call_parser.h), for `tool_choice`
  /// "required" (all tools) or a named function (just that one): `<｜tool▁calls▁begin｜>`, one call
  /// (or, with `parallel`, one to eight calls), `<｜tool▁calls▁end｜>`, then a stop token. Each call
  /// names one of `tools` and carries arguments valid for its parameters schema (the subset above;
  /// empty `parameters_json` = any object). The markers are the vocabulary's added tokens:
  /// Unsupported when it lacks one. Errors name the tool (`tools[i].parameters`).
  [[nodiscard]] static Result<std::shared_ptr<const Grammar>> forToolCalls(
      std::span<const ToolSpec> tools, ToolCallFormat format, bool parallel,
      std::shared_ptr<const TokenVocabulary> vocabulary, GrammarOptions options = {});

  /// Any JSON object (OpenAI `response_format: {"type": "json_object"}`).
  [[nodiscard]] static Result<std::shared_ptr<const Grammar>> anyJsonObject(
      std::shared_ptr<const TokenVocabulary> vocabulary, GrammarOptions options = {});

  Grammar(const Grammar&) = delete;
  Grammar& operator=(const Grammar&) = delete;
  ~Grammar();

  [[nodiscard]] const TokenVocabulary& vocabulary() const;

  class Impl;
  [[nodiscard]] const Impl& impl() const { return *impl_; }

 private:
  explicit Grammar(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// The automaton's position in one sequence's output, with the history that rollback() needs.
class Matcher {
 public:
  /// Starts before the first output token. The Matcher shares ownership of the grammar.
  explicit Matcher(std::shared_ptr<const Grammar> grammar);
  Matcher(Matcher&&) noexcept;
  Matcher& operator=(Matcher&&) noexcept;
  Matcher(const Matcher&) = delete;
  Matcher& operator=(const Matcher&) = delete;
  ~Matcher();

  /// Writes the allowed next tokens into `mask` (bit t of word t / 64 set = token t allowed;
  /// every other bit cleared). PD_CHECKs that mask.size() == vocabulary().maskWords(). On any
  /// prefix the grammar accepts, at least one token is allowed. After a stop token was accepted,
  /// only the stop tokens are set. Costs a trie walk pruned by the automaton (microseconds;
  /// docs/benchmarks.md), never a scan of the vocabulary.
  void fillMask(std::span<MaskWord> mask);

  /// Advances by one token. InvalidArgument (state unchanged) when the token is not allowed here:
  /// the caller sampled outside the mask, or a draft token is being checked.
  [[nodiscard]] Status accept(TokenId token);

  /// Undoes the last `n` accepted tokens (MTP drafts the verifier rejected). PD_CHECKs
  /// n <= acceptedCount(). A mask after accept + rollback equals the mask before the accepts.
  /// The Matcher keeps one snapshot of its state per accepted token (tens of bytes each) for this.
  ///
  /// With MTP: accept the drafts one by one (a draft the grammar refuses ends the draft run),
  /// calling fillMask before each to get the mask the verifier samples that position with; then
  /// rollback the drafts the verifier rejected.
  void rollback(std::size_t n);

  /// True when the output so far is a complete value (a stop token is allowed now).
  [[nodiscard]] bool isComplete() const;
  /// True once a stop token was accepted.
  [[nodiscard]] bool isTerminated() const;
  /// Tokens accepted and not rolled back.
  [[nodiscard]] std::size_t acceptedCount() const;

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace pd::structured
