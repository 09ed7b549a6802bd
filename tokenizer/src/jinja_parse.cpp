// Lexer and parser of the Jinja subset (see jinja.h). Everything this subset cannot render is
// rejected here, so a template that loads renders (data permitting).
#include <algorithm>
#include <array>
#include <cstdint>
#include <set>

#include "jinja.h"
#include "unicode_class.h"

namespace pd::chat::jinja {
namespace {

constexpr std::array kFilters = {
    "abs",  "capitalize", "count",      "d",     "default", "first",  "float",      "int",     "items",   "join",
    "last", "length",     "list",       "lower", "map",     "reject", "rejectattr", "replace", "reverse", "round",
    "safe", "select",     "selectattr", "sort",  "string",  "title",  "tojson",     "trim",    "unique",  "upper",
};
constexpr std::array kTests = {
    "defined", "undefined", "none",     "boolean",  "false",    "true",  "integer", "float",       "number",
    "string",  "mapping",   "iterable", "sequence", "callable", "even",  "odd",     "divisibleby", "eq",
    "equalto", "==",        "ne",       "!=",       "lt",       "<",     "le",      "<=",          "gt",
    ">",       "ge",        ">=",       "in",       "lower",    "upper", "sameas",
};
constexpr std::array kMethods = {
    "strip",   "lstrip", "rstrip", "split", "rsplit",     "startswith", "endswith",
    "replace", "lower",  "upper",  "title", "capitalize", "find",       "count",
    "join",    "get",    "items",  "keys",  "values",     "append",     "cycle",
};
constexpr std::array kGlobals = {"namespace", "range", "raise_exception", "strftime_now", "dict"};

template <std::size_t N>
bool contains(const std::array<const char*, N>& names, std::string_view name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

struct Token {
  enum class Type { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, End };
  Type type = Type::End;
  std::string value;
  std::int64_t int_value = 0;
  double float_value = 0;
  SourcePos pos;
};

Error syntaxError(SourcePos pos, const std::string& message) {
  return makeError(ErrorCode::InvalidArgument,
                   "chat template " + std::to_string(pos.line) + ":" + std::to_string(pos.column) + ": " + message);
}

bool isSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) : src_(source) {
    // keep_trailing_newline=False: one trailing newline of the source is not output.
    if (src_.ends_with("\r\n")) {
      src_.remove_suffix(2);
    } else if (src_.ends_with('\n')) {
      src_.remove_suffix(1);
    }
  }

  Result<std::vector<Token>> run() {
    enum class Tag { None, Var, Block, Comment };
    Tag prev = Tag::None;
    char prev_right = 0;  // '-' or '+' or 0 on the previous tag's closing side
    std::size_t pos = 0;
    while (true) {
      std::size_t open = pos;
      Tag next = Tag::None;
      while ((open = src_.find('{', open)) != std::string_view::npos) {
        if (open + 1 < src_.size()) {
          const char c = src_[open + 1];
          next = c == '{' ? Tag::Var : c == '%' ? Tag::Block : c == '#' ? Tag::Comment : Tag::None;
          if (next != Tag::None) break;
        }
        ++open;
      }
      if (open == std::string_view::npos) open = src_.size();
      const char left = next != Tag::None && open + 2 < src_.size() && (src_[open + 2] == '-' || src_[open + 2] == '+')
                            ? src_[open + 2]
                            : 0;
      std::string_view text = src_.substr(pos, open - pos);
      // Left end of the text: the previous tag's '-' strips all whitespace; trim_blocks drops
      // one newline after a block or comment tag.
      if (prev_right == '-') {
        while (!text.empty() && isSpace(text.front())) text.remove_prefix(1);
      } else if ((prev == Tag::Block || prev == Tag::Comment) && prev_right != '+') {
        if (text.starts_with("\r\n")) {
          text.remove_prefix(2);
        } else if (text.starts_with('\n')) {
          text.remove_prefix(1);
        }
      }
      // Right end: the next tag's '-' strips all whitespace; lstrip_blocks drops spaces and
      // tabs between a line start and a block or comment tag.
      if (left == '-') {
        while (!text.empty() && isSpace(text.back())) text.remove_suffix(1);
      } else if ((next == Tag::Block || next == Tag::Comment) && left != '+') {
        std::size_t k = open;
        while (k > 0 && (src_[k - 1] == ' ' || src_[k - 1] == '\t')) --k;
        const bool line_start = k == 0 || src_[k - 1] == '\n';
        if (line_start && k >= pos) {
          const std::size_t strip = open - k;
          if (strip <= text.size()) text.remove_suffix(strip);
        }
      }
      if (!text.empty()) push(Token::Type::Text, std::string(text), pos);
      if (next == Tag::None) break;

      std::size_t p = open + 2 + (left != 0 ? 1 : 0);
      if (next == Tag::Comment) {
        const std::size_t close = src_.find("#}", p);
        if (close == std::string_view::npos) return syntaxError(posOf(open), "unterminated comment");
        prev_right = close > p && (src_[close - 1] == '-' || src_[close - 1] == '+') ? src_[close - 1] : 0;
        prev = Tag::Comment;
        pos = close + 2;
        continue;
      }
      push(next == Tag::Var ? Token::Type::VarBegin : Token::Type::BlockBegin, {}, open);
      const std::string_view closer = next == Tag::Var ? "}}" : "%}";
      PD_ASSIGN_OR_RETURN(p, lexTag(p, closer, prev_right));
      push(next == Tag::Var ? Token::Type::VarEnd : Token::Type::BlockEnd, {}, p - 2);
      prev = next;
      pos = p;
    }
    push(Token::Type::End, {}, src_.size());
    return std::move(tokens_);
  }

 private:
  SourcePos posOf(std::size_t offset) const {
    SourcePos pos;
    for (std::size_t k = 0; k < offset && k < src_.size(); ++k) {
      if (src_[k] == '\n') {
        ++pos.line;
        pos.column = 1;
      } else if ((static_cast<unsigned char>(src_[k]) & 0xC0) != 0x80) {
        ++pos.column;
      }
    }
    return pos;
  }

  void push(Token::Type type, std::string value, std::size_t offset) {
    Token t;
    t.type = type;
    t.value = std::move(value);
    t.pos = posOf(offset);
    tokens_.push_back(std::move(t));
  }

  // Lexes expression tokens from p up to the closer; returns the offset after the closer.
  Result<std::size_t> lexTag(std::size_t p, std::string_view closer, char& right) {
    int depth = 0;  // open brackets: `}}` inside `{'a': {'b': 1}}` does not close the tag
    while (true) {
      while (p < src_.size() && isSpace(src_[p])) ++p;
      if (p >= src_.size()) return syntaxError(posOf(p), "unterminated tag, expected '" + std::string(closer) + "'");
      const std::string_view rest = src_.substr(p);
      if (depth == 0 && (rest.starts_with('-') || rest.starts_with('+')) && rest.substr(1).starts_with(closer)) {
        right = rest[0];
        return p + 3;
      }
      if (depth == 0 && rest.starts_with(closer)) {
        right = 0;
        return p + 2;
      }
      if (rest[0] == '(' || rest[0] == '[' || rest[0] == '{') ++depth;
      if ((rest[0] == ')' || rest[0] == ']' || rest[0] == '}') && depth > 0) --depth;
      const char c = src_[p];
      if (std::isalpha(static_cast<unsigned char>(c)) != 0 || c == '_') {
        std::size_t e = p;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) != 0 || src_[e] == '_')) ++e;
        push(Token::Type::Name, std::string(src_.substr(p, e - p)), p);
        p = e;
      } else if (std::isdigit(static_cast<unsigned char>(c)) != 0) {
        PD_ASSIGN_OR_RETURN(p, lexNumber(p));
      } else if (c == '\'' || c == '"') {
        PD_ASSIGN_OR_RETURN(p, lexString(p));
      } else {
        static constexpr std::array<std::string_view, 6> kTwo = {"//", "**", "==", "!=", "<=", ">="};
        const auto two =
            std::find_if(kTwo.begin(), kTwo.end(), [&](std::string_view op) { return rest.starts_with(op); });
        if (two != kTwo.end()) {
          push(Token::Type::Op, std::string(*two), p);
          p += 2;
        } else if (std::string_view("+-*/%~<>=()[]{},.:|").find(c) != std::string_view::npos) {
          push(Token::Type::Op, std::string(1, c), p);
          ++p;
        } else {
          return syntaxError(posOf(p), std::string("unexpected character '") + c + "'");
        }
      }
    }
  }

  Result<std::size_t> lexNumber(std::size_t p) {
    const std::size_t start = p;
    std::string digits;
    bool is_float = false;
    const auto take_digits = [&] {
      while (p < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[p])) != 0 || src_[p] == '_')) {
        if (src_[p] != '_') digits.push_back(src_[p]);
        ++p;
      }
    };
    take_digits();
    if (p + 1 < src_.size() && src_[p] == '.' && std::isdigit(static_cast<unsigned char>(src_[p + 1])) != 0) {
      is_float = true;
      digits.push_back('.');
      ++p;
      take_digits();
    }
    if (p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
      std::size_t q = p + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < src_.size() && std::isdigit(static_cast<unsigned char>(src_[q])) != 0) {
        is_float = true;
        digits.append(src_.substr(p, q - p));
        p = q;
        take_digits();
      }
    }
    Token t;
    t.pos = posOf(start);
    t.value = digits;
    try {
      if (is_float) {
        t.type = Token::Type::Float;
        t.float_value = std::stod(digits);
      } else {
        t.type = Token::Type::Int;
        t.int_value = std::stoll(digits);
      }
    } catch (const std::exception&) {
      return syntaxError(t.pos, "bad number '" + digits + "'");
    }
    tokens_.push_back(std::move(t));
    return p;
  }

  // Python string literal with unicode-escape semantics.
  Result<std::size_t> lexString(std::size_t p) {
    const std::size_t start = p;
    const char quote = src_[p++];
    std::string out;
    const auto hex = [&](std::size_t at, int count, char32_t& cp) {
      cp = 0;
      for (int k = 0; k < count; ++k) {
        if (at + static_cast<std::size_t>(k) >= src_.size()) return false;
        const char h = src_[at + static_cast<std::size_t>(k)];
        const int v = std::isdigit(static_cast<unsigned char>(h)) != 0 ? h - '0'
                      : (h >= 'a' && h <= 'f')                         ? h - 'a' + 10
                      : (h >= 'A' && h <= 'F')                         ? h - 'A' + 10
                                                                       : -1;
        if (v < 0) return false;
        cp = cp * 16 + static_cast<char32_t>(v);
      }
      return true;
    };
    while (true) {
      if (p >= src_.size()) return syntaxError(posOf(start), "unterminated string literal");
      const char c = src_[p];
      if (c == quote) {
        ++p;
        break;
      }
      if (c != '\\') {
        out.push_back(c);
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) return syntaxError(posOf(start), "unterminated string literal");
      const char e = src_[p + 1];
      p += 2;
      char32_t cp = 0;
      switch (e) {
        case '\n':
          break;  // line continuation
        case '\\':
          out.push_back('\\');
          break;
        case '\'':
          out.push_back('\'');
          break;
        case '"':
          out.push_back('"');
          break;
        case 'a':
          out.push_back('\a');
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'n':
          out.push_back('\n');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'v':
          out.push_back('\v');
          break;
        case 'x':
        case 'u':
        case 'U': {
          const int count = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          if (!hex(p, count, cp)) return syntaxError(posOf(p - 2), std::string("bad \\") + e + " escape");
          p += static_cast<std::size_t>(count);
          if (cp >= 0xD800 && cp <= 0xDBFF && src_.substr(p).starts_with("\\u")) {
            char32_t low = 0;
            if (hex(p + 2, 4, low) && low >= 0xDC00 && low <= 0xDFFF) {
              cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
              p += 6;
            }
          }
          if ((cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
            return syntaxError(posOf(p), "escape is not a Unicode scalar value");
          }
          pd::tokenizer::detail::appendUtf8(out, cp);
          break;
        }
        case 'N':
          return syntaxError(posOf(p - 2), "\\N{...} escapes are not supported");
        default:
          if (e >= '0' && e <= '7') {
            cp = static_cast<char32_t>(e - '0');
            for (int k = 0; k < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++k) {
              cp = cp * 8 + static_cast<char32_t>(src_[p++] - '0');
            }
            pd::tokenizer::detail::appendUtf8(out, cp);
          } else {
            out.push_back('\\');  // unknown escapes stay as written
            out.push_back(e);
          }
      }
    }
    push(Token::Type::String, std::move(out), start);
    return p;
  }

  std::string_view src_;
  std::vector<Token> tokens_;
};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  Result<Body> run() {
    std::string end;
    PD_ASSIGN_OR_RETURN(auto body, parseBody({}, end));
    PD_TRY(checkCalls(body));
    return body;
  }

 private:
  const Token& cur() const { return t_[i_]; }
  const Token& peek(std::size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  bool isOp(std::string_view op) const { return cur().type == Token::Type::Op && cur().value == op; }
  bool isName(std::string_view name) const { return cur().type == Token::Type::Name && cur().value == name; }

  Status expectOp(std::string_view op) {
    if (!isOp(op)) return syntaxError(cur().pos, "expected '" + std::string(op) + "'" + found());
    ++i_;
    return okStatus();
  }
  Status expectBlockEnd() {
    if (cur().type != Token::Type::BlockEnd) return syntaxError(cur().pos, "expected end of statement '%}'" + found());
    ++i_;
    return okStatus();
  }
  Result<std::string> expectName() {
    if (cur().type != Token::Type::Name) return syntaxError(cur().pos, "expected a name" + found());
    return t_[i_++].value;
  }
  std::string found() const {
    switch (cur().type) {
      case Token::Type::Name:
      case Token::Type::Op:
        return ", found '" + cur().value + "'";
      case Token::Type::String:
        return ", found a string";
      case Token::Type::BlockEnd:
        return ", found '%}'";
      case Token::Type::VarEnd:
        return ", found '}}'";
      case Token::Type::End:
        return ", found the end of the template";
      default:
        return "";
    }
  }

  // Parses nodes until a `{% name %}` with name in `ends` (consumed up to the name; the caller
  // parses the rest of that tag). `end` receives the name ("" at the end of the template).
  Result<Body> parseBody(const std::set<std::string>& ends, std::string& end) {
    Body body;
    while (true) {
      const Token& tok = cur();
      if (tok.type == Token::Type::End) {
        if (!ends.empty()) {
          return syntaxError(tok.pos, "missing '{% " + *ends.rbegin() + " %}' before the end of the template");
        }
        end.clear();
        return body;
      }
      if (tok.type == Token::Type::Text) {
        Node n;
        n.kind = Node::Kind::Text;
        n.pos = tok.pos;
        n.text = tok.value;
        body.push_back(std::move(n));
        ++i_;
        continue;
      }
      if (tok.type == Token::Type::VarBegin) {
        Node n;
        n.kind = Node::Kind::Output;
        n.pos = tok.pos;
        ++i_;
        PD_ASSIGN_OR_RETURN(n.expr, parseExpr());
        if (cur().type != Token::Type::VarEnd) return syntaxError(cur().pos, "expected '}}'" + found());
        ++i_;
        body.push_back(std::move(n));
        continue;
      }
      if (tok.type != Token::Type::BlockBegin) return syntaxError(tok.pos, "unexpected token" + found());
      ++i_;
      if (cur().type != Token::Type::Name) return syntaxError(cur().pos, "expected a statement name" + found());
      const std::string keyword = cur().value;
      if (ends.count(keyword) != 0) {
        ++i_;
        end = keyword;
        return body;
      }
      PD_ASSIGN_OR_RETURN(auto node, parseStatement());
      body.push_back(std::move(node));
    }
  }

  Result<Node> parseStatement() {
    Node n;
    n.pos = cur().pos;
    const std::string keyword = cur().value;
    ++i_;
    std::string end;
    if (keyword == "if") {
      n.kind = Node::Kind::If;
      PD_ASSIGN_OR_RETURN(auto cond, parseExpr());
      PD_TRY(expectBlockEnd());
      while (true) {
        PD_ASSIGN_OR_RETURN(auto body, parseBody({"elif", "else", "endif"}, end));
        n.branches.emplace_back(std::move(cond), std::move(body));
        if (end == "elif") {
          PD_ASSIGN_OR_RETURN(cond, parseExpr());
          PD_TRY(expectBlockEnd());
        } else if (end == "else") {
          PD_TRY(expectBlockEnd());
          PD_ASSIGN_OR_RETURN(auto else_body, parseBody({"endif"}, end));
          n.branches.emplace_back(nullptr, std::move(else_body));
          PD_TRY(expectBlockEnd());
          return n;
        } else {
          PD_TRY(expectBlockEnd());
          return n;
        }
      }
    }
    if (keyword == "for") {
      n.kind = Node::Kind::For;
      const bool paren = isOp("(");
      if (paren) ++i_;
      PD_ASSIGN_OR_RETURN(auto first, expectName());
      n.targets.push_back(first);
      while (isOp(",")) {
        ++i_;
        PD_ASSIGN_OR_RETURN(auto more, expectName());
        n.targets.push_back(more);
      }
      if (paren) PD_TRY(expectOp(")"));
      if (!isName("in")) return syntaxError(cur().pos, "expected 'in' in for loop" + found());
      ++i_;
      PD_ASSIGN_OR_RETURN(n.expr, parseTupleOrExpr(/*with_conditional=*/false));
      if (isName("if")) {
        ++i_;
        PD_ASSIGN_OR_RETURN(n.condition, parseExpr());
      }
      if (isName("recursive")) return syntaxError(cur().pos, "recursive for loops are not supported");
      PD_TRY(expectBlockEnd());
      ++loop_depth_;
      PD_ASSIGN_OR_RETURN(n.body, parseBody({"else", "endfor"}, end));
      --loop_depth_;
      n.uses_loop = usesName(n.body, "loop");
      if (end == "else") {
        PD_TRY(expectBlockEnd());
        PD_ASSIGN_OR_RETURN(n.else_body, parseBody({"endfor"}, end));
      }
      PD_TRY(expectBlockEnd());
      return n;
    }
    if (keyword == "set") {
      PD_ASSIGN_OR_RETURN(auto name, expectName());
      n.targets.push_back(name);
      if (isOp(".")) {
        ++i_;
        PD_ASSIGN_OR_RETURN(n.attr, expectName());
      } else {
        while (isOp(",")) {
          ++i_;
          PD_ASSIGN_OR_RETURN(auto more, expectName());
          n.targets.push_back(more);
        }
      }
      if (isOp("=")) {
        ++i_;
        n.kind = Node::Kind::Set;
        PD_ASSIGN_OR_RETURN(n.expr, parseTupleOrExpr(/*with_conditional=*/true));
        PD_TRY(expectBlockEnd());
        return n;
      }
      if (n.targets.size() != 1 || !n.attr.empty() || cur().type != Token::Type::BlockEnd) {
        return syntaxError(cur().pos, "expected '=' in set" + found());
      }
      n.kind = Node::Kind::SetBlock;
      PD_TRY(expectBlockEnd());
      PD_ASSIGN_OR_RETURN(n.body, parseBody({"endset"}, end));
      PD_TRY(expectBlockEnd());
      return n;
    }
    if (keyword == "macro") {
      n.kind = Node::Kind::Macro;
      PD_ASSIGN_OR_RETURN(auto name, expectName());
      n.targets.push_back(name);
      macros_.insert(name);
      PD_TRY(expectOp("("));
      while (!isOp(")")) {
        PD_ASSIGN_OR_RETURN(auto param, expectName());
        ExprPtr def;
        if (isOp("=")) {
          ++i_;
          PD_ASSIGN_OR_RETURN(def, parseExpr());
        }
        n.params.emplace_back(param, std::move(def));
        if (!isOp(",")) break;
        ++i_;
      }
      PD_TRY(expectOp(")"));
      PD_TRY(expectBlockEnd());
      const int saved = loop_depth_;
      loop_depth_ = 0;
      PD_ASSIGN_OR_RETURN(n.body, parseBody({"endmacro"}, end));
      loop_depth_ = saved;
      PD_TRY(expectBlockEnd());
      return n;
    }
    if (keyword == "break" || keyword == "continue") {
      if (loop_depth_ == 0) return syntaxError(n.pos, "'" + keyword + "' outside of a for loop");
      n.kind = keyword == "break" ? Node::Kind::Break : Node::Kind::Continue;
      PD_TRY(expectBlockEnd());
      return n;
    }
    if (keyword == "generation") {
      n.kind = Node::Kind::Block;
      PD_TRY(expectBlockEnd());
      PD_ASSIGN_OR_RETURN(n.body, parseBody({"endgeneration"}, end));
      PD_TRY(expectBlockEnd());
      return n;
    }
    return syntaxError(n.pos, "statement '" + keyword + "' is not supported by this Jinja subset");
  }

  // `a, b` (a tuple without parentheses) or one expression.
  Result<ExprPtr> parseTupleOrExpr(bool with_conditional) {
    const SourcePos pos = cur().pos;
    PD_ASSIGN_OR_RETURN(auto first, parseExpr(with_conditional));
    if (!isOp(",")) return first;
    auto list = node(Expr::Kind::ListLit, pos);
    list->args.push_back(std::move(first));
    while (isOp(",")) {
      ++i_;
      if (cur().type == Token::Type::BlockEnd || isName("if")) break;
      PD_ASSIGN_OR_RETURN(auto item, parseExpr(with_conditional));
      list->args.push_back(std::move(item));
    }
    return list;
  }

  static ExprPtr node(Expr::Kind kind, SourcePos pos) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->pos = pos;
    return e;
  }
  static ExprPtr binary(Expr::Kind kind, std::string op, ExprPtr a, ExprPtr b, SourcePos pos) {
    auto e = node(kind, pos);
    e->name = std::move(op);
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }

  Result<ExprPtr> parseExpr(bool with_conditional = true) {
    if (++depth_ > 200) return syntaxError(cur().pos, "expression nested too deeply");
    auto result = parseConditional(with_conditional);
    --depth_;
    return result;
  }

  Result<ExprPtr> parseConditional(bool with_conditional) {
    const SourcePos pos = cur().pos;
    PD_ASSIGN_OR_RETURN(auto value, parseOr());
    while (with_conditional && isName("if")) {
      ++i_;
      PD_ASSIGN_OR_RETURN(auto cond, parseOr());
      ExprPtr otherwise;
      if (isName("else")) {
        ++i_;
        PD_ASSIGN_OR_RETURN(otherwise, parseConditional(true));
      }
      auto e = node(Expr::Kind::Conditional, pos);
      e->args.push_back(std::move(value));
      e->args.push_back(std::move(cond));
      e->args.push_back(std::move(otherwise));
      value = std::move(e);
    }
    return value;
  }

  Result<ExprPtr> parseOr() {
    PD_ASSIGN_OR_RETURN(auto left, parseAnd());
    while (isName("or")) {
      const SourcePos pos = cur().pos;
      ++i_;
      PD_ASSIGN_OR_RETURN(auto right, parseAnd());
      left = binary(Expr::Kind::Or, "or", std::move(left), std::move(right), pos);
    }
    return left;
  }

  Result<ExprPtr> parseAnd() {
    PD_ASSIGN_OR_RETURN(auto left, parseNot());
    while (isName("and")) {
      const SourcePos pos = cur().pos;
      ++i_;
      PD_ASSIGN_OR_RETURN(auto right, parseNot());
      left = binary(Expr::Kind::And, "and", std::move(left), std::move(right), pos);
    }
    return left;
  }

  Result<ExprPtr> parseNot() {
    if (isName("not")) {
      const SourcePos pos = cur().pos;
      ++i_;
      PD_ASSIGN_OR_RETURN(auto operand, parseNot());
      auto e = node(Expr::Kind::Unary, pos);
      e->name = "not";
      e->args.push_back(std::move(operand));
      return e;
    }
    return parseCompare();
  }

  Result<ExprPtr> parseCompare() {
    const SourcePos pos = cur().pos;
    PD_ASSIGN_OR_RETURN(auto left, parseMath1());
    ExprPtr chain;
    while (true) {
      std::string op;
      if (cur().type == Token::Type::Op && (cur().value == "==" || cur().value == "!=" || cur().value == "<" ||
                                            cur().value == "<=" || cur().value == ">" || cur().value == ">=")) {
        op = cur().value;
        ++i_;
      } else if (isName("in")) {
        op = "in";
        ++i_;
      } else if (isName("not") && peek().type == Token::Type::Name && peek().value == "in") {
        op = "not in";
        i_ += 2;
      } else {
        break;
      }
      PD_ASSIGN_OR_RETURN(auto right, parseMath1());
      if (chain == nullptr) {
        chain = binary(Expr::Kind::Binary, op, std::move(left), std::move(right), pos);
      } else {
        // a < b < c is (a < b) and (b < c); the middle operand is parsed again by reference.
        return syntaxError(pos, "chained comparisons are not supported");
      }
    }
    return chain != nullptr ? std::move(chain) : std::move(left);
  }

  Result<ExprPtr> parseMath1() {
    PD_ASSIGN_OR_RETURN(auto left, parseConcat());
    while (isOp("+") || isOp("-")) {
      const SourcePos pos = cur().pos;
      const std::string op = t_[i_++].value;
      PD_ASSIGN_OR_RETURN(auto right, parseConcat());
      left = binary(Expr::Kind::Binary, op, std::move(left), std::move(right), pos);
    }
    return left;
  }

  Result<ExprPtr> parseConcat() {
    PD_ASSIGN_OR_RETURN(auto left, parseMath2());
    while (isOp("~")) {
      const SourcePos pos = cur().pos;
      ++i_;
      PD_ASSIGN_OR_RETURN(auto right, parseMath2());
      left = binary(Expr::Kind::Binary, "~", std::move(left), std::move(right), pos);
    }
    return left;
  }

  Result<ExprPtr> parseMath2() {
    PD_ASSIGN_OR_RETURN(auto left, parsePow());
    while (isOp("*") || isOp("/") || isOp("//") || isOp("%")) {
      const SourcePos pos = cur().pos;
      const std::string op = t_[i_++].value;
      PD_ASSIGN_OR_RETURN(auto right, parsePow());
      left = binary(Expr::Kind::Binary, op, std::move(left), std::move(right), pos);
    }
    return left;
  }

  Result<ExprPtr> parsePow() {
    PD_ASSIGN_OR_RETURN(auto left, parseUnary(true));
    while (isOp("**")) {
      const SourcePos pos = cur().pos;
      ++i_;
      PD_ASSIGN_OR_RETURN(auto right, parseUnary(true));
      left = binary(Expr::Kind::Binary, "**", std::move(left), std::move(right), pos);
    }
    return left;
  }

  Result<ExprPtr> parseUnary(bool with_filter) {
    const SourcePos pos = cur().pos;
    ExprPtr e;
    if (isOp("-") || isOp("+")) {
      const std::string op = t_[i_++].value;
      PD_ASSIGN_OR_RETURN(auto operand, parseUnary(false));
      e = node(Expr::Kind::Unary, pos);
      e->name = op;
      e->args.push_back(std::move(operand));
    } else {
      PD_ASSIGN_OR_RETURN(e, parsePrimary());
    }
    PD_ASSIGN_OR_RETURN(e, parsePostfix(std::move(e)));
    if (with_filter) {
      PD_ASSIGN_OR_RETURN(e, parseFilters(std::move(e)));
    }
    return e;
  }

  Result<ExprPtr> parsePrimary() {
    const Token& tok = cur();
    const SourcePos pos = tok.pos;
    switch (tok.type) {
      case Token::Type::Name: {
        auto e = node(Expr::Kind::Literal, pos);
        if (tok.value == "true" || tok.value == "True") {
          e->literal = Value::boolean(true);
        } else if (tok.value == "false" || tok.value == "False") {
          e->literal = Value::boolean(false);
        } else if (tok.value == "none" || tok.value == "None") {
          e->literal = Value::none();
        } else {
          e->kind = Expr::Kind::Name;
          e->name = tok.value;
        }
        ++i_;
        return e;
      }
      case Token::Type::String: {
        std::string s;
        while (cur().type == Token::Type::String) s += t_[i_++].value;  // adjacent literals join
        auto e = node(Expr::Kind::Literal, pos);
        e->literal = Value::string(std::move(s));
        return e;
      }
      case Token::Type::Int: {
        auto e = node(Expr::Kind::Literal, pos);
        e->literal = Value::integer(tok.int_value);
        ++i_;
        return e;
      }
      case Token::Type::Float: {
        auto e = node(Expr::Kind::Literal, pos);
        e->literal = Value::real(tok.float_value);
        ++i_;
        return e;
      }
      case Token::Type::Op: {
        if (tok.value == "(") {
          ++i_;
          if (isOp(")")) {
            ++i_;
            return node(Expr::Kind::ListLit, pos);  // () is an empty tuple
          }
          PD_ASSIGN_OR_RETURN(auto inner, parseExpr());
          if (isOp(",")) {
            auto list = node(Expr::Kind::ListLit, pos);
            list->args.push_back(std::move(inner));
            while (isOp(",")) {
              ++i_;
              if (isOp(")")) break;
              PD_ASSIGN_OR_RETURN(auto item, parseExpr());
              list->args.push_back(std::move(item));
            }
            inner = std::move(list);
          }
          PD_TRY(expectOp(")"));
          return inner;
        }
        if (tok.value == "[") {
          ++i_;
          auto list = node(Expr::Kind::ListLit, pos);
          while (!isOp("]")) {
            PD_ASSIGN_OR_RETURN(auto item, parseExpr());
            list->args.push_back(std::move(item));
            if (!isOp(",")) break;
            ++i_;
          }
          PD_TRY(expectOp("]"));
          return list;
        }
        if (tok.value == "{") {
          ++i_;
          auto dict = node(Expr::Kind::DictLit, pos);
          while (!isOp("}")) {
            PD_ASSIGN_OR_RETURN(auto key, parseExpr());
            PD_TRY(expectOp(":"));
            PD_ASSIGN_OR_RETURN(auto value, parseExpr());
            dict->args.push_back(std::move(key));
            dict->args.push_back(std::move(value));
            if (!isOp(",")) break;
            ++i_;
          }
          PD_TRY(expectOp("}"));
          return dict;
        }
        break;
      }
      default:
        break;
    }
    return syntaxError(pos, "expected an expression" + found());
  }

  Result<ExprPtr> parsePostfix(ExprPtr e) {
    while (true) {
      const SourcePos pos = cur().pos;
      if (isOp(".")) {
        ++i_;
        if (cur().type == Token::Type::Int) {
          auto item = node(Expr::Kind::Item, pos);
          auto index = node(Expr::Kind::Literal, pos);
          index->literal = Value::integer(t_[i_++].int_value);
          item->args.push_back(std::move(e));
          item->args.push_back(std::move(index));
          e = std::move(item);
          continue;
        }
        PD_ASSIGN_OR_RETURN(auto name, expectName());
        auto attr = node(Expr::Kind::Attr, pos);
        attr->name = name;
        attr->args.push_back(std::move(e));
        e = std::move(attr);
      } else if (isOp("[")) {
        ++i_;
        std::array<ExprPtr, 3> parts;
        bool slice = false;
        for (std::size_t k = 0; k < 3; ++k) {
          if (!isOp(":") && !isOp("]")) {
            PD_ASSIGN_OR_RETURN(parts[k], parseExpr());
          }
          if (!isOp(":")) break;
          slice = true;
          ++i_;
        }
        PD_TRY(expectOp("]"));
        if (!slice && parts[0] == nullptr) return syntaxError(pos, "empty subscript");
        auto sub = node(slice ? Expr::Kind::Slice : Expr::Kind::Item, pos);
        sub->args.push_back(std::move(e));
        sub->args.push_back(std::move(parts[0]));
        if (slice) {
          sub->args.push_back(std::move(parts[1]));
          sub->args.push_back(std::move(parts[2]));
        }
        e = std::move(sub);
      } else if (isOp("(")) {
        PD_ASSIGN_OR_RETURN(e, parseCall(std::move(e), Expr::Kind::Call, "", pos));
      } else {
        return e;
      }
    }
  }

  // Parses `( args )` for a call, filter or test whose subject is `subject`.
  Result<ExprPtr> parseCall(ExprPtr subject, Expr::Kind kind, std::string name, SourcePos pos) {
    auto e = node(kind, pos);
    e->name = std::move(name);
    e->args.push_back(std::move(subject));
    PD_TRY(expectOp("("));
    while (!isOp(")")) {
      if (isOp("*") || isOp("**")) return syntaxError(cur().pos, "*args / **kwargs are not supported");
      if (cur().type == Token::Type::Name && peek().type == Token::Type::Op && peek().value == "=") {
        std::string key = t_[i_].value;
        i_ += 2;
        PD_ASSIGN_OR_RETURN(auto value, parseExpr());
        e->kwargs.emplace_back(std::move(key), std::move(value));
      } else {
        if (!e->kwargs.empty()) return syntaxError(cur().pos, "positional argument after keyword argument");
        PD_ASSIGN_OR_RETURN(auto value, parseExpr());
        e->args.push_back(std::move(value));
      }
      if (!isOp(",")) break;
      ++i_;
    }
    PD_TRY(expectOp(")"));
    return e;
  }

  Result<ExprPtr> parseFilters(ExprPtr e) {
    while (true) {
      const SourcePos pos = cur().pos;
      if (isOp("|")) {
        ++i_;
        PD_ASSIGN_OR_RETURN(auto name, expectName());
        if (!contains(kFilters, name)) return syntaxError(pos, "filter '" + name + "' is not supported");
        if (isOp("(")) {
          PD_ASSIGN_OR_RETURN(e, parseCall(std::move(e), Expr::Kind::Filter, name, pos));
        } else {
          auto f = node(Expr::Kind::Filter, pos);
          f->name = name;
          f->args.push_back(std::move(e));
          e = std::move(f);
        }
      } else if (isName("is")) {
        ++i_;
        bool negated = false;
        if (isName("not")) {
          negated = true;
          ++i_;
        }
        std::string name;
        if (cur().type == Token::Type::Name || (cur().type == Token::Type::Op && contains(kTests, cur().value))) {
          name = t_[i_++].value;
        } else {
          return syntaxError(cur().pos, "expected a test name after 'is'" + found());
        }
        if (!contains(kTests, name)) return syntaxError(pos, "test '" + name + "' is not supported");
        ExprPtr test;
        if (isOp("(")) {
          PD_ASSIGN_OR_RETURN(test, parseCall(std::move(e), Expr::Kind::Test, name, pos));
        } else {
          test = node(Expr::Kind::Test, pos);
          test->name = name;
          test->args.push_back(std::move(e));
          const Token& next = cur();
          const bool arg_follows =
              (next.type == Token::Type::Name && next.value != "else" && next.value != "or" && next.value != "and" &&
               next.value != "if" && next.value != "in" && next.value != "not" && next.value != "is") ||
              next.type == Token::Type::String || next.type == Token::Type::Int || next.type == Token::Type::Float ||
              (next.type == Token::Type::Op && (next.value == "[" || next.value == "{"));
          if (arg_follows) {
            PD_ASSIGN_OR_RETURN(auto arg, parsePrimary());
            PD_ASSIGN_OR_RETURN(arg, parsePostfix(std::move(arg)));
            test->args.push_back(std::move(arg));
          }
        }
        test->negated = negated;
        e = std::move(test);
      } else if (isOp("(")) {
        PD_ASSIGN_OR_RETURN(e, parseCall(std::move(e), Expr::Kind::Call, "", pos));
      } else {
        return e;
      }
    }
  }

  static bool usesName(const Expr* e, std::string_view name) {
    if (e == nullptr) return false;
    if (e->kind == Expr::Kind::Name && e->name == name) return true;
    for (const auto& arg : e->args) {
      if (usesName(arg.get(), name)) return true;
    }
    for (const auto& kw : e->kwargs) {
      if (usesName(kw.second.get(), name)) return true;
    }
    return false;
  }

  static bool usesName(const Body& body, std::string_view name) {
    for (const Node& n : body) {
      if (usesName(n.expr.get(), name) || usesName(n.condition.get(), name)) return true;
      for (const auto& [cond, branch] : n.branches) {
        if (usesName(cond.get(), name) || usesName(branch, name)) return true;
      }
      for (const auto& param : n.params) {
        if (usesName(param.second.get(), name)) return true;
      }
      if (usesName(n.body, name) || usesName(n.else_body, name)) return true;
    }
    return false;
  }

  // Every call must reach something this subset implements: a global function, a macro of this
  // template, or a known method.
  Status checkCalls(const Body& body) const {
    for (const Node& n : body) {
      PD_TRY(checkExpr(n.expr.get()));
      PD_TRY(checkExpr(n.condition.get()));
      for (const auto& [cond, branch] : n.branches) {
        PD_TRY(checkExpr(cond.get()));
        PD_TRY(checkCalls(branch));
      }
      for (const auto& param : n.params) PD_TRY(checkExpr(param.second.get()));
      PD_TRY(checkCalls(n.body));
      PD_TRY(checkCalls(n.else_body));
    }
    return okStatus();
  }

  Status checkExpr(const Expr* e) const {
    if (e == nullptr) return okStatus();
    if (e->kind == Expr::Kind::Call) {
      const Expr* callee = e->args[0].get();
      if (callee->kind == Expr::Kind::Name) {
        if (!contains(kGlobals, callee->name) && macros_.count(callee->name) == 0) {
          return syntaxError(e->pos, "function '" + callee->name + "' is not defined in this Jinja subset");
        }
      } else if (callee->kind == Expr::Kind::Attr) {
        if (!contains(kMethods, callee->name)) {
          return syntaxError(e->pos, "method '" + callee->name + "' is not supported");
        }
      } else {
        return syntaxError(e->pos, "only functions, macros and methods can be called");
      }
    }
    if (e->kind == Expr::Kind::Filter) {
      // Test and filter names passed as string literals are checked now, not at render time.
      const bool by_attr = e->name == "selectattr" || e->name == "rejectattr";
      const std::size_t at = by_attr ? 2 : 1;
      const bool takes_test = by_attr || e->name == "select" || e->name == "reject";
      if ((takes_test || e->name == "map") && e->args.size() > at && e->args[at]->kind == Expr::Kind::Literal &&
          e->args[at]->literal.isString()) {
        const std::string& name = e->args[at]->literal.asString();
        if (takes_test && !contains(kTests, name)) {
          return syntaxError(e->pos, "test '" + name + "' is not supported");
        }
        if (!takes_test && !contains(kFilters, name)) {
          return syntaxError(e->pos, "filter '" + name + "' is not supported");
        }
      }
    }
    for (const auto& arg : e->args) PD_TRY(checkExpr(arg.get()));
    for (const auto& kw : e->kwargs) PD_TRY(checkExpr(kw.second.get()));
    return okStatus();
  }

  std::vector<Token> t_;
  std::size_t i_ = 0;
  int loop_depth_ = 0;
  int depth_ = 0;
  std::set<std::string> macros_;
};

}  // namespace

bool isSupportedTest(std::string_view name) {
  return contains(kTests, name);
}
bool isSupportedFilter(std::string_view name) {
  return contains(kFilters, name);
}

Result<Template> Template::parse(std::string_view source) {
  Lexer lexer(source);
  PD_ASSIGN_OR_RETURN(auto tokens, lexer.run());
  Parser parser(std::move(tokens));
  PD_ASSIGN_OR_RETURN(auto body, parser.run());
  return Template(std::move(body));
}

}  // namespace pd::chat::jinja
