#pragma once
// JSON Schema (the subset of docs/structured-outputs.md) -> Automaton. Private to pd_structured.

#include <boost/json/value.hpp>

#include "automaton.h"
#include "pd/common/result.h"
#include "pd/structured/grammar.h"

namespace pd::structured::detail {

[[nodiscard]] Result<Automaton> compileJsonSchema(const boost::json::value& schema, const GrammarOptions& options);
[[nodiscard]] Result<Automaton> compileAnyJsonObject(const GrammarOptions& options);

}  // namespace pd::structured::detail
