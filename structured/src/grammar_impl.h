#pragma once
// Grammar's insides, shared with the Matcher. Private to pd_structured.

#include <memory>

#include "automaton.h"
#include "pd/structured/grammar.h"

namespace pd::structured {

class Grammar::Impl {
 public:
  std::shared_ptr<const TokenVocabulary> vocabulary;
  detail::Automaton automaton;
  GrammarOptions options;
};

}  // namespace pd::structured
