#pragma once
// A Jinja2 subset for chat templates: parse once (every unsupported construct is an error then),
// render many times. Environment as in Hugging Face transformers: trim_blocks, lstrip_blocks,
// no autoescape, loop controls, a single trailing newline of the source dropped.
//
// Supported: {{ }}, {# #}, whitespace control (- and +); if/elif/else, for (tuple targets,
// `if` filter, else, loop.*), set (names, ns.attr, block set), macro, break/continue,
// generation; literals, lists, dicts, tuples, attribute/subscript/slice, calls with keyword
// arguments, arithmetic, ~, comparisons, in / not in, and/or/not, conditional expressions; the
// filters, tests, methods and globals listed in jinja_parse.cpp.
//
// Thread rules: a parsed Template is immutable; render() is const and may run concurrently.

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "jinja_value.h"
#include "pd/common/result.h"

namespace pd::chat::jinja {

struct SourcePos {
  int line = 1;
  int column = 1;
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    Literal,      // literal
    Name,         // name
    ListLit,      // args: items
    DictLit,      // args: key, value, key, value, ...
    Attr,         // args[0] . name
    Item,         // args[0] [ args[1] ]
    Slice,        // args[0] [ args[1] : args[2] : args[3] ] (null parts allowed)
    Call,         // args[0] ( args[1..], kwargs )
    Filter,       // args[0] | name ( args[1..], kwargs )
    Test,         // args[0] is [not] name ( args[1..] )
    Unary,        // name in {-, +, not}, args[0]
    Binary,       // args[0] name args[1]; name in {+ - * / // % ** ~ == != < <= > >= in, not in}
    And,          // args[0] and args[1]
    Or,           // args[0] or args[1]
    Conditional,  // args[0] if args[1] else args[2] (args[2] may be null)
  };
  Kind kind = Kind::Literal;
  SourcePos pos;
  Value literal;
  std::string name;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  bool negated = false;
};

struct Node;
using Body = std::vector<Node>;

struct Node {
  enum class Kind { Text, Output, If, For, Set, SetBlock, Macro, Break, Continue, Block };
  Kind kind = Kind::Text;
  SourcePos pos;
  std::string text;                                // Text
  ExprPtr expr;                                    // Output, Set value, For iterable
  std::vector<std::string> targets;                // For / Set targets; Macro: name in targets[0]
  std::string attr;                                // Set: `set targets[0].attr = ...` when not empty
  ExprPtr condition;                               // For: `for x in xs if condition`
  std::vector<std::pair<ExprPtr, Body>> branches;  // If: (condition, body); else has no condition
  Body body;
  Body else_body;                                       // For: else
  std::vector<std::pair<std::string, ExprPtr>> params;  // Macro parameters with defaults
  bool uses_loop = false;                               // For: the body reads `loop`
};

/// Built-in or template-defined function values.
struct Callable {
  enum class Kind { Macro, Namespace, Range, RaiseException, StrftimeNow, Dict, LoopCycle };
  Kind kind = Kind::Namespace;
  const Node* macro = nullptr;  // Macro
  Value bound;                  // LoopCycle: the loop index
};

/// Whether a test / filter name is implemented (select() and map() take them as strings).
[[nodiscard]] bool isSupportedTest(std::string_view name);
[[nodiscard]] bool isSupportedFilter(std::string_view name);

class Template {
 public:
  /// Parses `source`; InvalidArgument with line:column for syntax errors and constructs this
  /// subset does not support.
  [[nodiscard]] static Result<Template> parse(std::string_view source);

  /// Renders with `context` (a ValueDict value) as the global variables. InvalidArgument for errors
  /// the data causes (e.g. adding a string to None, raise_exception()).
  [[nodiscard]] Result<std::string> render(const Value& context) const;

 private:
  explicit Template(Body body) : body_(std::make_shared<Body>(std::move(body))) {}
  std::shared_ptr<const Body> body_;
};

}  // namespace pd::chat::jinja
