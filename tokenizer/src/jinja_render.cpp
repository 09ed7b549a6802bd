// Evaluation of the Jinja subset with Python / jinja2 semantics (see jinja.h).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <functional>

#include "jinja.h"
#include "unicode_class.h"

namespace pd::chat::jinja {
namespace {

constexpr std::size_t kMaxOutputBytes = 64u << 20;
constexpr std::size_t kMaxIterations = 1'000'000;
constexpr int kMaxCallDepth = 64;

Error renderError(SourcePos pos, const std::string& message) {
  return makeError(ErrorCode::InvalidArgument,
                   "chat template " + std::to_string(pos.line) + ":" + std::to_string(pos.column) + ": " + message);
}

// Python str.isspace(): White_Space plus the information separators U+001C..U+001F.
bool isPySpace(std::string_view cp_utf8) {
  std::size_t pos = 0;
  const char32_t cp = pd::tokenizer::detail::decodeUtf8(cp_utf8, pos);
  return (cp >= 0x1C && cp <= 0x1F) ||
         (pd::tokenizer::detail::charClasses(cp) & pd::tokenizer::detail::kWhiteSpace) != 0;
}

std::string asciiLower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
std::string asciiUpper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// Python str.strip([chars]) on code points; which: 1 left, 2 right, 3 both.
std::string pyStrip(const std::string& s, const Value& chars, int which) {
  const auto cps = codePoints(s);
  std::vector<std::string_view> set;
  if (chars.isString()) set = codePoints(chars.asString());
  const auto strip_it = [&](std::string_view cp) {
    if (!chars.isString()) return isPySpace(cp);
    return std::find(set.begin(), set.end(), cp) != set.end();
  };
  std::size_t b = 0;
  std::size_t e = cps.size();
  if ((which & 1) != 0) {
    while (b < e && strip_it(cps[b])) ++b;
  }
  if ((which & 2) != 0) {
    while (e > b && strip_it(cps[e - 1])) --e;
  }
  if (b == e) return {};
  const char* start = cps[b].data();
  const char* end = cps[e - 1].data() + cps[e - 1].size();
  return std::string(start, end);
}

// Python str.split / rsplit.
ValueList pySplit(const std::string& s, const Value& sep, std::int64_t maxsplit, bool from_right) {
  ValueList out;
  if (!sep.isString()) {
    // Runs of whitespace separate; leading/trailing whitespace gives no empty items.
    const auto cps = codePoints(s);
    std::vector<std::pair<std::size_t, std::size_t>> words;  // code point ranges
    std::size_t k = 0;
    while (k < cps.size()) {
      while (k < cps.size() && isPySpace(cps[k])) ++k;
      if (k == cps.size()) break;
      std::size_t e = k;
      while (e < cps.size() && !isPySpace(cps[e])) ++e;
      words.emplace_back(k, e);
      k = e;
    }
    const auto text = [&](std::size_t from, std::size_t to) {
      const char* begin = cps[from].data();
      const char* end = cps[to - 1].data() + cps[to - 1].size();
      return std::string(begin, static_cast<std::size_t>(end - begin));
    };
    if (maxsplit < 0 || static_cast<std::size_t>(maxsplit) + 1 >= words.size()) {
      for (const auto& [b, e] : words) out.push_back(Value::string(text(b, e)));
      return out;
    }
    const auto splits = static_cast<std::size_t>(maxsplit);
    if (!from_right) {
      for (std::size_t w = 0; w < splits; ++w) out.push_back(Value::string(text(words[w].first, words[w].second)));
      // The unsplit remainder keeps its trailing whitespace, as in Python.
      out.push_back(Value::string(text(words[splits].first, cps.size())));
    } else {
      // rsplit: the remainder keeps its leading whitespace.
      const std::size_t first_kept = words.size() - splits;
      out.push_back(Value::string(text(0, words[first_kept - 1].second)));
      for (std::size_t w = first_kept; w < words.size(); ++w) {
        out.push_back(Value::string(text(words[w].first, words[w].second)));
      }
    }
    return out;
  }
  const std::string& d = sep.asString();
  std::vector<std::string> parts;
  if (!from_right) {
    std::size_t pos = 0;
    std::int64_t n = 0;
    while (maxsplit < 0 || n < maxsplit) {
      const std::size_t hit = s.find(d, pos);
      if (hit == std::string::npos) break;
      parts.push_back(s.substr(pos, hit - pos));
      pos = hit + d.size();
      ++n;
    }
    parts.push_back(s.substr(pos));
  } else {
    std::size_t end = s.size();
    std::int64_t n = 0;
    std::vector<std::string> rev;
    while (maxsplit < 0 || n < maxsplit) {
      if (end < d.size()) break;
      const std::size_t hit = s.rfind(d, end - d.size());
      if (hit == std::string::npos) break;
      rev.push_back(s.substr(hit + d.size(), end - hit - d.size()));
      end = hit;
      ++n;
    }
    rev.push_back(s.substr(0, end));
    parts.assign(rev.rbegin(), rev.rend());
  }
  for (auto& p : parts) out.push_back(Value::string(std::move(p)));
  return out;
}

std::string pyCapitalize(const std::string& s) {
  std::string out = asciiLower(s);
  if (!out.empty()) out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
  return out;
}

std::string pyTitle(const std::string& s) {
  std::string out = s;
  bool prev_cased = false;
  for (char& c : out) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isalpha(u) != 0) {
      c = static_cast<char>(prev_cased ? std::tolower(u) : std::toupper(u));
      prev_cased = true;
    } else {
      prev_cased = false;
    }
  }
  return out;
}

std::string replaceAll(const std::string& s, const std::string& from, const std::string& to, std::int64_t count) {
  if (from.empty()) {
    // Python inserts `to` between every code point (and at both ends).
    std::string out;
    std::int64_t n = 0;
    for (const auto cp : codePoints(s)) {
      if (count < 0 || n < count) {
        out += to;
        ++n;
      }
      out += cp;
    }
    if (count < 0 || n < count) out += to;
    return out;
  }
  std::string out;
  std::size_t pos = 0;
  std::int64_t n = 0;
  while (count < 0 || n < count) {
    const std::size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += to;
    pos = hit + from.size();
    ++n;
  }
  out.append(s, pos);
  return out;
}

// Python slice index normalization.
std::vector<std::size_t> sliceIndices(std::int64_t len, const Value& start_v, const Value& stop_v,
                                      const Value& step_v) {
  const std::int64_t step = step_v.isNumber() ? step_v.asInt() : 1;
  std::vector<std::size_t> out;
  if (step == 0) return out;
  const auto clamp = [&](const Value& v, std::int64_t def) {
    if (!v.isNumber()) return def;
    std::int64_t i = v.asInt();
    if (i < 0) i += len;
    if (step > 0) return std::clamp<std::int64_t>(i, 0, len);
    return std::clamp<std::int64_t>(i, -1, len - 1);
  };
  const std::int64_t start = clamp(start_v, step > 0 ? 0 : len - 1);
  const std::int64_t stop = clamp(stop_v, step > 0 ? len : -1);
  for (std::int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(static_cast<std::size_t>(i));
  return out;
}

}  // namespace

class Renderer {
 public:
  explicit Renderer(const Value& context) {
    scopes_.emplace_back();
    for (const auto& [k, v] : context.dictPtr()->items) scopes_[0].emplace_back(k, v);
    scopes_.emplace_back();  // template top level
  }

  enum class Flow { Normal, Break, Continue };

  Result<Flow> exec(const Body& body, std::string& out) {
    for (const Node& n : body) {
      PD_ASSIGN_OR_RETURN(auto flow, execNode(n, out));
      if (flow != Flow::Normal) return flow;
      if (out.size() > kMaxOutputBytes) return renderError(n.pos, "output exceeds 64 MiB");
    }
    return Flow::Normal;
  }

 private:
  using Scope = std::vector<std::pair<std::string, Value>>;

  const Value* lookup(std::string_view name) const {
    for (std::size_t k = scopes_.size(); k-- > floor_;) {
      for (auto it = scopes_[k].rbegin(); it != scopes_[k].rend(); ++it) {
        if (it->first == name) return &it->second;
      }
    }
    for (std::size_t k = std::min<std::size_t>(2, floor_); k-- > 0;) {
      for (const auto& [key, value] : scopes_[k]) {
        if (key == name) return &value;
      }
    }
    return nullptr;
  }

  void assign(const std::string& name, Value value) {
    for (auto& [key, v] : scopes_.back()) {
      if (key == name) {
        v = std::move(value);
        return;
      }
    }
    scopes_.back().emplace_back(name, std::move(value));
  }

  Result<Flow> execNode(const Node& n, std::string& out) {
    switch (n.kind) {
      case Node::Kind::Text:
        out += n.text;
        return Flow::Normal;
      case Node::Kind::Output: {
        PD_ASSIGN_OR_RETURN(auto v, eval(*n.expr));
        if (v.isCallable()) return renderError(n.pos, "cannot print a function");
        out += v.str();
        return Flow::Normal;
      }
      case Node::Kind::If: {
        for (const auto& [cond, branch] : n.branches) {
          bool take = cond == nullptr;
          if (!take) {
            PD_ASSIGN_OR_RETURN(auto v, eval(*cond));
            take = v.truthy();
          }
          if (take) return exec(branch, out);
        }
        return Flow::Normal;
      }
      case Node::Kind::For:
        return execFor(n, out);
      case Node::Kind::Set: {
        PD_ASSIGN_OR_RETURN(auto v, eval(*n.expr));
        if (!n.attr.empty()) {
          const Value* target = lookup(n.targets[0]);
          if (target == nullptr || !target->isNamespace()) {
            return renderError(n.pos, "cannot assign attribute on '" + n.targets[0] + "': not a namespace");
          }
          target->dictPtr()->set(n.attr, std::move(v));
          return Flow::Normal;
        }
        if (n.targets.size() == 1) {
          assign(n.targets[0], std::move(v));
          return Flow::Normal;
        }
        PD_ASSIGN_OR_RETURN(auto items, iterate(v, n.pos));
        if (items.size() != n.targets.size()) {
          return renderError(n.pos, "cannot unpack " + std::to_string(items.size()) + " values into " +
                                        std::to_string(n.targets.size()) + " names");
        }
        for (std::size_t k = 0; k < items.size(); ++k) assign(n.targets[k], items[k]);
        return Flow::Normal;
      }
      case Node::Kind::SetBlock: {
        std::string captured;
        PD_ASSIGN_OR_RETURN(auto flow, exec(n.body, captured));
        (void)flow;
        assign(n.targets[0], Value::string(std::move(captured)));
        return Flow::Normal;
      }
      case Node::Kind::Macro: {
        auto c = std::make_shared<Callable>();
        c->kind = Callable::Kind::Macro;
        c->macro = &n;
        assign(n.targets[0], Value::callable(std::move(c)));
        return Flow::Normal;
      }
      case Node::Kind::Break:
        return Flow::Break;
      case Node::Kind::Continue:
        return Flow::Continue;
      case Node::Kind::Block:
        return exec(n.body, out);
    }
    return Flow::Normal;
  }

  Result<ValueList> iterate(const Value& v, SourcePos pos) {
    switch (v.kind()) {
      case Value::Kind::Undefined:
        return ValueList{};
      case Value::Kind::List:
        return *v.listPtr();
      case Value::Kind::Dict: {
        ValueList keys;
        for (const auto& item : v.dictPtr()->items) keys.push_back(Value::string(item.first));
        return keys;
      }
      case Value::Kind::String: {
        ValueList chars;
        for (const auto cp : codePoints(v.asString())) chars.push_back(Value::string(std::string(cp)));
        return chars;
      }
      default:
        return renderError(pos, "'" + std::string(v.typeName()) + "' object is not iterable");
    }
  }

  Result<Flow> execFor(const Node& n, std::string& out) {
    PD_ASSIGN_OR_RETURN(auto seq_value, eval(*n.expr));
    PD_ASSIGN_OR_RETURN(auto all, iterate(seq_value, n.pos));
    const auto bind = [&](const Value& item) -> Status {
      if (n.targets.size() == 1) {
        assign(n.targets[0], item);
        return okStatus();
      }
      PD_ASSIGN_OR_RETURN(auto parts, iterate(item, n.pos));
      if (parts.size() != n.targets.size()) {
        return renderError(n.pos, "cannot unpack " + std::to_string(parts.size()) + " values into " +
                                      std::to_string(n.targets.size()) + " loop variables");
      }
      for (std::size_t k = 0; k < parts.size(); ++k) assign(n.targets[k], parts[k]);
      return okStatus();
    };
    ValueList items;
    if (n.condition != nullptr) {
      for (const auto& item : all) {
        scopes_.emplace_back();
        auto bound = bind(item);
        Result<Value> keep = bound.ok() ? eval(*n.condition) : Result<Value>(bound.error());
        scopes_.pop_back();
        if (!keep.ok()) return std::move(keep).error();
        if (keep.value().truthy()) items.push_back(item);
      }
    } else {
      items = std::move(all);
    }
    if (items.empty()) return exec(n.else_body, out);
    const auto length = static_cast<std::int64_t>(items.size());
    for (std::int64_t k = 0; k < length; ++k) {
      if (++iterations_ > kMaxIterations) return renderError(n.pos, "more than 1000000 loop iterations");
      scopes_.emplace_back();
      if (n.uses_loop) scopes_.back().emplace_back("loop", loopObject(items, k));
      Status bound = bind(items[static_cast<std::size_t>(k)]);
      Result<Flow> flow = bound.ok() ? exec(n.body, out) : Result<Flow>(bound.error());
      scopes_.pop_back();
      if (!flow.ok()) return std::move(flow).error();
      if (flow.value() == Flow::Break) break;
    }
    return Flow::Normal;
  }

  static Value loopObject(const ValueList& items, std::int64_t k) {
    const auto length = static_cast<std::int64_t>(items.size());
    auto loop = std::make_shared<ValueDict>();
    loop->set("index0", Value::integer(k));
    loop->set("index", Value::integer(k + 1));
    loop->set("revindex", Value::integer(length - k));
    loop->set("revindex0", Value::integer(length - k - 1));
    loop->set("first", Value::boolean(k == 0));
    loop->set("last", Value::boolean(k == length - 1));
    loop->set("length", Value::integer(length));
    loop->set("previtem", k > 0 ? items[static_cast<std::size_t>(k - 1)] : Value());
    loop->set("nextitem", k + 1 < length ? items[static_cast<std::size_t>(k + 1)] : Value());
    auto cycle = std::make_shared<Callable>();
    cycle->kind = Callable::Kind::LoopCycle;
    cycle->bound = Value::integer(k);
    loop->set("cycle", Value::callable(std::move(cycle)));
    return Value::dict(std::move(loop));
  }

  Result<Value> eval(const Expr& e) {
    switch (e.kind) {
      case Expr::Kind::Literal:
        return e.literal;
      case Expr::Kind::Name: {
        if (const Value* v = lookup(e.name)) return *v;
        return Value();
      }
      case Expr::Kind::ListLit: {
        ValueList items;
        for (const auto& a : e.args) {
          PD_ASSIGN_OR_RETURN(auto v, eval(*a));
          items.push_back(std::move(v));
        }
        return Value::list(std::move(items));
      }
      case Expr::Kind::DictLit: {
        auto d = std::make_shared<ValueDict>();
        for (std::size_t k = 0; k + 1 < e.args.size(); k += 2) {
          PD_ASSIGN_OR_RETURN(auto key, eval(*e.args[k]));
          PD_ASSIGN_OR_RETURN(auto value, eval(*e.args[k + 1]));
          if (!key.isString()) return renderError(e.pos, "dict keys must be strings in this Jinja subset");
          d->set(key.asString(), std::move(value));
        }
        return Value::dict(std::move(d));
      }
      case Expr::Kind::Attr: {
        PD_ASSIGN_OR_RETURN(auto obj, eval(*e.args[0]));
        return getAttr(obj, e.name, e.pos, *e.args[0]);
      }
      case Expr::Kind::Item: {
        PD_ASSIGN_OR_RETURN(auto obj, eval(*e.args[0]));
        PD_ASSIGN_OR_RETURN(auto key, eval(*e.args[1]));
        return getItem(obj, key, e.pos, *e.args[0]);
      }
      case Expr::Kind::Slice:
        return evalSlice(e);
      case Expr::Kind::Call:
        return evalCall(e);
      case Expr::Kind::Filter:
        return evalFilter(e);
      case Expr::Kind::Test: {
        PD_ASSIGN_OR_RETURN(auto r, evalTest(e));
        return Value::boolean(r != e.negated);
      }
      case Expr::Kind::Unary: {
        PD_ASSIGN_OR_RETURN(auto v, eval(*e.args[0]));
        if (e.name == "not") return Value::boolean(!v.truthy());
        if (v.kind() == Value::Kind::Float) return Value::real(e.name == "-" ? -v.asFloat() : v.asFloat());
        if (v.isNumber()) return Value::integer(e.name == "-" ? -v.asInt() : v.asInt());
        return renderError(e.pos, "bad operand type for unary " + e.name + ": '" + std::string(v.typeName()) + "'");
      }
      case Expr::Kind::And: {
        PD_ASSIGN_OR_RETURN(auto a, eval(*e.args[0]));
        if (!a.truthy()) return a;
        return eval(*e.args[1]);
      }
      case Expr::Kind::Or: {
        PD_ASSIGN_OR_RETURN(auto a, eval(*e.args[0]));
        if (a.truthy()) return a;
        return eval(*e.args[1]);
      }
      case Expr::Kind::Conditional: {
        PD_ASSIGN_OR_RETURN(auto cond, eval(*e.args[1]));
        if (cond.truthy()) return eval(*e.args[0]);
        if (e.args[2] == nullptr) return Value();
        return eval(*e.args[2]);
      }
      case Expr::Kind::Binary:
        return evalBinary(e);
    }
    return Value();
  }

  static std::string describe(const Expr& e) {
    if (e.kind == Expr::Kind::Name) return "'" + e.name + "'";
    if (e.kind == Expr::Kind::Attr) return describe(*e.args[0]) + "." + e.name;
    if (e.kind == Expr::Kind::Item && e.args[1]->kind == Expr::Kind::Literal) {
      return describe(*e.args[0]) + "[" + e.args[1]->literal.repr() + "]";
    }
    return "value";
  }

  Result<Value> getAttr(const Value& obj, const std::string& name, SourcePos pos, const Expr& subject) {
    switch (obj.kind()) {
      case Value::Kind::Undefined:
        return renderError(pos, describe(subject) + " is undefined");
      case Value::Kind::Dict:
      case Value::Kind::Namespace: {
        if (const Value* v = obj.dictPtr()->find(name)) return *v;
        return Value();
      }
      default:
        return Value();
    }
  }

  Result<Value> getItem(const Value& obj, const Value& key, SourcePos pos, const Expr& subject) {
    switch (obj.kind()) {
      case Value::Kind::Undefined:
        return renderError(pos, describe(subject) + " is undefined");
      case Value::Kind::Dict:
      case Value::Kind::Namespace: {
        if (!key.isString()) return Value();
        if (const Value* v = obj.dictPtr()->find(key.asString())) return *v;
        return Value();
      }
      case Value::Kind::List: {
        if (!key.isNumber() || key.kind() == Value::Kind::Float) return Value();
        std::int64_t i = key.asInt();
        const auto n = static_cast<std::int64_t>(obj.listPtr()->size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return Value();
        return (*obj.listPtr())[static_cast<std::size_t>(i)];
      }
      case Value::Kind::String: {
        if (!key.isNumber() || key.kind() == Value::Kind::Float) return Value();
        const auto cps = codePoints(obj.asString());
        std::int64_t i = key.asInt();
        const auto n = static_cast<std::int64_t>(cps.size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return Value();
        return Value::string(std::string(cps[static_cast<std::size_t>(i)]));
      }
      default:
        return Value();
    }
  }

  Result<Value> evalSlice(const Expr& e) {
    PD_ASSIGN_OR_RETURN(auto obj, eval(*e.args[0]));
    std::array<Value, 3> parts;
    for (std::size_t k = 0; k < 3; ++k) {
      if (e.args[k + 1] != nullptr) {
        PD_ASSIGN_OR_RETURN(parts[k], eval(*e.args[k + 1]));
      }
    }
    if (parts[2].isNumber() && parts[2].asInt() == 0) return renderError(e.pos, "slice step cannot be zero");
    if (obj.isList()) {
      const auto& items = *obj.listPtr();
      ValueList out;
      for (const auto i : sliceIndices(static_cast<std::int64_t>(items.size()), parts[0], parts[1], parts[2])) {
        out.push_back(items[i]);
      }
      return Value::list(std::move(out));
    }
    if (obj.isString()) {
      const auto cps = codePoints(obj.asString());
      std::string out;
      for (const auto i : sliceIndices(static_cast<std::int64_t>(cps.size()), parts[0], parts[1], parts[2])) {
        out += cps[i];
      }
      return Value::string(std::move(out));
    }
    if (obj.isUndefined()) return renderError(e.pos, describe(*e.args[0]) + " is undefined");
    return renderError(e.pos, "'" + std::string(obj.typeName()) + "' object cannot be sliced");
  }

  Result<Value> evalBinary(const Expr& e) {
    PD_ASSIGN_OR_RETURN(auto a, eval(*e.args[0]));
    PD_ASSIGN_OR_RETURN(auto b, eval(*e.args[1]));
    const std::string& op = e.name;
    const auto type_error = [&]() {
      return renderError(e.pos, "unsupported operand types for " + op + ": '" + std::string(a.typeName()) + "' and '" +
                                    std::string(b.typeName()) + "'");
    };
    if (op == "~") return Value::string(a.str() + b.str());
    if (op == "==") return Value::boolean(a.equals(b));
    if (op == "!=") return Value::boolean(!a.equals(b));
    if (op == "in" || op == "not in") {
      PD_ASSIGN_OR_RETURN(auto found, contains(b, a, e.pos));
      return Value::boolean(found == (op == "in"));
    }
    if ((a.isUndefined() || b.isUndefined())) {
      return renderError(e.pos, (a.isUndefined() ? describe(*e.args[0]) : describe(*e.args[1])) + " is undefined");
    }
    if (op == "<" || op == "<=" || op == ">" || op == ">=") {
      int cmp = 0;
      if (a.isNumber() && b.isNumber()) {
        cmp = a.asFloat() < b.asFloat() ? -1 : a.asFloat() > b.asFloat() ? 1 : 0;
        if (a.kind() != Value::Kind::Float && b.kind() != Value::Kind::Float) {
          cmp = a.asInt() < b.asInt() ? -1 : a.asInt() > b.asInt() ? 1 : 0;
        }
      } else if (a.isString() && b.isString()) {
        cmp = a.asString().compare(b.asString());
      } else {
        return type_error();
      }
      if (op == "<") return Value::boolean(cmp < 0);
      if (op == "<=") return Value::boolean(cmp <= 0);
      if (op == ">") return Value::boolean(cmp > 0);
      return Value::boolean(cmp >= 0);
    }
    if (op == "+") {
      if (a.isString() && b.isString()) return Value::string(a.asString() + b.asString());
      if (a.isList() && b.isList()) {
        ValueList items = *a.listPtr();
        items.insert(items.end(), b.listPtr()->begin(), b.listPtr()->end());
        return Value::list(std::move(items));
      }
    }
    if (op == "*") {
      const Value* text = a.isString() ? &a : b.isString() ? &b : nullptr;
      const Value* count = a.isString() ? &b : &a;
      if (text != nullptr && count->isNumber() && count->kind() != Value::Kind::Float) {
        std::string out;
        for (std::int64_t k = 0; k < count->asInt(); ++k) {
          out += text->asString();
          if (out.size() > kMaxOutputBytes) return renderError(e.pos, "string too long");
        }
        return Value::string(std::move(out));
      }
    }
    if (!a.isNumber() || !b.isNumber()) return type_error();
    const bool real = a.kind() == Value::Kind::Float || b.kind() == Value::Kind::Float;
    if (op == "/") {
      if (b.asFloat() == 0) return renderError(e.pos, "division by zero");
      return Value::real(a.asFloat() / b.asFloat());
    }
    if (op == "//" || op == "%") {
      if (b.asFloat() == 0) return renderError(e.pos, "division by zero");
      if (real) {
        const double q = std::floor(a.asFloat() / b.asFloat());
        return op == "//" ? Value::real(q) : Value::real(a.asFloat() - q * b.asFloat());
      }
      std::int64_t q = a.asInt() / b.asInt();
      std::int64_t r = a.asInt() % b.asInt();
      if (r != 0 && ((r < 0) != (b.asInt() < 0))) {
        --q;
        r += b.asInt();
      }
      return op == "//" ? Value::integer(q) : Value::integer(r);
    }
    if (op == "**") {
      if (!real && b.asInt() >= 0) {
        std::int64_t r = 1;
        for (std::int64_t k = 0; k < b.asInt() && k < 64; ++k) r *= a.asInt();
        return Value::integer(r);
      }
      return Value::real(std::pow(a.asFloat(), b.asFloat()));
    }
    if (real) {
      if (op == "+") return Value::real(a.asFloat() + b.asFloat());
      if (op == "-") return Value::real(a.asFloat() - b.asFloat());
      if (op == "*") return Value::real(a.asFloat() * b.asFloat());
    } else {
      if (op == "+") return Value::integer(a.asInt() + b.asInt());
      if (op == "-") return Value::integer(a.asInt() - b.asInt());
      if (op == "*") return Value::integer(a.asInt() * b.asInt());
    }
    return type_error();
  }

  Result<bool> contains(const Value& container, const Value& item, SourcePos pos) {
    switch (container.kind()) {
      case Value::Kind::Undefined:
        return false;
      case Value::Kind::String:
        if (!item.isString()) return renderError(pos, "'in <string>' requires a string as left operand");
        return container.asString().find(item.asString()) != std::string::npos;
      case Value::Kind::List:
        return std::any_of(container.listPtr()->begin(), container.listPtr()->end(),
                           [&](const Value& v) { return v.equals(item); });
      case Value::Kind::Dict:
      case Value::Kind::Namespace:
        return item.isString() && container.dictPtr()->find(item.asString()) != nullptr;
      default:
        return renderError(pos, "argument of type '" + std::string(container.typeName()) + "' is not iterable");
    }
  }

  struct Args {
    std::vector<Value> positional;
    std::vector<std::pair<std::string, Value>> named;
    // Python-style parameter binding: positional index or keyword.
    [[nodiscard]] const Value* get(std::size_t index, std::string_view name) const {
      if (index < positional.size()) return &positional[index];
      for (const auto& [k, v] : named) {
        if (k == name) return &v;
      }
      return nullptr;
    }
    [[nodiscard]] Value value(std::size_t index, std::string_view name, const Value& def = Value()) const {
      const Value* v = get(index, name);
      return v != nullptr ? *v : def;
    }
  };

  Result<Args> evalArgs(const Expr& e) {
    Args args;
    for (std::size_t k = 1; k < e.args.size(); ++k) {
      PD_ASSIGN_OR_RETURN(auto v, eval(*e.args[k]));
      args.positional.push_back(std::move(v));
    }
    for (const auto& [name, expr] : e.kwargs) {
      PD_ASSIGN_OR_RETURN(auto v, eval(*expr));
      args.named.emplace_back(name, std::move(v));
    }
    return args;
  }

  Result<Value> evalCall(const Expr& e) {
    const Expr& callee = *e.args[0];
    PD_ASSIGN_OR_RETURN(auto args, evalArgs(e));
    if (callee.kind == Expr::Kind::Attr) {
      PD_ASSIGN_OR_RETURN(auto obj, eval(*callee.args[0]));
      if (obj.isDict() || obj.isNamespace()) {
        if (const Value* member = obj.dictPtr()->find(callee.name); member != nullptr && member->isCallable()) {
          return callValue(*member, args, e.pos);
        }
      }
      return callMethod(obj, callee.name, args, e.pos, *callee.args[0]);
    }
    if (const Value* v = lookup(callee.name); v != nullptr && v->isCallable()) return callValue(*v, args, e.pos);
    auto c = std::make_shared<Callable>();
    if (callee.name == "namespace")
      c->kind = Callable::Kind::Namespace;
    else if (callee.name == "range")
      c->kind = Callable::Kind::Range;
    else if (callee.name == "raise_exception")
      c->kind = Callable::Kind::RaiseException;
    else if (callee.name == "strftime_now")
      c->kind = Callable::Kind::StrftimeNow;
    else if (callee.name == "dict")
      c->kind = Callable::Kind::Dict;
    else
      return renderError(e.pos, "'" + callee.name + "' is not callable");
    return callValue(Value::callable(std::move(c)), args, e.pos);
  }

  Result<Value> callValue(const Value& fn, const Args& args, SourcePos pos) {
    const Callable& c = *fn.callablePtr();
    switch (c.kind) {
      case Callable::Kind::Namespace:
      case Callable::Kind::Dict: {
        auto d = std::make_shared<ValueDict>();
        for (const auto& p : args.positional) {
          if (!p.isDict()) return renderError(pos, "namespace()/dict() take keyword arguments or a dict");
          for (const auto& [k, v] : p.dictPtr()->items) d->set(k, v);
        }
        for (const auto& [k, v] : args.named) d->set(k, v);
        return c.kind == Callable::Kind::Namespace ? Value::ns(std::move(d)) : Value::dict(std::move(d));
      }
      case Callable::Kind::Range: {
        std::int64_t start = 0;
        std::int64_t stop = 0;
        std::int64_t step = 1;
        for (const auto& p : args.positional) {
          if (!p.isNumber()) return renderError(pos, "range() takes integers");
        }
        if (args.positional.size() == 1) {
          stop = args.positional[0].asInt();
        } else if (args.positional.size() >= 2) {
          start = args.positional[0].asInt();
          stop = args.positional[1].asInt();
          if (args.positional.size() >= 3) step = args.positional[2].asInt();
        } else {
          return renderError(pos, "range() needs 1 to 3 arguments");
        }
        if (step == 0) return renderError(pos, "range() step cannot be zero");
        ValueList items;
        for (std::int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
          if (items.size() >= 100'000) return renderError(pos, "range() longer than 100000");
          items.push_back(Value::integer(i));
        }
        return Value::list(std::move(items));
      }
      case Callable::Kind::RaiseException: {
        const Value msg = args.value(0, "message");
        return renderError(pos, "template raised an error: " + msg.str());
      }
      case Callable::Kind::StrftimeNow: {
        const Value fmt = args.value(0, "format");
        if (!fmt.isString()) return renderError(pos, "strftime_now() needs a format string");
        const std::time_t now = std::time(nullptr);
        std::tm local{};
        localtime_r(&now, &local);
        char buf[256];
        const std::size_t n = std::strftime(buf, sizeof buf, fmt.asString().c_str(), &local);
        return Value::string(std::string(buf, n));
      }
      case Callable::Kind::LoopCycle: {
        if (args.positional.empty()) return renderError(pos, "loop.cycle() needs arguments");
        const auto k = static_cast<std::size_t>(c.bound.asInt());
        return args.positional[k % args.positional.size()];
      }
      case Callable::Kind::Macro:
        return callMacro(*c.macro, args, pos);
    }
    return Value();
  }

  Result<Value> callMacro(const Node& macro, const Args& args, SourcePos pos) {
    if (call_depth_ >= kMaxCallDepth) return renderError(pos, "macro calls nested too deeply");
    if (args.positional.size() > macro.params.size()) {
      return renderError(
          pos, "macro '" + macro.targets[0] + "' takes " + std::to_string(macro.params.size()) + " arguments");
    }
    Scope scope;
    for (std::size_t k = 0; k < macro.params.size(); ++k) {
      const auto& [name, def] = macro.params[k];
      if (const Value* v = args.get(k, name)) {
        scope.emplace_back(name, *v);
      } else if (def != nullptr) {
        PD_ASSIGN_OR_RETURN(auto dv, eval(*def));
        scope.emplace_back(name, std::move(dv));
      } else {
        scope.emplace_back(name, Value());
      }
    }
    // A macro sees the globals, the template's top level and its own parameters.
    const std::size_t saved_floor = floor_;
    scopes_.push_back(std::move(scope));
    floor_ = scopes_.size() - 1;
    ++call_depth_;
    std::string out;
    auto flow = exec(macro.body, out);
    --call_depth_;
    floor_ = saved_floor;
    scopes_.pop_back();
    if (!flow.ok()) return std::move(flow).error();
    return Value::string(std::move(out));
  }

  Result<Value> callMethod(const Value& obj, const std::string& name, const Args& args, SourcePos pos,
                           const Expr& subject) {
    const auto no_method = [&]() {
      // fmt, not operator+: GCC 12 at -O3 reports a false -Wrestrict on this concatenation.
      return renderError(pos, fmt::format("'{}' object has no method '{}'", obj.typeName(), name));
    };
    if (obj.isUndefined()) return renderError(pos, describe(subject) + " is undefined");
    if (obj.isString()) {
      const std::string& s = obj.asString();
      if (name == "strip") return Value::string(pyStrip(s, args.value(0, "chars"), 3));
      if (name == "lstrip") return Value::string(pyStrip(s, args.value(0, "chars"), 1));
      if (name == "rstrip") return Value::string(pyStrip(s, args.value(0, "chars"), 2));
      if (name == "split" || name == "rsplit") {
        const Value sep = args.value(0, "sep", Value::none());
        const Value max = args.value(1, "maxsplit", Value::integer(-1));
        if (sep.isString() && sep.asString().empty()) return renderError(pos, "empty separator");
        return Value::list(pySplit(s, sep, max.isNumber() ? max.asInt() : -1, name == "rsplit"));
      }
      if (name == "startswith" || name == "endswith") {
        const Value arg = args.value(0, "prefix");
        ValueList options = arg.isList() ? *arg.listPtr() : ValueList{arg};
        for (const auto& o : options) {
          if (!o.isString()) return renderError(pos, name + "() takes a string or a tuple of strings");
          if (name == "startswith" ? s.starts_with(o.asString()) : s.ends_with(o.asString()))
            return Value::boolean(true);
        }
        return Value::boolean(false);
      }
      if (name == "replace") {
        const Value from = args.value(0, "old");
        const Value to = args.value(1, "new");
        const Value count = args.value(2, "count", Value::integer(-1));
        if (!from.isString() || !to.isString()) return renderError(pos, "replace() takes strings");
        return Value::string(replaceAll(s, from.asString(), to.asString(), count.isNumber() ? count.asInt() : -1));
      }
      if (name == "lower") return Value::string(asciiLower(s));
      if (name == "upper") return Value::string(asciiUpper(s));
      if (name == "title") return Value::string(pyTitle(s));
      if (name == "capitalize") return Value::string(pyCapitalize(s));
      if (name == "find") {
        const Value sub = args.value(0, "sub");
        if (!sub.isString()) return renderError(pos, "find() takes a string");
        const std::size_t hit = s.find(sub.asString());
        if (hit == std::string::npos) return Value::integer(-1);
        return Value::integer(static_cast<std::int64_t>(codePoints(s.substr(0, hit)).size()));
      }
      if (name == "count") {
        const Value sub = args.value(0, "sub");
        if (!sub.isString()) return renderError(pos, "count() takes a string");
        if (sub.asString().empty()) return Value::integer(static_cast<std::int64_t>(codePoints(s).size()) + 1);
        std::int64_t n = 0;
        for (std::size_t p = s.find(sub.asString()); p != std::string::npos;
             p = s.find(sub.asString(), p + sub.asString().size()))
          ++n;
        return Value::integer(n);
      }
      if (name == "join") {
        PD_ASSIGN_OR_RETURN(auto items, iterate(args.value(0, "iterable"), pos));
        std::string out;
        for (std::size_t k = 0; k < items.size(); ++k) {
          if (!items[k].isString()) return renderError(pos, "join() expects strings");
          if (k > 0) out += s;
          out += items[k].asString();
        }
        return Value::string(std::move(out));
      }
      return no_method();
    }
    if (obj.isDict()) {
      const ValueDict& d = *obj.dictPtr();
      if (name == "get") {
        const Value key = args.value(0, "key");
        const Value* v = key.isString() ? d.find(key.asString()) : nullptr;
        return v != nullptr ? *v : args.value(1, "default", Value::none());
      }
      if (name == "items" || name == "keys" || name == "values") {
        ValueList out;
        for (const auto& [k, v] : d.items) {
          if (name == "items")
            out.push_back(Value::list({Value::string(k), v}));
          else if (name == "keys")
            out.push_back(Value::string(k));
          else
            out.push_back(v);
        }
        return Value::list(std::move(out));
      }
      return no_method();
    }
    if (obj.isList()) {
      if (name == "append") {
        obj.listPtr()->push_back(args.value(0, "object"));
        return Value::none();
      }
      if (name == "count") {
        const Value item = args.value(0, "value");
        return Value::integer(std::count_if(obj.listPtr()->begin(), obj.listPtr()->end(),
                                            [&](const Value& v) { return v.equals(item); }));
      }
      return no_method();
    }
    return no_method();
  }

  Result<bool> applyTest(const std::string& name, const Value& v, const std::vector<Value>& args, SourcePos pos) {
    const Value arg = args.empty() ? Value() : args[0];
    if (name == "defined") return !v.isUndefined();
    if (name == "undefined") return v.isUndefined();
    if (name == "none") return v.isNone();
    if (name == "boolean") return v.kind() == Value::Kind::Bool;
    if (name == "true") return v.kind() == Value::Kind::Bool && v.asBool();
    if (name == "false") return v.kind() == Value::Kind::Bool && !v.asBool();
    if (name == "integer") return v.kind() == Value::Kind::Int;
    if (name == "float") return v.kind() == Value::Kind::Float;
    if (name == "number") return v.isNumber();
    if (name == "string") return v.isString();
    if (name == "mapping") return v.isDict();
    if (name == "iterable") return v.isList() || v.isDict() || v.isString() || v.isUndefined();
    if (name == "sequence") return v.isList() || v.isDict() || v.isString();
    if (name == "callable") return v.isCallable();
    if (name == "even" || name == "odd") {
      if (!v.isNumber()) return renderError(pos, "'" + name + "' test needs a number");
      return (v.asInt() % 2 == 0) == (name == "even");
    }
    if (name == "divisibleby") {
      if (!v.isNumber() || !arg.isNumber() || arg.asInt() == 0) return renderError(pos, "bad divisibleby test");
      return v.asInt() % arg.asInt() == 0;
    }
    if (name == "eq" || name == "equalto" || name == "==") return v.equals(arg);
    if (name == "ne" || name == "!=") return !v.equals(arg);
    if (name == "sameas") return v.equals(arg) && v.kind() == arg.kind();
    if (name == "in") return contains(arg, v, pos);
    if (name == "lower") return v.isString() && asciiLower(v.asString()) == v.asString();
    if (name == "upper") return v.isString() && asciiUpper(v.asString()) == v.asString();
    // Ordering tests.
    Expr cmp;
    cmp.kind = Expr::Kind::Binary;
    cmp.pos = pos;
    cmp.name = name == "lt" ? "<" : name == "le" ? "<=" : name == "gt" ? ">" : name == "ge" ? ">=" : name;
    auto left = std::make_unique<Expr>();
    left->literal = v;
    auto right = std::make_unique<Expr>();
    right->literal = arg;
    cmp.args.push_back(std::move(left));
    cmp.args.push_back(std::move(right));
    PD_ASSIGN_OR_RETURN(auto r, evalBinary(cmp));
    return r.truthy();
  }

  Result<bool> evalTest(const Expr& e) {
    PD_ASSIGN_OR_RETURN(auto v, eval(*e.args[0]));
    PD_ASSIGN_OR_RETURN(auto args, evalArgs(e));
    return applyTest(e.name, v, args.positional, e.pos);
  }

  Result<Value> applyFilter(const std::string& name, const Value& v, const Args& args, SourcePos pos) {
    const auto need = [&](bool ok, const char* what) -> Status {
      if (ok) return okStatus();
      return renderError(pos, "filter '" + name + "' needs " + what + ", got '" + std::string(v.typeName()) + "'");
    };
    if (name == "safe" || name == "string") return name == "safe" ? v : Value::string(v.str());
    if (name == "length" || name == "count") {
      if (v.isString()) return Value::integer(static_cast<std::int64_t>(codePoints(v.asString()).size()));
      if (v.isList()) return Value::integer(static_cast<std::int64_t>(v.listPtr()->size()));
      if (v.isDict() || v.isNamespace()) return Value::integer(static_cast<std::int64_t>(v.dictPtr()->items.size()));
      if (v.isUndefined()) return Value::integer(0);
      return renderError(pos, "object of type '" + std::string(v.typeName()) + "' has no length");
    }
    if (name == "default" || name == "d") {
      const bool boolean = args.value(1, "boolean", Value::boolean(false)).truthy();
      if (v.isUndefined() || (boolean && !v.truthy())) return args.value(0, "default_value", Value::string(""));
      return v;
    }
    if (name == "trim") {
      PD_TRY(need(v.isString(), "a string"));
      return Value::string(pyStrip(v.asString(), args.value(0, "chars"), 3));
    }
    if (name == "lower" || name == "upper" || name == "capitalize" || name == "title") {
      const std::string s = v.str();
      if (name == "lower") return Value::string(asciiLower(s));
      if (name == "upper") return Value::string(asciiUpper(s));
      if (name == "title") return Value::string(pyTitle(s));
      return Value::string(pyCapitalize(s));
    }
    if (name == "replace") {
      const Value from = args.value(0, "old");
      const Value to = args.value(1, "new");
      const Value count = args.value(2, "count", Value::integer(-1));
      if (!from.isString() || !to.isString()) return renderError(pos, "replace needs strings");
      return Value::string(replaceAll(v.str(), from.asString(), to.asString(), count.isNumber() ? count.asInt() : -1));
    }
    if (name == "join") {
      PD_ASSIGN_OR_RETURN(auto items, iterate(v, pos));
      const Value sep = args.value(0, "d", Value::string(""));
      const Value attribute = args.value(1, "attribute");
      std::string out;
      for (std::size_t k = 0; k < items.size(); ++k) {
        if (k > 0) out += sep.str();
        Value item = items[k];
        if (attribute.isString()) {
          PD_ASSIGN_OR_RETURN(item, attributeOf(item, attribute.asString(), pos));
        }
        out += item.str();
      }
      return Value::string(std::move(out));
    }
    if (name == "first" || name == "last") {
      PD_ASSIGN_OR_RETURN(auto items, iterate(v, pos));
      if (items.empty()) return Value();
      return name == "first" ? items.front() : items.back();
    }
    if (name == "list") {
      PD_ASSIGN_OR_RETURN(auto items, iterate(v, pos));
      return Value::list(std::move(items));
    }
    if (name == "reverse") {
      if (v.isString()) {
        auto cps = codePoints(v.asString());
        std::string out;
        for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
        return Value::string(std::move(out));
      }
      PD_ASSIGN_OR_RETURN(auto items, iterate(v, pos));
      std::reverse(items.begin(), items.end());
      return Value::list(std::move(items));
    }
    if (name == "items") {
      if (v.isUndefined()) return Value::list({});
      PD_TRY(need(v.isDict(), "a mapping"));
      ValueList out;
      for (const auto& [k, x] : v.dictPtr()->items) out.push_back(Value::list({Value::string(k), x}));
      return Value::list(std::move(out));
    }
    if (name == "tojson") {
      const Value indent = args.value(0, "indent", Value::none());
      const bool sort_keys = args.value(99, "sort_keys", Value::boolean(false)).truthy();
      const bool ensure_ascii = args.value(99, "ensure_ascii", Value::boolean(false)).truthy();
      std::string out;
      if (!toJson(v, indent.isNumber() ? static_cast<int>(indent.asInt()) : -1, sort_keys, out)) {
        return renderError(pos, "tojson: value of type '" + std::string(v.typeName()) + "' is not JSON serializable");
      }
      if (ensure_ascii) {
        std::string ascii;
        std::size_t p = 0;
        while (p < out.size()) {
          if (static_cast<unsigned char>(out[p]) < 0x80) {
            ascii.push_back(out[p++]);
            continue;
          }
          char32_t cp = pd::tokenizer::detail::decodeUtf8(out, p);
          char buf[16];
          const auto put = [&](unsigned u) {
            std::snprintf(buf, sizeof buf, "\\u%04x", u);
            ascii += buf;
          };
          if (cp >= 0x10000) {
            cp -= 0x10000;
            put(0xD800 + (cp >> 10));
            put(0xDC00 + (cp & 0x3FF));
          } else {
            put(cp);
          }
        }
        out = std::move(ascii);
      }
      return Value::string(std::move(out));
    }
    if (name == "int") {
      if (v.isNumber())
        return Value::integer(v.kind() == Value::Kind::Float ? static_cast<std::int64_t>(v.asFloat()) : v.asInt());
      if (v.isString()) {
        try {
          std::size_t used = 0;
          const std::string t = pyStrip(v.asString(), Value(), 3);
          const auto i = std::stoll(t, &used);
          if (used == t.size()) return Value::integer(i);
        } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): not an integer: the default below
        }
      }
      return args.value(0, "default", Value::integer(0));
    }
    if (name == "float") {
      if (v.isNumber()) return Value::real(v.asFloat());
      if (v.isString()) {
        try {
          std::size_t used = 0;
          const std::string t = pyStrip(v.asString(), Value(), 3);
          const double d = std::stod(t, &used);
          if (used == t.size()) return Value::real(d);
        } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): not a number: the default below
        }
      }
      return args.value(0, "default", Value::real(0.0));
    }
    if (name == "abs") {
      PD_TRY(need(v.isNumber(), "a number"));
      return v.kind() == Value::Kind::Float ? Value::real(std::fabs(v.asFloat()))
                                            : Value::integer(std::llabs(v.asInt()));
    }
    if (name == "round") {
      PD_TRY(need(v.isNumber(), "a number"));
      const Value precision = args.value(0, "precision", Value::integer(0));
      const Value method = args.value(1, "method", Value::string("common"));
      const double scale = std::pow(10.0, static_cast<double>(precision.asInt()));
      const double x = v.asFloat() * scale;
      double r = std::round(x);
      if (method.isString() && method.asString() == "floor") r = std::floor(x);
      if (method.isString() && method.asString() == "ceil") r = std::ceil(x);
      return Value::real(r / scale);
    }
    if (name == "unique") {
      PD_ASSIGN_OR_RETURN(auto items, iterate(v, pos));
      ValueList out;
      for (const auto& item : items) {
        if (std::none_of(out.begin(), out.end(), [&](const Value& o) { return o.equals(item); })) out.push_back(item);
      }
      return Value::list(std::move(out));
    }
    if (name == "sort") {
      PD_ASSIGN_OR_RETURN(auto items, iterate(v, pos));
      const bool reverse = args.value(0, "reverse", Value::boolean(false)).truthy();
      const bool case_sensitive = args.value(1, "case_sensitive", Value::boolean(false)).truthy();
      const Value attribute = args.value(2, "attribute");
      std::vector<std::pair<Value, Value>> keyed;
      for (const auto& item : items) {
        Value key = item;
        if (attribute.isString()) {
          PD_ASSIGN_OR_RETURN(key, attributeOf(item, attribute.asString(), pos));
        }
        if (!(key.isNumber() || key.isString()))
          return renderError(pos, "sort: cannot order '" + std::string(key.typeName()) + "'");
        if (key.isString() && !case_sensitive) key = Value::string(asciiLower(key.asString()));
        keyed.emplace_back(key, item);
      }
      std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
        bool less = false;
        if (a.first.isNumber() && b.first.isNumber())
          less = a.first.asFloat() < b.first.asFloat();
        else if (a.first.isString() && b.first.isString())
          less = a.first.asString() < b.first.asString();
        else
          less = a.first.isNumber();
        return less;
      });
      if (reverse) std::reverse(keyed.begin(), keyed.end());
      ValueList out;
      for (auto& kv : keyed) out.push_back(std::move(kv.second));
      return Value::list(std::move(out));
    }
    if (name == "map") {
      PD_ASSIGN_OR_RETURN(auto items, iterate(v, pos));
      ValueList out;
      const Value attribute = args.value(99, "attribute");
      for (const auto& item : items) {
        if (attribute.isString()) {
          PD_ASSIGN_OR_RETURN(auto x, attributeOf(item, attribute.asString(), pos));
          if (x.isUndefined()) x = args.value(99, "default");
          out.push_back(std::move(x));
        } else {
          if (args.positional.empty() || !args.positional[0].isString())
            return renderError(pos, "map needs a filter name or attribute=");
          Args rest;
          rest.positional.assign(args.positional.begin() + 1, args.positional.end());
          PD_ASSIGN_OR_RETURN(auto x, applyFilter(args.positional[0].asString(), item, rest, pos));
          out.push_back(std::move(x));
        }
      }
      return Value::list(std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      PD_ASSIGN_OR_RETURN(auto items, iterate(v, pos));
      const bool by_attr = name == "selectattr" || name == "rejectattr";
      const bool keep_if = name == "select" || name == "selectattr";
      const std::size_t test_at = by_attr ? 1 : 0;
      ValueList out;
      for (const auto& item : items) {
        Value subject = item;
        if (by_attr) {
          if (args.positional.empty() || !args.positional[0].isString())
            return renderError(pos, name + " needs an attribute name");
          PD_ASSIGN_OR_RETURN(subject, attributeOf(item, args.positional[0].asString(), pos));
        }
        bool pass = false;
        if (args.positional.size() > test_at) {
          if (!args.positional[test_at].isString()) return renderError(pos, name + " needs a test name");
          const std::string test = args.positional[test_at].asString();
          if (!isSupportedTest(test)) return renderError(pos, "test '" + test + "' is not supported");
          std::vector<Value> test_args(args.positional.begin() + static_cast<std::ptrdiff_t>(test_at) + 1,
                                       args.positional.end());
          PD_ASSIGN_OR_RETURN(pass, applyTest(test, subject, test_args, pos));
        } else {
          pass = subject.truthy();
        }
        if (pass == keep_if) out.push_back(item);
      }
      return Value::list(std::move(out));
    }
    return renderError(pos, "filter '" + name + "' is not supported");
  }

  Result<Value> attributeOf(const Value& item, const std::string& path, SourcePos pos) {
    Value cur = item;
    std::size_t start = 0;
    while (start <= path.size()) {
      const std::size_t dot = path.find('.', start);
      const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      if (cur.isUndefined()) return Value();
      Value key = Value::string(part);
      if (!part.empty() && std::all_of(part.begin(), part.end(),
                                       [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; })) {
        key = Value::integer(std::stoll(part));
      }
      Expr dummy;
      PD_ASSIGN_OR_RETURN(cur, getItem(cur, key, pos, dummy));
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    return cur;
  }

  Result<Value> evalFilter(const Expr& e) {
    PD_ASSIGN_OR_RETURN(auto v, eval(*e.args[0]));
    PD_ASSIGN_OR_RETURN(auto args, evalArgs(e));
    return applyFilter(e.name, v, args, e.pos);
  }

  std::vector<Scope> scopes_;
  std::size_t floor_ = 2;  // lookups search scopes_[floor_..] then the top level and globals
  std::size_t iterations_ = 0;
  int call_depth_ = 0;
};

Result<std::string> Template::render(const Value& context) const {
  if (!context.isDict()) return makeError(ErrorCode::InvalidArgument, "chat template context must be a dict");
  Renderer renderer(context);
  std::string out;
  PD_ASSIGN_OR_RETURN(auto flow, renderer.exec(*body_, out));
  (void)flow;
  return out;
}

}  // namespace pd::chat::jinja
