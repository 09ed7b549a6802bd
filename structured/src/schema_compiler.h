#pragma once
// JSON Schema (the subset of docs/structured-outputs.md) -> Automaton. Private to pd_structured.

#include <boost/json/value.hpp>
#include <span>
#include <vector>

#include "automaton.h"
#include "pd/common/result.h"
#include "pd/structured/grammar.h"
#include "pd/structured/tool_call_parser.h"

namespace pd::structured::detail {

[[nodiscard]] Result<Automaton> compileJsonSchema(const boost::json::value& schema, const GrammarOptions& options);
[[nodiscard]] Result<Automaton> compileAnyJsonObject(const GrammarOptions& options);

// The marker tokens of a tool-call section, in the order compileToolCalls() wants their ids.
inline constexpr std::uint32_t kCallsBeginMarker = 0;
inline constexpr std::uint32_t kCallsEndMarker = 1;
inline constexpr std::uint32_t kCallBeginMarker = 2;
inline constexpr std::uint32_t kCallEndMarker = 3;
inline constexpr std::uint32_t kToolSepMarker = 4;
inline constexpr std::uint32_t kMaxParallelToolCalls = 8;

/// A tool-call section in `format` holding one call, or 1..kMaxParallelToolCalls calls when
/// `parallel`, each naming one of `tools` with arguments valid for its parameters.
[[nodiscard]] Result<Automaton> compileToolCalls(std::span<const ToolSpec> tools, ToolCallFormat format, bool parallel,
                                                 std::vector<TokenId> markers, const GrammarOptions& options);

}  // namespace pd::structured::detail
