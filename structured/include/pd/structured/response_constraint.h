#pragma once
/// What an OpenAI request asks its output to be — `response_format` (json_object, json_schema)
/// and `tool_choice` (required, a named function) — as one value that travels from the router to
/// the workers (encode/decode as JSON) and compiles to a Grammar, with a cache of compiled grammars
/// keyed by that value (docs/structured-outputs.md).
///
/// Errors: the parse functions return InvalidArgument naming the request field
/// ('response_format.json_schema.schema', 'tool_choice', ...); compiling returns the Grammar's
/// InvalidArgument / Unsupported (a 400 naming the schema feature).
///
/// Thread rules: ResponseConstraint is a value. GrammarCache is thread-safe.

#include <boost/json/value.hpp>
#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pd/common/result.h"
#include "pd/structured/grammar.h"
#include "pd/structured/tool_call_parser.h"

namespace pd::structured {

struct ResponseConstraint {
  enum class Kind {
    None,        ///< free text
    JsonObject,  ///< response_format {"type": "json_object"}
    JsonSchema,  ///< response_format {"type": "json_schema", "json_schema": {"schema": ...}}
    ToolCalls,   ///< tool_choice "required" (every tool) or a named function (that one)
  };
  Kind kind = Kind::None;
  std::string schema_json;          ///< JsonSchema: the schema, compact JSON
  std::vector<ToolSpec> tools;      ///< ToolCalls: the tools a call may name
  bool parallel_tool_calls = true;  ///< ToolCalls: more than one call allowed

  [[nodiscard]] bool constrained() const { return kind != Kind::None; }
  friend bool operator==(const ResponseConstraint& a, const ResponseConstraint& b) {
    if (a.kind != b.kind || a.schema_json != b.schema_json || a.parallel_tool_calls != b.parallel_tool_calls ||
        a.tools.size() != b.tools.size()) {
      return false;
    }
    for (std::size_t i = 0; i < a.tools.size(); ++i) {
      if (a.tools[i].name != b.tools[i].name || a.tools[i].parameters_json != b.tools[i].parameters_json) return false;
    }
    return true;
  }
};

/// From the request's `response_format` (nullptr or JSON null: free text).
[[nodiscard]] Result<ResponseConstraint> responseFormatConstraint(const boost::json::value* response_format);

/// From `tools` (OpenAI function tools), `tool_choice` and `parallel_tool_calls`: "required" is
/// every tool, {"type": "function", "function": {"name": N}} is tool N; "auto", "none" or absent
/// constrain nothing (the tool-call parser still reads calls under "auto").
[[nodiscard]] Result<ResponseConstraint> toolChoiceConstraint(const boost::json::value* tools,
                                                              const boost::json::value* tool_choice,
                                                              bool parallel_tool_calls);

/// The worker-API form: a JSON object text. decode(encode(c)) == c; decode refuses anything else
/// with InvalidArgument.
[[nodiscard]] std::string encodeConstraint(const ResponseConstraint& constraint);
[[nodiscard]] Result<ResponseConstraint> decodeConstraint(std::string_view json);

/// Compiles a constraint (Kind::None is a programming error: PD_CHECK).
[[nodiscard]] Result<std::shared_ptr<const Grammar>> compileConstraint(
    const ResponseConstraint& constraint, ToolCallFormat format, std::shared_ptr<const TokenVocabulary> vocabulary,
    const GrammarOptions& options);

/// The last `capacity` compiled grammars by constraint, so repeated schemas (an agent's tools, a
/// pipeline's output schema) compile once and keep their pattern-state masks warm. Errors are not
/// cached. Thread-safe; get() compiles outside the lock.
class GrammarCache {
 public:
  GrammarCache(std::shared_ptr<const TokenVocabulary> vocabulary, ToolCallFormat format, GrammarOptions options,
               std::size_t capacity);

  [[nodiscard]] Result<std::shared_ptr<const Grammar>> get(const ResponseConstraint& constraint);
  [[nodiscard]] std::size_t size() const;

 private:
  using Entry = std::pair<std::string, std::shared_ptr<const Grammar>>;
  const std::shared_ptr<const TokenVocabulary> vocabulary_;
  const ToolCallFormat format_;
  const GrammarOptions options_;
  const std::size_t capacity_;
  mutable std::mutex mutex_;
  std::list<Entry> lru_;  // most recent first
  std::unordered_map<std::string, std::list<Entry>::iterator> index_;
};

}  // namespace pd::structured
