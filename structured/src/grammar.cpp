#include "pd/structured/grammar.h"

#include <algorithm>
#include <boost/json.hpp>

#include "grammar_impl.h"
#include "schema_compiler.h"
#include "vocabulary_impl.h"

namespace pd::structured {

using detail::Automaton;
using detail::Frame;
using detail::Stack;
using detail::StateSet;
using detail::TokenTrie;

namespace {

Result<std::shared_ptr<const Grammar>> fail(Error e) {
  return e;
}

}  // namespace

std::shared_ptr<const PatternStateMask> Grammar::Impl::patternMask(std::int32_t pattern, std::uint32_t state) const {
  {
    const std::lock_guard<std::mutex> lock(cache_mutex_);
    if (const auto it = cache_.find({pattern, state}); it != cache_.end()) return it->second;
    if (cache_.size() >= kMaxCachedStates) return nullptr;
  }
  // Computed outside the lock: two threads may both compute it once; either result is the same.
  const auto& v = vocabulary->impl();
  const detail::RegexDfa& dfa = automaton.patterns[static_cast<std::size_t>(pattern)];
  auto m = std::make_shared<PatternStateMask>();
  m->all.assign(v.mask_words, 0);
  std::vector<std::pair<std::uint32_t, TokenId>> needs;
  for (std::size_t i = 0; i < v.plain_ids.size(); ++i) {
    std::uint32_t q = state;
    for (std::uint32_t k = v.plain_begin[i]; k < v.plain_begin[i + 1] && q != detail::RegexDfa::kNone; ++k) {
      q = dfa.next(q, v.plain_cps[k]);
    }
    if (q == detail::RegexDfa::kNone || dfa.dist[q] == detail::RegexDfa::kNone) continue;
    needs.emplace_back(v.plain_begin[i + 1] - v.plain_begin[i] + dfa.dist[q], v.plain_ids[i]);
    detail::setBit(m->all.data(), v.plain_ids[i]);
  }
  // A counting sort by need (needs are small: a token's characters plus a distance in the DFA).
  std::uint32_t max_need = 0;
  for (const auto& [need, id] : needs) max_need = std::max(max_need, need);
  m->need_end.assign(max_need + 1, 0);
  for (const auto& [need, id] : needs) ++m->need_end[need];
  for (std::uint32_t k = 1; k <= max_need; ++k) m->need_end[k] += m->need_end[k - 1];
  m->by_need.resize(needs.size());
  std::vector<std::uint32_t> next(m->need_end.size(), 0);
  for (std::uint32_t k = 1; k <= max_need; ++k) next[k] = m->need_end[k - 1];
  for (const auto& [need, id] : needs) m->by_need[next[need]++] = id;
  const std::lock_guard<std::mutex> lock(cache_mutex_);
  return cache_.emplace(std::make_pair(pattern, state), std::move(m)).first->second;
}

Grammar::Grammar(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Grammar::~Grammar() = default;

const TokenVocabulary& Grammar::vocabulary() const {
  return *impl_->vocabulary;
}

Result<std::shared_ptr<const Grammar>> Grammar::fromJsonSchema(std::string_view schema_json,
                                                               std::shared_ptr<const TokenVocabulary> vocabulary,
                                                               GrammarOptions options) {
  PD_CHECK(vocabulary != nullptr);
  boost::system::error_code ec;
  const boost::json::value schema = boost::json::parse(schema_json, ec);
  if (ec) return fail(makeError(ErrorCode::InvalidArgument, "response schema: not JSON: " + ec.message()));
  PD_ASSIGN_OR_RETURN(auto automaton, detail::compileJsonSchema(schema, options));
  auto impl = std::make_unique<Impl>();
  impl->vocabulary = std::move(vocabulary);
  impl->automaton = std::move(automaton);
  impl->options = options;
  return std::shared_ptr<const Grammar>(new Grammar(std::move(impl)));
}

Result<std::shared_ptr<const Grammar>> Grammar::forToolCalls(std::span<const ToolSpec> tools, ToolCallFormat format,
                                                             bool parallel,
                                                             std::shared_ptr<const TokenVocabulary> vocabulary,
                                                             GrammarOptions options) {
  PD_CHECK(vocabulary != nullptr);
  // In the order of detail::k*Marker.
  constexpr std::string_view kMarkers[] = {"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                           "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"};
  std::vector<TokenId> ids;
  for (const auto marker : kMarkers) {
    const auto id = vocabulary->addedToken(marker);
    if (!id) {
      return fail(
          makeError(ErrorCode::Unsupported, "tool calls: the tokenizer has no " + std::string(marker) + " token"));
    }
    ids.push_back(*id);
  }
  PD_ASSIGN_OR_RETURN(auto automaton, detail::compileToolCalls(tools, format, parallel, std::move(ids), options));
  auto impl = std::make_unique<Impl>();
  impl->vocabulary = std::move(vocabulary);
  impl->automaton = std::move(automaton);
  impl->options = options;
  return std::shared_ptr<const Grammar>(new Grammar(std::move(impl)));
}

Result<std::shared_ptr<const Grammar>> Grammar::anyJsonObject(std::shared_ptr<const TokenVocabulary> vocabulary,
                                                              GrammarOptions options) {
  PD_CHECK(vocabulary != nullptr);
  PD_ASSIGN_OR_RETURN(auto automaton, detail::compileAnyJsonObject(options));
  auto impl = std::make_unique<Impl>();
  impl->vocabulary = std::move(vocabulary);
  impl->automaton = std::move(automaton);
  impl->options = options;
  return std::shared_ptr<const Grammar>(new Grammar(std::move(impl)));
}

class Matcher::Impl {
 public:
  explicit Impl(std::shared_ptr<const Grammar> g)
      : grammar(std::move(g)),
        automaton(grammar->impl().automaton),
        vocab(grammar->vocabulary().impl()),
        levels(std::max(vocab.all.max_depth, vocab.unplain.max_depth) + 2) {
    current.push_back(automaton.initial());
  }

  // The states after feeding `bytes` to `from`; empty when some byte is not allowed.
  StateSet advance(const StateSet& from, std::string_view bytes) const {
    StateSet cur = from;
    StateSet next;
    for (const char c : bytes) {
      next.clear();
      for (const Stack& s : cur) automaton.feed(s, static_cast<std::uint8_t>(c), next);
      if (next.empty()) return next;
      std::swap(cur, next);
    }
    return cur;
  }

  [[nodiscard]] bool complete() const {
    return std::any_of(current.begin(), current.end(), [&](const Stack& s) { return automaton.complete(s); });
  }

  // Sets the bit of every token under trie node `node` whose bytes some state in levels[depth] takes.
  void walk(const TokenTrie& t, std::uint32_t node, std::size_t depth, MaskWord* mask) {
    for (std::uint32_t c = node + 1; c < t.end[node]; c = t.end[c]) {
      StateSet& next = levels[depth + 1];
      next.clear();
      for (const Stack& s : levels[depth]) automaton.feed(s, t.byte[c], next);
      if (next.empty()) continue;  // no token below c can be taken: skip the subtree
      if (t.token[c] >= 0) {
        detail::setBit(mask, t.token[c]);
        if (t.has_twins[c] != 0) {
          for (const auto& [n, id] : t.twins) {
            if (n == c) detail::setBit(mask, id);
          }
        }
      }
      if (t.end[c] > c + 1) walk(t, c, depth + 1, mask);
    }
  }

  void fillMask(std::span<MaskWord> mask) {
    PD_CHECK_MSG(mask.size() == vocab.mask_words, "mask size does not match the vocabulary");
    std::fill(mask.begin(), mask.end(), 0);
    if (!terminated) {
      general.clear();
      for (const Stack& s : current) {
        std::uint32_t room = 0;
        std::int32_t pattern = -1;
        std::uint32_t state = 0;
        if (automaton.patternStringState(s, &pattern, &state, &room)) {
          // Inside a pattern string: the state's plain tokens from its cached mask, the rest by a walk.
          const auto pm = grammar->impl().patternMask(pattern, state);
          if (pm == nullptr) {
            general.push_back(s);  // past the cache's bound: the plain walk
            continue;
          }
          if (room >= pm->need_end.size()) {
            for (std::size_t i = 0; i < mask.size(); ++i) mask[i] |= pm->all[i];
          } else {
            for (std::uint32_t i = 0; i < pm->need_end[room]; ++i) detail::setBit(mask.data(), pm->by_need[i]);
          }
          levels[0].clear();
          levels[0].push_back(s);
          walk(vocab.unplain, 0, 0, mask.data());
          continue;
        }
        if (!automaton.plainStringRoom(s, &room)) {
          general.push_back(s);
          continue;
        }
        // Inside a free string: plain tokens by their length, the rest by a walk of their own trie.
        const auto& plain = vocab.plain_upto[std::min(room, vocab.max_plain_chars)];
        for (std::size_t i = 0; i < mask.size(); ++i) mask[i] |= plain[i];
        levels[0].clear();
        levels[0].push_back(s);
        walk(vocab.unplain, 0, 0, mask.data());
      }
      if (!general.empty()) {
        levels[0] = general;
        walk(vocab.all, 0, 0, mask.data());
        // Marker tokens are symbols of their own, outside the byte trie.
        StateSet& next = levels[1];
        for (std::size_t k = 0; k < automaton.markers.size(); ++k) {
          next.clear();
          for (const Stack& s : general) automaton.feed(s, detail::kMarkerSymbol + static_cast<std::uint32_t>(k), next);
          if (!next.empty()) detail::setBit(mask.data(), automaton.markers[k]);
        }
      }
      if (!complete()) return;
    }
    for (const TokenId id : vocab.stops) detail::setBit(mask.data(), id);
  }

  struct Snapshot {
    std::vector<std::uint32_t> sizes;
    std::vector<Frame> frames;
    bool terminated = false;
  };

  void remember() {
    Snapshot snap;
    snap.terminated = terminated;
    for (const Stack& s : current) {
      snap.sizes.push_back(s.size);
      snap.frames.insert(snap.frames.end(), s.frames.begin(), s.frames.begin() + s.size);
    }
    history.push_back(std::move(snap));
  }

  void restore(const Snapshot& snap) {
    terminated = snap.terminated;
    current.clear();
    std::size_t at = 0;
    for (const std::uint32_t size : snap.sizes) {
      Stack s;
      s.size = size;
      std::copy(snap.frames.begin() + static_cast<std::ptrdiff_t>(at),
                snap.frames.begin() + static_cast<std::ptrdiff_t>(at + size), s.frames.begin());
      at += size;
      current.push_back(s);
    }
  }

  std::shared_ptr<const Grammar> grammar;
  const Automaton& automaton;
  const TokenVocabulary::Impl& vocab;
  StateSet current;
  bool terminated = false;
  std::vector<Snapshot> history;  // the state before each accepted token
  std::vector<StateSet> levels;   // walk scratch: the states after each trie depth
  StateSet general;               // fillMask scratch: the states outside free strings
};

Matcher::Matcher(std::shared_ptr<const Grammar> grammar) : impl_(std::make_unique<Impl>(std::move(grammar))) {}
Matcher::Matcher(Matcher&&) noexcept = default;
Matcher& Matcher::operator=(Matcher&&) noexcept = default;
Matcher::~Matcher() = default;

void Matcher::fillMask(std::span<MaskWord> mask) {
  impl_->fillMask(mask);
}

Status Matcher::accept(TokenId token) {
  Impl& m = *impl_;
  if (m.terminated) return makeError(ErrorCode::InvalidArgument, "grammar: token after the stop token");
  if (m.grammar->vocabulary().isStopToken(token)) {
    if (!m.complete()) {
      return makeError(ErrorCode::InvalidArgument,
                       "grammar: stop token " + std::to_string(token) + " before the value is complete");
    }
    m.remember();
    m.terminated = true;
    return okStatus();
  }
  StateSet next;
  const auto& markers = m.automaton.markers;
  if (const auto it = std::find(markers.begin(), markers.end(), token); it != markers.end()) {
    const auto symbol = detail::kMarkerSymbol + static_cast<std::uint32_t>(it - markers.begin());
    for (const Stack& s : m.current) m.automaton.feed(s, symbol, next);
  } else {
    const auto bytes = m.grammar->vocabulary().tokenBytes(token);
    if (!bytes)
      return makeError(ErrorCode::InvalidArgument, "grammar: token " + std::to_string(token) + " is not text");
    next = m.advance(m.current, *bytes);
  }
  if (next.empty()) {
    return makeError(ErrorCode::InvalidArgument, "grammar: token " + std::to_string(token) + " is not allowed here");
  }
  m.remember();
  m.current = std::move(next);
  return okStatus();
}

void Matcher::rollback(std::size_t n) {
  Impl& m = *impl_;
  PD_CHECK_MSG(n <= m.history.size(), "rollback past the first token");
  if (n == 0) return;
  m.restore(m.history[m.history.size() - n]);
  m.history.resize(m.history.size() - n);
}

bool Matcher::isComplete() const {
  return !impl_->terminated && impl_->complete();
}
bool Matcher::isTerminated() const {
  return impl_->terminated;
}
std::size_t Matcher::acceptedCount() const {
  return impl_->history.size();
}

}  // namespace pd::structured
