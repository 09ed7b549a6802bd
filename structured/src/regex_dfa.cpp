#include "regex_dfa.h"

#include <algorithm>
#include <deque>
#include <map>
#include <string>
#include <utility>

namespace pd::structured::detail {
namespace {

constexpr std::uint32_t kMaxCodePoint = 0x10FFFF;
constexpr std::uint32_t kMaxRepeat = 1000;     // largest {m,n} bound
constexpr std::size_t kMaxNfaStates = 100000;  // after expanding {m,n}
constexpr std::size_t kMaxDfaStates = 10000;
constexpr std::size_t kMaxSubsetElements = 4'000'000;  // NFA states summed over all DFA states

struct Range {
  std::uint32_t lo;
  std::uint32_t hi;
};

// The pattern's syntax tree. An empty Concat matches the empty string.
struct Re {
  enum class Kind { Set, Concat, Alt, Repeat } kind = Kind::Concat;
  std::vector<Range> ranges;  // Set: sorted, disjoint, no surrogates
  std::vector<Re> kids;
  std::uint32_t min = 0;
  std::uint32_t max = 0;  // Repeat: UINT32_MAX = unbounded
};

// Sorts, merges and removes surrogates (which no JSON string character can be).
std::vector<Range> normalize(const std::vector<Range>& in) {
  std::vector<Range> split;
  for (const auto& r : in) {
    if (r.lo > r.hi) continue;
    if (r.hi < 0xD800 || r.lo > 0xDFFF) {
      split.push_back(r);
      continue;
    }
    if (r.lo < 0xD800) split.push_back({r.lo, 0xD7FF});
    if (r.hi > 0xDFFF) split.push_back({0xE000, r.hi});
  }
  std::sort(split.begin(), split.end(), [](const Range& a, const Range& b) { return a.lo < b.lo; });
  std::vector<Range> out;
  for (const auto& r : split) {
    if (!out.empty() && r.lo <= out.back().hi + 1) {
      out.back().hi = std::max(out.back().hi, r.hi);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

std::vector<Range> complement(const std::vector<Range>& in) {
  std::vector<Range> sorted = normalize(in);
  std::vector<Range> out;
  std::uint32_t next = 0;
  for (const auto& r : sorted) {
    if (r.lo > next) out.push_back({next, r.lo - 1});
    next = r.hi + 1;
  }
  if (next <= kMaxCodePoint) out.push_back({next, kMaxCodePoint});
  return normalize(out);
}

Re setOf(const std::vector<Range>& ranges) {
  Re re;
  re.kind = Re::Kind::Set;
  re.ranges = normalize(ranges);
  return re;
}
Re anyChar() {
  return setOf({{0, kMaxCodePoint}});
}

Error unsupported(const std::string& what) {
  return makeError(ErrorCode::Unsupported, "pattern: " + what + " is not supported (docs/structured-outputs.md)");
}
Error invalid(const std::string& what) {
  return makeError(ErrorCode::InvalidArgument, "pattern: " + what);
}

std::vector<std::uint32_t> decodeUtf8(std::string_view s) {
  std::vector<std::uint32_t> out;
  for (std::size_t i = 0; i < s.size();) {
    const auto b = static_cast<std::uint8_t>(s[i]);
    std::uint32_t cp = b;
    std::size_t len = 1;
    if (b >= 0xF0) {
      cp = b & 0x07U;
      len = 4;
    } else if (b >= 0xE0) {
      cp = b & 0x0FU;
      len = 3;
    } else if (b >= 0xC0) {
      cp = b & 0x1FU;
      len = 2;
    }
    for (std::size_t k = 1; k < len && i + k < s.size(); ++k)
      cp = (cp << 6U) | (static_cast<std::uint8_t>(s[i + k]) & 0x3FU);
    out.push_back(cp);
    i += len;
  }
  return out;
}

class Parser {
 public:
  explicit Parser(std::vector<std::uint32_t> cps) : cps_(std::move(cps)) {}

  Result<Re> parsePattern() {
    PD_ASSIGN_OR_RETURN(Re re, parseAlt(true));
    if (pos_ != cps_.size()) return invalid("unbalanced ')'");
    return re;
  }

 private:
  [[nodiscard]] bool atEnd() const { return pos_ >= cps_.size(); }
  [[nodiscard]] std::uint32_t peek(std::size_t ahead = 0) const {
    return pos_ + ahead < cps_.size() ? cps_[pos_ + ahead] : UINT32_MAX;
  }

  Result<Re> parseAlt(bool top) {
    Re alt;
    alt.kind = Re::Kind::Alt;
    for (;;) {
      PD_ASSIGN_OR_RETURN(Re branch, parseConcat(top));
      alt.kids.push_back(std::move(branch));
      if (peek() != '|') break;
      ++pos_;
    }
    if (alt.kids.size() == 1) return std::move(alt.kids[0]);
    return alt;
  }

  // A top-level branch may start with ^ and end with $; without them it is searched for anywhere
  // (JSON Schema patterns are not anchored), which is a leading and a trailing "any*".
  Result<Re> parseConcat(bool top) {
    Re seq;
    bool anchored_start = false;
    bool anchored_end = false;
    if (top && peek() == '^') {
      anchored_start = true;
      ++pos_;
    }
    while (!atEnd() && peek() != '|' && peek() != ')') {
      if (peek() == '$') {
        if (top && (pos_ + 1 == cps_.size() || peek(1) == '|')) {
          anchored_end = true;
          ++pos_;
          break;
        }
        return unsupported("the anchor '$' inside the pattern");
      }
      PD_ASSIGN_OR_RETURN(Re item, parseRepeat());
      seq.kids.push_back(std::move(item));
    }
    if (!top) return seq;
    Re star;
    star.kind = Re::Kind::Repeat;
    star.min = 0;
    star.max = UINT32_MAX;
    star.kids.push_back(anyChar());
    if (!anchored_start) seq.kids.insert(seq.kids.begin(), star);
    if (!anchored_end) seq.kids.push_back(star);
    return seq;
  }

  // {m}, {m,} or {m,n} at pos_ (which is at '{'); false when the text is not a quantifier.
  bool parseBraces(std::uint32_t* min, std::uint32_t* max) {
    std::size_t p = pos_ + 1;
    auto number = [&](std::uint32_t* out) {
      const std::size_t start = p;
      std::uint64_t v = 0;
      while (p < cps_.size() && cps_[p] >= '0' && cps_[p] <= '9') {
        v = std::min<std::uint64_t>(v * 10 + (cps_[p] - '0'), UINT32_MAX - 1);
        ++p;
      }
      *out = static_cast<std::uint32_t>(v);
      return p > start;
    };
    if (!number(min)) return false;
    *max = *min;
    if (p < cps_.size() && cps_[p] == ',') {
      ++p;
      if (!number(max)) *max = UINT32_MAX;
    }
    if (p >= cps_.size() || cps_[p] != '}') return false;
    pos_ = p + 1;
    return true;
  }

  Result<Re> parseRepeat() {
    PD_ASSIGN_OR_RETURN(Re atom, parseAtom());
    for (;;) {
      std::uint32_t min = 0;
      std::uint32_t max = 0;
      const std::uint32_t c = peek();
      if (c == '*') {
        max = UINT32_MAX;
        ++pos_;
      } else if (c == '+') {
        min = 1;
        max = UINT32_MAX;
        ++pos_;
      } else if (c == '?') {
        max = 1;
        ++pos_;
      } else if (c == '{' && parseBraces(&min, &max)) {
        if (min > max) return invalid("{m,n} with m > n");
        if (min > kMaxRepeat || (max != UINT32_MAX && max > kMaxRepeat)) {
          return unsupported("a repetition count above " + std::to_string(kMaxRepeat));
        }
      } else {
        return atom;
      }
      if (peek() == '?') ++pos_;  // lazy: the same strings match
      Re rep;
      rep.kind = Re::Kind::Repeat;
      rep.min = min;
      rep.max = max;
      rep.kids.push_back(std::move(atom));
      atom = std::move(rep);
    }
  }

  // \d \w \s and single-character escapes; `in_class` allows \b (backspace).
  Result<std::vector<Range>> parseEscape(bool in_class) {
    ++pos_;  // the backslash
    if (atEnd()) return invalid("trailing backslash");
    const std::uint32_t c = cps_[pos_++];
    switch (c) {
      case 'd':
        return std::vector<Range>{{'0', '9'}};
      case 'w':
        return std::vector<Range>{{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
      case 's':
        return std::vector<Range>{{'\t', '\r'}, {' ', ' '}};
      case 'D':
      case 'W':
      case 'S':
        // Their complements differ between ECMA-262 and Unicode-aware engines; refuse rather than guess.
        return unsupported(std::string("the class escape \\") + static_cast<char>(c));
      case 'n':
        return std::vector<Range>{{'\n', '\n'}};
      case 't':
        return std::vector<Range>{{'\t', '\t'}};
      case 'r':
        return std::vector<Range>{{'\r', '\r'}};
      case 'f':
        return std::vector<Range>{{'\f', '\f'}};
      case 'v':
        return std::vector<Range>{{'\v', '\v'}};
      case '0':
        return std::vector<Range>{{0, 0}};
      case 'b':
        if (in_class) return std::vector<Range>{{8, 8}};
        return unsupported("the word boundary \\b");
      case 'B':
        return unsupported("the word boundary \\B");
      case 'x':
      case 'u': {
        const std::size_t digits = c == 'x' ? 2 : 4;
        std::uint32_t v = 0;
        for (std::size_t k = 0; k < digits; ++k) {
          const std::uint32_t h = peek();
          int d = -1;
          if (h >= '0' && h <= '9') d = static_cast<int>(h - '0');
          if (h >= 'a' && h <= 'f') d = static_cast<int>(h - 'a' + 10);
          if (h >= 'A' && h <= 'F') d = static_cast<int>(h - 'A' + 10);
          if (d < 0) return invalid(std::string("bad \\") + static_cast<char>(c) + " escape");
          v = v * 16 + static_cast<std::uint32_t>(d);
          ++pos_;
        }
        return std::vector<Range>{{v, v}};
      }
      default:
        if (c >= '1' && c <= '9') return unsupported("the backreference \\" + std::string(1, static_cast<char>(c)));
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
          return unsupported(std::string("the escape \\") + static_cast<char>(c));
        }
        return std::vector<Range>{{c, c}};  // an escaped punctuation character stands for itself
    }
  }

  Result<Re> parseClass() {
    ++pos_;  // '['
    bool negate = false;
    if (peek() == '^') {
      negate = true;
      ++pos_;
    }
    std::vector<Range> ranges;
    bool first = true;
    while (!atEnd() && (peek() != ']' || first)) {
      if (peek() == ']') return invalid("empty character class");
      first = false;
      std::vector<Range> item;
      if (peek() == '\\') {
        PD_ASSIGN_OR_RETURN(item, parseEscape(true));
      } else {
        if (peek() == '[' && peek(1) == ':') return unsupported("POSIX classes [:name:]");
        item.push_back({peek(), peek()});
        ++pos_;
      }
      // A range a-b: both ends single characters.
      if (peek() == '-' && peek(1) != ']' && peek(1) != UINT32_MAX && item.size() == 1 && item[0].lo == item[0].hi) {
        ++pos_;
        std::vector<Range> end;
        if (peek() == '\\') {
          PD_ASSIGN_OR_RETURN(end, parseEscape(true));
        } else {
          end.push_back({peek(), peek()});
          ++pos_;
        }
        if (end.size() != 1 || end[0].lo != end[0].hi) return invalid("a class range ending in a class");
        if (end[0].lo < item[0].lo) return invalid("a class range out of order");
        item[0].hi = end[0].lo;
      }
      ranges.insert(ranges.end(), item.begin(), item.end());
    }
    if (atEnd()) return invalid("unterminated character class");
    ++pos_;  // ']'
    return setOf(negate ? complement(ranges) : ranges);
  }

  Result<Re> parseAtom() {
    const std::uint32_t c = peek();
    switch (c) {
      case '(': {
        ++pos_;
        if (peek() == '?') {
          if (peek(1) != ':') return unsupported("the group construct (?" + std::string(1, static_cast<char>(peek(1))));
          pos_ += 2;
        }
        PD_ASSIGN_OR_RETURN(Re inner, parseAlt(false));
        if (peek() != ')') return invalid("unbalanced '('");
        ++pos_;
        return inner;
      }
      case '[':
        return parseClass();
      case '.':
        ++pos_;
        // Any character but the line terminators of ECMA-262 (Python's '.' excludes only \n).
        return setOf(complement({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}));
      case '\\': {
        PD_ASSIGN_OR_RETURN(auto ranges, parseEscape(false));
        return setOf(ranges);
      }
      case '^':
        return unsupported("the anchor '^' inside the pattern");
      case '*':
      case '+':
      case '?':
        return invalid("nothing to repeat");
      default:
        ++pos_;
        return setOf({{c, c}});
    }
  }

  std::vector<std::uint32_t> cps_;
  std::size_t pos_ = 0;
};

// Thompson NFA with epsilon moves.
struct Nfa {
  struct State {
    std::vector<std::pair<Range, std::uint32_t>> edges;
    std::vector<std::uint32_t> eps;
  };
  std::vector<State> states;
  std::uint32_t add() {
    states.emplace_back();
    return static_cast<std::uint32_t>(states.size() - 1);
  }
};
struct Frag {
  std::uint32_t start;
  std::uint32_t end;
};

Result<Frag> build(Nfa& nfa, const Re& re) {
  if (nfa.states.size() > kMaxNfaStates) return unsupported("a pattern this large");
  switch (re.kind) {
    case Re::Kind::Set: {
      const std::uint32_t s = nfa.add();
      const std::uint32_t e = nfa.add();
      for (const auto& r : re.ranges) nfa.states[s].edges.push_back({r, e});
      return Frag{s, e};
    }
    case Re::Kind::Concat: {
      const std::uint32_t s = nfa.add();
      std::uint32_t cur = s;
      for (const auto& kid : re.kids) {
        PD_ASSIGN_OR_RETURN(Frag f, build(nfa, kid));
        nfa.states[cur].eps.push_back(f.start);
        cur = f.end;
      }
      return Frag{s, cur};
    }
    case Re::Kind::Alt: {
      const std::uint32_t s = nfa.add();
      const std::uint32_t e = nfa.add();
      for (const auto& kid : re.kids) {
        PD_ASSIGN_OR_RETURN(Frag f, build(nfa, kid));
        nfa.states[s].eps.push_back(f.start);
        nfa.states[f.end].eps.push_back(e);
      }
      return Frag{s, e};
    }
    case Re::Kind::Repeat: {
      const std::uint32_t s = nfa.add();
      std::uint32_t cur = s;
      for (std::uint32_t i = 0; i < re.min; ++i) {
        PD_ASSIGN_OR_RETURN(Frag f, build(nfa, re.kids[0]));
        nfa.states[cur].eps.push_back(f.start);
        cur = f.end;
      }
      if (re.max == UINT32_MAX) {
        PD_ASSIGN_OR_RETURN(Frag f, build(nfa, re.kids[0]));
        nfa.states[cur].eps.push_back(f.start);
        nfa.states[f.end].eps.push_back(cur);
        return Frag{s, cur};
      }
      const std::uint32_t e = nfa.add();
      for (std::uint32_t i = re.min; i < re.max; ++i) {
        PD_ASSIGN_OR_RETURN(Frag f, build(nfa, re.kids[0]));
        nfa.states[cur].eps.push_back(e);
        nfa.states[cur].eps.push_back(f.start);
        cur = f.end;
      }
      nfa.states[cur].eps.push_back(e);
      return Frag{s, e};
    }
  }
  return invalid("unknown node");
}

std::vector<std::uint32_t> closure(const Nfa& nfa, std::vector<std::uint32_t> set) {
  std::vector<std::uint8_t> seen(nfa.states.size(), 0);
  std::vector<std::uint32_t> work = set;
  for (const auto s : set) seen[s] = 1;
  while (!work.empty()) {
    const std::uint32_t s = work.back();
    work.pop_back();
    for (const auto t : nfa.states[s].eps) {
      if (seen[t] == 0) {
        seen[t] = 1;
        set.push_back(t);
        work.push_back(t);
      }
    }
  }
  std::sort(set.begin(), set.end());
  return set;
}

}  // namespace

std::uint32_t RegexDfa::next(std::uint32_t q, std::uint32_t cp) const {
  const auto& es = edges[q];
  auto it = std::upper_bound(es.begin(), es.end(), cp, [](std::uint32_t v, const Edge& e) { return v < e.lo; });
  if (it == es.begin()) return kNone;
  --it;
  return cp <= it->hi ? it->target : kNone;
}

Result<RegexDfa> compileRegex(std::string_view pattern) {
  Parser parser(decodeUtf8(pattern));
  PD_ASSIGN_OR_RETURN(Re re, parser.parsePattern());
  Nfa nfa;
  PD_ASSIGN_OR_RETURN(Frag frag, build(nfa, re));
  if (nfa.states.size() > kMaxNfaStates) return unsupported("a pattern this large");

  RegexDfa dfa;
  std::map<std::vector<std::uint32_t>, std::uint32_t> ids;
  std::vector<std::vector<std::uint32_t>> sets;
  std::size_t subset_elements = 0;
  auto intern = [&](std::vector<std::uint32_t> set) -> std::uint32_t {
    auto [it, fresh] = ids.emplace(std::move(set), static_cast<std::uint32_t>(sets.size()));
    if (fresh) {
      subset_elements += it->first.size();
      sets.push_back(it->first);
    }
    return it->second;
  };
  dfa.start = intern(closure(nfa, {frag.start}));
  for (std::size_t q = 0; q < sets.size(); ++q) {
    if (sets.size() > kMaxDfaStates || subset_elements > kMaxSubsetElements) {
      return unsupported("a pattern whose automaton has this many states");
    }
    // NOLINTNEXTLINE(performance-unnecessary-copy-initialization): intern() may grow `sets`.
    const std::vector<std::uint32_t> set = sets[q];
    std::vector<std::uint32_t> points;
    for (const auto s : set) {
      for (const auto& [r, t] : nfa.states[s].edges) {
        points.push_back(r.lo);
        points.push_back(r.hi + 1);
      }
    }
    std::sort(points.begin(), points.end());
    points.erase(std::unique(points.begin(), points.end()), points.end());
    std::vector<RegexDfa::Edge> out;
    for (std::size_t i = 0; i + 1 < points.size(); ++i) {
      const std::uint32_t lo = points[i];
      const std::uint32_t hi = points[i + 1] - 1;
      std::vector<std::uint32_t> targets;
      for (const auto s : set) {
        for (const auto& [r, t] : nfa.states[s].edges) {
          if (r.lo <= lo && hi <= r.hi) targets.push_back(t);
        }
      }
      if (targets.empty()) continue;
      std::sort(targets.begin(), targets.end());
      targets.erase(std::unique(targets.begin(), targets.end()), targets.end());
      const std::uint32_t id = intern(closure(nfa, std::move(targets)));
      if (!out.empty() && out.back().target == id && out.back().hi + 1 == lo) {
        out.back().hi = hi;
      } else {
        out.push_back({lo, hi, id});
      }
    }
    if (dfa.edges.size() <= q) dfa.edges.resize(q + 1);
    dfa.edges[q] = std::move(out);
  }
  const std::size_t n = sets.size();
  dfa.edges.resize(n);
  dfa.accepting.assign(n, 0);
  dfa.dist.assign(n, RegexDfa::kNone);
  std::vector<std::vector<std::uint32_t>> reverse(n);
  for (std::size_t q = 0; q < n; ++q) {
    dfa.accepting[q] = std::binary_search(sets[q].begin(), sets[q].end(), frag.end) ? 1 : 0;
    for (const auto& e : dfa.edges[q]) reverse[e.target].push_back(static_cast<std::uint32_t>(q));
  }
  std::deque<std::uint32_t> queue;
  for (std::size_t q = 0; q < n; ++q) {
    if (dfa.accepting[q] != 0) {
      dfa.dist[q] = 0;
      queue.push_back(static_cast<std::uint32_t>(q));
    }
  }
  while (!queue.empty()) {
    const std::uint32_t q = queue.front();
    queue.pop_front();
    for (const auto p : reverse[q]) {
      if (dfa.dist[p] == RegexDfa::kNone) {
        dfa.dist[p] = dfa.dist[q] + 1;
        queue.push_back(p);
      }
    }
  }
  if (dfa.dist[dfa.start] == RegexDfa::kNone) return invalid("matches no string");
  return dfa;
}

}  // namespace pd::structured::detail
