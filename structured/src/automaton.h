#pragma once
// The compiled grammar: a graph of nodes run as a nondeterministic pushdown automaton over bytes.
// A Stack is one path's frames (the innermost last); a state set is every Stack still alive.
// Private to pd_structured (docs/structured-outputs.md describes the node kinds).

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "pd/common/generation.h"
#include "regex_dfa.h"

namespace pd::structured::detail {

inline constexpr std::uint32_t kUnbounded = UINT32_MAX;
/// Frames a Stack holds; the compiler keeps schemas within kGuardDepth and generic JSON opens a
/// container only while the stack is at most kGuardDepth deep, which keeps every stack below this.
inline constexpr std::uint32_t kMaxFrames = 64;
inline constexpr std::uint32_t kGuardDepth = 40;

// Limits that make every value finish (docs/structured-outputs.md).
inline constexpr std::uint32_t kMaxIntDigits = 15;
inline constexpr std::uint32_t kMaxFracDigits = 15;
inline constexpr std::uint32_t kMaxExpDigits = 2;

enum class NodeKind : std::uint8_t {
  Literal,     // bytes, exactly
  Whitespace,  // 0..max bytes of space, tab, newline
  Sequence,    // children in order
  Choice,      // one of children (never rests on a stack: replaced by the chosen child)
  String,      // a JSON string: min..max characters, optionally matching a pattern DFA
  Number,      // a JSON number (integer: no fraction or exponent)
  List,        // open item (, item)* close with min..max items: arrays and generic objects
  Object,      // { member (, member)* } with members in schema order, required ones mandatory
  Marker,      // one added token (a tool-call marker), fed as the symbol kMarkerSymbol + item
};

/// The automaton's alphabet: bytes 0..255, then one symbol per marker token of the grammar.
inline constexpr std::uint32_t kMarkerSymbol = 256;

struct Node {
  NodeKind kind = NodeKind::Literal;
  bool nullable = false;                     // can match the empty string (Whitespace, and Sequences/Choices of it)
  bool depth_guard = false;                  // Choice: container alternatives only while the stack is shallow
  bool container = false;                    // List/Object: counts for depth_guard
  bool integer = false;                      // Number
  std::uint8_t open = 0;                     // List
  std::uint8_t close = 0;                    // List
  std::uint32_t min = 0;                     // String: characters; List: items
  std::uint32_t max = kUnbounded;            // String: characters; List: items; Whitespace: bytes
  std::int32_t pattern = -1;                 // String: index into Automaton::patterns
  std::uint32_t item = 0;                    // List
  std::string bytes;                         // Literal
  std::vector<std::uint32_t> children;       // Sequence, Choice; Object: one member per property
  std::vector<std::uint8_t> required;        // Object: per member
  std::vector<std::uint32_t> next_required;  // Object: first required member index >= i (or size)
};

struct Frame {
  std::uint32_t node;
  std::uint32_t s0;
  std::uint32_t s1;
  std::uint32_t s2;
  friend bool operator==(const Frame&, const Frame&) = default;
};

/// One path through the automaton. Copies move only the frames in use.
struct Stack {
  std::uint32_t size = 0;
  std::array<Frame, kMaxFrames> frames;  // NOLINT(cppcoreguidelines-pro-type-member-init): only [0, size) is read

  Stack() = default;
  Stack(const Stack& o) : size(o.size) { std::memcpy(frames.data(), o.frames.data(), size * sizeof(Frame)); }
  Stack& operator=(const Stack& o) {
    if (this != &o) {
      size = o.size;
      std::memcpy(frames.data(), o.frames.data(), size * sizeof(Frame));
    }
    return *this;
  }
  ~Stack() = default;
  Frame& top() { return frames[size - 1]; }
  [[nodiscard]] const Frame& top() const { return frames[size - 1]; }
  bool operator==(const Stack& o) const {
    return size == o.size && std::memcmp(frames.data(), o.frames.data(), size * sizeof(Frame)) == 0;
  }
};

using StateSet = std::vector<Stack>;

/// Adds `s` to `set` unless an equal stack is there already.
void addUnique(StateSet& set, const Stack& s);

struct Automaton {
  std::vector<Node> nodes;
  std::vector<RegexDfa> patterns;
  std::uint32_t root = 0;
  std::uint32_t whitespace = 0;  // the one Whitespace node every gap pushes
  std::vector<TokenId> markers;  // marker index -> its token id (symbol kMarkerSymbol + index)

  /// The state before any byte.
  [[nodiscard]] Stack initial() const;
  /// Every stack `s` becomes after symbol `b` (a byte, or kMarkerSymbol + a marker's index; none
  /// when `b` is not allowed), added to `out`.
  void feed(Stack s, std::uint32_t b, StateSet& out) const;
  /// True when `s` can end here (every frame can complete).
  [[nodiscard]] bool complete(const Stack& s) const;
  /// When the top of `s` is inside a pattern-free string at a character boundary, the characters
  /// it may still take (kUnbounded for no limit); otherwise false.
  [[nodiscard]] bool plainStringRoom(const Stack& s, std::uint32_t* room) const;
  /// When the top of `s` is inside a string with a pattern, at a character boundary: the pattern,
  /// its DFA state and the characters the string may still take (kUnbounded for no limit).
  [[nodiscard]] bool patternStringState(const Stack& s, std::int32_t* pattern, std::uint32_t* state,
                                        std::uint32_t* room) const;

 private:
  [[nodiscard]] bool frameComplete(const Frame& f) const;
  void push(Stack& s, std::uint32_t node) const;
  void feedString(Stack& s, std::uint32_t b, StateSet& out) const;
  [[nodiscard]] bool charAllowed(const Node& n, const Frame& f, std::uint32_t cp, std::uint32_t* next_state) const;
  [[nodiscard]] bool rangeAllowed(const Node& n, const Frame& f, std::uint32_t lo, std::uint32_t hi) const;
  [[nodiscard]] bool utf8PrefixAllowed(const Node& n, const Frame& f, std::uint32_t value, std::uint32_t due,
                                       std::uint32_t length) const;
};

}  // namespace pd::structured::detail
