#include "automaton.h"

#include <algorithm>

#include "pd/common/check.h"

namespace pd::structured::detail {
namespace {

// String frame: s0 = phase | (utf8 bytes still due << 4) | (utf8 sequence length << 6) |
// (code point or \u value so far << 9); s1 = characters so far; s2 = pattern DFA state.
constexpr std::uint32_t kOpen = 0;
constexpr std::uint32_t kContent = 1;
constexpr std::uint32_t kEscape = 2;
constexpr std::uint32_t kHex0 = 3;  // kHex0 + k: k hex digits of a \u escape read
constexpr std::uint32_t kUtf8 = 7;
constexpr std::uint32_t kDone = 8;
constexpr std::uint32_t phaseOf(std::uint32_t s0) {
  return s0 & 0xFU;
}
constexpr std::uint32_t dueOf(std::uint32_t s0) {
  return (s0 >> 4U) & 3U;
}
constexpr std::uint32_t lengthOf(std::uint32_t s0) {
  return (s0 >> 6U) & 7U;
}
constexpr std::uint32_t valueOf(std::uint32_t s0) {
  return s0 >> 9U;
}
constexpr std::uint32_t packString(std::uint32_t phase, std::uint32_t due, std::uint32_t length, std::uint32_t value) {
  return phase | (due << 4U) | (length << 6U) | (value << 9U);
}

// Number frame: s0 = phase, s1 = digits in the current digit run.
constexpr std::uint32_t kNumStart = 0;
constexpr std::uint32_t kNumMinus = 1;
constexpr std::uint32_t kNumZero = 2;
constexpr std::uint32_t kNumInt = 3;
constexpr std::uint32_t kNumDot = 4;
constexpr std::uint32_t kNumFrac = 5;
constexpr std::uint32_t kNumExp = 6;
constexpr std::uint32_t kNumExpSign = 7;
constexpr std::uint32_t kNumExpDigits = 8;

// List and Object frames: s0 = phase; kListDone when closed.
constexpr std::uint32_t kListDone = 9;

bool isWhitespace(std::uint32_t b) {
  return b == ' ' || b == '\n' || b == '\t';
}
bool isDigit(std::uint32_t b) {
  return b >= '0' && b <= '9';
}
int hexValue(std::uint32_t b) {
  if (b >= '0' && b <= '9') return b - '0';
  if (b >= 'a' && b <= 'f') return b - 'a' + 10;
  if (b >= 'A' && b <= 'F') return b - 'A' + 10;
  return -1;
}
// The code point a one-letter escape stands for, or -1.
int simpleEscape(std::uint32_t b) {
  switch (b) {
    case '"':
      return '"';
    case '\\':
      return '\\';
    case '/':
      return '/';
    case 'b':
      return 0x08;
    case 'f':
      return 0x0C;
    case 'n':
      return 0x0A;
    case 'r':
      return 0x0D;
    case 't':
      return 0x09;
    default:
      return -1;
  }
}
constexpr std::uint8_t kSimpleEscapes[] = {'"', '\\', '/', 'b', 'f', 'n', 'r', 't'};

constexpr std::uint32_t utf8Min(std::uint32_t length) {
  return length == 2 ? 0x80U : length == 3 ? 0x800U : 0x10000U;
}
constexpr std::uint32_t utf8Max(std::uint32_t length) {
  return length == 2 ? 0x7FFU : length == 3 ? 0xFFFFU : 0x10FFFFU;
}

bool numberStep(std::uint32_t& phase, std::uint32_t& digits, std::uint32_t b, bool integer) {
  const bool digit = isDigit(b);
  const bool exp_mark = !integer && (b == 'e' || b == 'E');
  switch (phase) {
    case kNumStart:
    case kNumMinus:
      if (b == '-' && phase == kNumStart) {
        phase = kNumMinus;
        return true;
      }
      if (b == '0') {
        phase = kNumZero;
        return true;
      }
      if (digit) {
        phase = kNumInt;
        digits = 1;
        return true;
      }
      return false;
    case kNumZero:
    case kNumInt:
      if (phase == kNumInt && digit && digits < kMaxIntDigits) {
        ++digits;
        return true;
      }
      if (!integer && b == '.') {
        phase = kNumDot;
        return true;
      }
      if (exp_mark) {
        phase = kNumExp;
        return true;
      }
      return false;
    case kNumDot:
    case kNumFrac:
      if (digit && (phase == kNumDot || digits < kMaxFracDigits)) {
        digits = phase == kNumDot ? 1 : digits + 1;
        phase = kNumFrac;
        return true;
      }
      if (phase == kNumFrac && exp_mark) {
        phase = kNumExp;
        return true;
      }
      return false;
    case kNumExp:
      if (b == '+' || b == '-') {
        phase = kNumExpSign;
        return true;
      }
      [[fallthrough]];
    case kNumExpSign:
      if (digit) {
        phase = kNumExpDigits;
        digits = 1;
        return true;
      }
      return false;
    case kNumExpDigits:
      if (digit && digits < kMaxExpDigits) {
        ++digits;
        return true;
      }
      return false;
    default:
      return false;
  }
}

bool numberComplete(std::uint32_t phase) {
  return phase == kNumZero || phase == kNumInt || phase == kNumFrac || phase == kNumExpDigits;
}

}  // namespace

void addUnique(StateSet& set, const Stack& s) {
  for (const auto& x : set) {
    if (x == s) return;
  }
  set.push_back(s);
}

Stack Automaton::initial() const {
  Stack s;
  push(s, root);
  return s;
}

void Automaton::push(Stack& s, std::uint32_t node) const {
  PD_CHECK_MSG(s.size < kMaxFrames, "grammar stack overflow (the compiler's depth limit failed)");
  s.frames[s.size++] = Frame{node, 0, 0, 0};
}

// Whether a string frame may take one more character `cp`; *next_state gets the pattern state.
bool Automaton::charAllowed(const Node& n, const Frame& f, std::uint32_t cp, std::uint32_t* next_state) const {
  if (n.max != kUnbounded && f.s1 >= n.max) return false;
  if (n.pattern < 0) {
    *next_state = 0;
    return true;
  }
  const RegexDfa& dfa = patterns[static_cast<std::size_t>(n.pattern)];
  const std::uint32_t t = dfa.next(f.s2, cp);
  if (t == RegexDfa::kNone || dfa.dist[t] == RegexDfa::kNone) return false;
  if (n.max != kUnbounded && f.s1 + 1 + dfa.dist[t] > n.max) return false;
  *next_state = t;
  return true;
}

// Whether some character in [lo, hi] is allowed next (a multi-byte character not yet complete).
bool Automaton::rangeAllowed(const Node& n, const Frame& f, std::uint32_t lo, std::uint32_t hi) const {
  if (n.max != kUnbounded && f.s1 >= n.max) return false;
  if (n.pattern < 0) return true;
  const RegexDfa& dfa = patterns[static_cast<std::size_t>(n.pattern)];
  for (const auto& e : dfa.edges[f.s2]) {
    if (e.hi < lo) continue;
    if (e.lo > hi) break;
    const std::uint32_t d = dfa.dist[e.target];
    if (d != RegexDfa::kNone && (n.max == kUnbounded || f.s1 + 1 + d <= n.max)) return true;
  }
  return false;
}

// Whether a UTF-8 sequence of `length` bytes with `value` so far and `due` bytes to come can still
// end as a valid, allowed character (no overlong forms, no surrogates).
bool Automaton::utf8PrefixAllowed(const Node& n, const Frame& f, std::uint32_t value, std::uint32_t due,
                                  std::uint32_t length) const {
  std::uint32_t lo = value << (6U * due);
  std::uint32_t hi = lo | ((1U << (6U * due)) - 1U);
  lo = std::max(lo, utf8Min(length));
  hi = std::min(hi, utf8Max(length));
  if (lo > hi) return false;
  if (lo <= 0xD7FFU && rangeAllowed(n, f, lo, std::min(hi, 0xD7FFU))) return true;
  if (hi >= 0xE000U && rangeAllowed(n, f, std::max(lo, 0xE000U), hi)) return true;
  return false;
}

void Automaton::feedString(Stack& s, std::uint32_t b, StateSet& out) const {
  if (b > 0xFF) return;  // a marker token never continues a string
  Frame& f = s.top();
  const Node& n = nodes[f.node];
  const std::uint32_t phase = phaseOf(f.s0);
  std::uint32_t q = 0;
  switch (phase) {
    case kOpen:
      if (b != '"') return;
      f.s0 = kContent;
      f.s2 = n.pattern < 0 ? 0 : patterns[static_cast<std::size_t>(n.pattern)].start;
      addUnique(out, s);
      return;
    case kContent:
      if (b == '"') {
        if (f.s1 < n.min) return;
        if (n.pattern >= 0 && patterns[static_cast<std::size_t>(n.pattern)].accepting[f.s2] == 0) return;
        f.s0 = kDone;
        addUnique(out, s);
        return;
      }
      if (b == '\\') {
        bool any = false;
        if (n.pattern < 0) {
          any = n.max == kUnbounded || f.s1 < n.max;
        } else {
          for (const std::uint8_t e : kSimpleEscapes) {
            any = any || charAllowed(n, f, static_cast<std::uint32_t>(simpleEscape(e)), &q);
          }
        }
        if (!any) return;
        f.s0 = kEscape;
        addUnique(out, s);
        return;
      }
      if (b < 0x20) return;
      if (b < 0x80) {
        if (!charAllowed(n, f, b, &q)) return;
        ++f.s1;
        f.s2 = q;
        addUnique(out, s);
        return;
      }
      {
        std::uint32_t length = 0;
        std::uint32_t value = 0;
        if (b >= 0xC2 && b <= 0xDF) {
          length = 2;
          value = b & 0x1FU;
        } else if (b >= 0xE0 && b <= 0xEF) {
          length = 3;
          value = b & 0x0FU;
        } else if (b >= 0xF0 && b <= 0xF4) {
          length = 4;
          value = b & 0x07U;
        } else {
          return;
        }
        if (!utf8PrefixAllowed(n, f, value, length - 1, length)) return;
        f.s0 = packString(kUtf8, length - 1, length, value);
        addUnique(out, s);
        return;
      }
    case kUtf8: {
      if ((b & 0xC0U) != 0x80U) return;
      const std::uint32_t value = (valueOf(f.s0) << 6U) | (b & 0x3FU);
      const std::uint32_t due = dueOf(f.s0) - 1;
      const std::uint32_t length = lengthOf(f.s0);
      if (due > 0) {
        if (!utf8PrefixAllowed(n, f, value, due, length)) return;
        f.s0 = packString(kUtf8, due, length, value);
        addUnique(out, s);
        return;
      }
      if (value < utf8Min(length) || value > utf8Max(length) || (value >= 0xD800U && value <= 0xDFFFU)) return;
      if (!charAllowed(n, f, value, &q)) return;
      f.s0 = kContent;
      ++f.s1;
      f.s2 = q;
      addUnique(out, s);
      return;
    }
    case kEscape: {
      const int cp = simpleEscape(b);
      if (cp >= 0) {
        if (!charAllowed(n, f, static_cast<std::uint32_t>(cp), &q)) return;
        f.s0 = kContent;
        ++f.s1;
        f.s2 = q;
        addUnique(out, s);
        return;
      }
      if (b != 'u' || n.pattern >= 0) return;  // \u only in pattern-free strings
      f.s0 = packString(kHex0, 0, 0, 0);
      addUnique(out, s);
      return;
    }
    case kHex0:
    case kHex0 + 1:
    case kHex0 + 2:
    case kHex0 + 3: {
      const int v = hexValue(b);
      if (v < 0) return;
      const std::uint32_t k = phase - kHex0;
      const std::uint32_t value = valueOf(f.s0);
      if (k == 1 && value == 0xDU && v >= 8) return;  // D800..DFFF: a surrogate
      const std::uint32_t next = (value << 4U) | static_cast<std::uint32_t>(v);
      if (k == 3) {
        f.s0 = kContent;
        ++f.s1;  // the room was checked at the backslash
      } else {
        f.s0 = packString(kHex0 + k + 1, 0, 0, next);
      }
      addUnique(out, s);
      return;
    }
    default:
      return;
  }
}

void Automaton::feed(Stack s, std::uint32_t b, StateSet& out) const {
  while (s.size > 0) {
    Frame& f = s.top();
    const Node& n = nodes[f.node];
    switch (n.kind) {
      case NodeKind::Literal:
        if (f.s0 < n.bytes.size()) {
          if (static_cast<std::uint8_t>(n.bytes[f.s0]) != b) return;
          ++f.s0;
          addUnique(out, s);
          return;
        }
        --s.size;
        continue;
      case NodeKind::Whitespace:
        if (f.s0 < n.max && isWhitespace(b)) {
          Stack t = s;
          ++t.top().s0;
          addUnique(out, t);
        }
        --s.size;
        continue;
      case NodeKind::Sequence:
        if (f.s0 == n.children.size()) {
          --s.size;
          continue;
        }
        if (f.s0 + 1 == n.children.size()) {
          // The last child replaces the sequence (nothing follows it), so repetition built from
          // nested sequences does not grow the stack.
          f = Frame{n.children[f.s0], 0, 0, 0};
          continue;
        }
        push(s, n.children[f.s0++]);
        continue;
      case NodeKind::Marker:
        if (f.s0 == 0) {
          if (b != kMarkerSymbol + n.item) return;
          f.s0 = 1;
          addUnique(out, s);
          return;
        }
        --s.size;
        continue;
      case NodeKind::Choice: {
        --s.size;
        for (const std::uint32_t alt : n.children) {
          if (n.depth_guard && nodes[alt].container && s.size > kGuardDepth) continue;
          Stack t = s;
          push(t, alt);
          feed(t, b, out);
        }
        return;
      }
      case NodeKind::String:
        if (phaseOf(f.s0) == kDone) {
          --s.size;
          continue;
        }
        feedString(s, b, out);
        return;
      case NodeKind::Number: {
        std::uint32_t phase = f.s0;
        std::uint32_t digits = f.s1;
        if (numberStep(phase, digits, b, n.integer)) {
          Stack t = s;
          t.top().s0 = phase;
          t.top().s1 = digits;
          addUnique(out, t);
        }
        if (!numberComplete(f.s0)) return;
        --s.size;
        continue;
      }
      case NodeKind::List:
        switch (f.s0) {
          case 0:
            if (b != n.open) return;
            f.s0 = 1;
            addUnique(out, s);
            return;
          case 1:
          case 3:
          case 5:
            f.s0 = f.s0 + 1;
            push(s, whitespace);
            continue;
          case 2:
          case 6:
            if (b == n.close && f.s1 >= n.min) {
              Stack t = s;
              t.top().s0 = kListDone;
              addUnique(out, t);
            }
            if (f.s0 == 6) {
              if (b == ',' && f.s1 < n.max) {
                f.s0 = 3;
                addUnique(out, s);
              }
              return;
            }
            if (f.s1 >= n.max) return;
            [[fallthrough]];
          case 4:
            ++f.s1;
            f.s0 = 5;
            push(s, n.item);
            continue;
          default:  // kListDone
            --s.size;
            continue;
        }
      case NodeKind::Object: {
        const auto members = static_cast<std::uint32_t>(n.children.size());
        switch (f.s0) {
          case 0:
            if (b != '{') return;
            f.s0 = 1;
            addUnique(out, s);
            return;
          case 1:
          case 3:
          case 5:
            f.s0 = f.s0 == 5 ? 2 : f.s0 + 1;
            push(s, whitespace);
            continue;
          case 2:
            if (b == '}' && n.next_required[f.s1] == members) {
              Stack t = s;
              t.top().s0 = kListDone;
              addUnique(out, t);
            }
            if (f.s2 != 0) {
              if (b == ',' && f.s1 < members) {
                f.s0 = 3;
                addUnique(out, s);
              }
              return;
            }
            [[fallthrough]];
          case 4: {
            // Any member from the next one up to the first required one may come now.
            const std::uint32_t first = f.s1;
            const std::uint32_t last = std::min(n.next_required[first], members - 1);
            for (std::uint32_t j = first; members > 0 && j <= last; ++j) {
              Stack t = s;
              Frame& tf = t.top();
              tf.s0 = 5;
              tf.s1 = j + 1;
              tf.s2 = 1;
              push(t, n.children[j]);
              feed(t, b, out);
            }
            return;
          }
          default:  // kListDone
            --s.size;
            continue;
        }
      }
    }
  }
}

bool Automaton::frameComplete(const Frame& f) const {
  const Node& n = nodes[f.node];
  switch (n.kind) {
    case NodeKind::Literal:
      return f.s0 == n.bytes.size();
    case NodeKind::Whitespace:
      return true;
    case NodeKind::Sequence:
      for (std::size_t i = f.s0; i < n.children.size(); ++i) {
        if (!nodes[n.children[i]].nullable) return false;
      }
      return true;
    case NodeKind::Choice:
      return n.nullable;
    case NodeKind::String:
      return phaseOf(f.s0) == kDone;
    case NodeKind::Number:
      return numberComplete(f.s0);
    case NodeKind::List:
    case NodeKind::Object:
      return f.s0 == kListDone;
    case NodeKind::Marker:
      return f.s0 == 1;
  }
  return false;
}

bool Automaton::complete(const Stack& s) const {
  for (std::uint32_t i = s.size; i > 0; --i) {
    if (!frameComplete(s.frames[i - 1])) return false;
  }
  return true;
}

bool Automaton::patternStringState(const Stack& s, std::int32_t* pattern, std::uint32_t* state,
                                   std::uint32_t* room) const {
  if (s.size == 0) return false;
  const Frame& f = s.top();
  const Node& n = nodes[f.node];
  if (n.kind != NodeKind::String || n.pattern < 0 || phaseOf(f.s0) != kContent) return false;
  *pattern = n.pattern;
  *state = f.s2;
  *room = n.max == kUnbounded ? kUnbounded : n.max - f.s1;
  return true;
}

bool Automaton::plainStringRoom(const Stack& s, std::uint32_t* room) const {
  if (s.size == 0) return false;
  const Frame& f = s.top();
  const Node& n = nodes[f.node];
  if (n.kind != NodeKind::String || n.pattern >= 0 || phaseOf(f.s0) != kContent) return false;
  *room = n.max == kUnbounded ? kUnbounded : n.max - f.s1;
  return true;
}

}  // namespace pd::structured::detail
