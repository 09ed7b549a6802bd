#include "schema_compiler.h"

#include <algorithm>
#include <array>
#include <boost/json.hpp>
#include <functional>
#include <string>
#include <string_view>
#include <utility>

namespace pd::structured::detail {
namespace {

namespace json = boost::json;

constexpr std::uint32_t kNoNode = UINT32_MAX;

// Keywords that describe and never constrain: accepted and ignored.
constexpr std::array<std::string_view, 12> kAnnotations = {"title",    "description", "default",  "examples",
                                                           "$schema",  "$id",         "$comment", "deprecated",
                                                           "readOnly", "writeOnly",   "$defs",    "definitions"};
// Keywords this compiler honours.
constexpr std::array<std::string_view, 14> kConstraints = {
    "type",      "properties", "required", "additionalProperties",
    "items",     "minItems",   "maxItems", "minLength",
    "maxLength", "pattern",    "enum",     "const",
    "anyOf",     "$ref"};

template <std::size_t N>
bool contains(const std::array<std::string_view, N>& set, std::string_view key) {
  return std::find(set.begin(), set.end(), key) != set.end();
}

Error unsupported(const std::string& path, const std::string& what) {
  return makeError(ErrorCode::Unsupported,
                   "response schema " + path + ": " + what + " is not supported (docs/structured-outputs.md)");
}
Error invalid(const std::string& path, const std::string& what) {
  return makeError(ErrorCode::InvalidArgument, "response schema " + path + ": " + what);
}

bool typeMatches(const json::value& v, std::string_view type) {
  if (type == "object") return v.is_object();
  if (type == "array") return v.is_array();
  if (type == "string") return v.is_string();
  if (type == "number") return v.is_number();
  if (type == "integer") {
    if (v.is_int64() || v.is_uint64()) return true;
    return v.is_double() && v.as_double() == static_cast<double>(static_cast<std::int64_t>(v.as_double()));
  }
  if (type == "boolean") return v.is_bool();
  if (type == "null") return v.is_null();
  return false;
}

class SchemaCompiler {
 public:
  SchemaCompiler(const json::value* root, const GrammarOptions& options)
      : root_(root), string_cap_(options.unbounded_string_chars == 0 ? kUnbounded : options.unbounded_string_chars) {
    Node ws;
    ws.kind = NodeKind::Whitespace;
    ws.max = options.max_whitespace;
    ws.nullable = true;
    a_.whitespace = add(std::move(ws));
  }

  Result<Automaton> finish(std::uint32_t value) {
    a_.root = seq({a_.whitespace, value, a_.whitespace});
    computeNullable();
    std::vector<std::uint32_t> memo(a_.nodes.size(), kNoNode);
    if (depth(a_.root, memo) > kGuardDepth) {
      return unsupported("#", "nesting deeper than " + std::to_string(kGuardDepth / 2) + " levels");
    }
    return std::move(a_);
  }

  Result<std::uint32_t> compile(const json::value& schema, const std::string& path) {
    if (schema.is_bool()) {
      if (schema.as_bool()) return anyValue();
      return invalid(path, "the schema false admits no value");
    }
    if (!schema.is_object()) return invalid(path, "a schema must be an object or a boolean");
    const json::object& obj = schema.as_object();
    std::vector<std::string> present;
    for (const auto& kv : obj) {
      const std::string_view key = kv.key();
      if (contains(kAnnotations, key)) continue;
      if (!contains(kConstraints, key)) return unsupported(path, "the keyword '" + std::string(key) + "'");
      present.emplace_back(key);
    }
    auto others = [&](std::initializer_list<std::string_view> allowed) {
      std::string list;
      for (const auto& k : present) {
        if (std::find(allowed.begin(), allowed.end(), k) != allowed.end()) continue;
        list += (list.empty() ? "'" : ", '") + k + "'";
      }
      return list;
    };

    if (obj.contains("$ref")) {
      if (const auto extra = others({"$ref"}); !extra.empty()) return unsupported(path, "'$ref' beside " + extra);
      return compileRef(obj.at("$ref"), path);
    }
    if (obj.contains("anyOf")) {
      if (const auto extra = others({"anyOf"}); !extra.empty()) return unsupported(path, "'anyOf' beside " + extra);
      const json::value& alts = obj.at("anyOf");
      if (!alts.is_array() || alts.as_array().empty()) return invalid(path, "'anyOf' must be a non-empty array");
      std::vector<std::uint32_t> kids;
      for (std::size_t i = 0; i < alts.as_array().size(); ++i) {
        PD_ASSIGN_OR_RETURN(auto kid, compile(alts.as_array()[i], path + "/anyOf/" + std::to_string(i)));
        kids.push_back(kid);
      }
      return choice(std::move(kids));
    }

    std::vector<std::string> types;
    if (const auto* t = obj.if_contains("type")) {
      if (t->is_string()) {
        types.emplace_back(t->as_string());
      } else if (t->is_array() && !t->as_array().empty()) {
        for (const auto& x : t->as_array()) {
          if (!x.is_string()) return invalid(path, "'type' must be a string or an array of strings");
          types.emplace_back(x.as_string());
        }
      } else {
        return invalid(path, "'type' must be a string or a non-empty array of strings");
      }
      for (const auto& type : types) {
        if (type != "object" && type != "array" && type != "string" && type != "number" && type != "integer" &&
            type != "boolean" && type != "null") {
          return invalid(path, "unknown type '" + type + "'");
        }
      }
    }

    if (obj.contains("const") || obj.contains("enum")) {
      if (const auto extra = others({"const", "enum", "type"}); !extra.empty()) {
        return unsupported(path, "'const'/'enum' beside " + extra);
      }
      std::vector<const json::value*> values;
      if (const auto* c = obj.if_contains("const")) values.push_back(c);
      if (const auto* e = obj.if_contains("enum")) {
        if (!e->is_array() || e->as_array().empty()) return invalid(path, "'enum' must be a non-empty array");
        if (obj.contains("const")) return unsupported(path, "'const' beside 'enum'");
        for (const auto& v : e->as_array()) values.push_back(&v);
      }
      std::vector<std::uint32_t> kids;
      for (const auto* v : values) {
        const bool typed = types.empty() || std::any_of(types.begin(), types.end(),
                                                        [&](const std::string& t) { return typeMatches(*v, t); });
        if (typed) kids.push_back(literal(json::serialize(*v)));
      }
      if (kids.empty()) return invalid(path, "no 'enum'/'const' value has the schema's type");
      return choice(std::move(kids));
    }

    if (types.empty()) {
      // No type: the keywords present say which one (JSON Schema applies each only to its type).
      auto any = [&](std::initializer_list<std::string_view> keys) {
        return std::any_of(keys.begin(), keys.end(), [&](std::string_view k) { return obj.contains(k); });
      };
      if (any({"properties", "required", "additionalProperties"})) types.emplace_back("object");
      if (any({"items", "minItems", "maxItems"})) types.emplace_back("array");
      if (any({"minLength", "maxLength", "pattern"})) types.emplace_back("string");
      if (types.empty()) return anyValue();
      if (types.size() > 1) return unsupported(path, "keywords of several types without 'type'");
    }
    std::vector<std::uint32_t> kids;
    for (const auto& type : types) {
      PD_ASSIGN_OR_RETURN(auto kid, compileType(obj, type, path));
      kids.push_back(kid);
    }
    return kids.size() == 1 ? kids[0] : choice(std::move(kids));
  }

  std::uint32_t anyObject() { return map(anyValue()); }

  /// Compiles `schema` with its own document as the root of its $refs (a tool's parameters).
  Result<std::uint32_t> compileDocument(const json::value& schema, const std::string& path) {
    const json::value* saved = root_;
    root_ = &schema;
    auto compiled = compile(schema, path);
    root_ = saved;
    return compiled;
  }
  std::uint32_t text(std::string bytes) { return literal(std::move(bytes)); }
  std::uint32_t sequence(std::vector<std::uint32_t> kids) { return seq(std::move(kids)); }
  std::uint32_t oneOf(std::vector<std::uint32_t> kids) { return choice(std::move(kids)); }
  std::uint32_t marker(std::uint32_t index) {
    Node n;
    n.kind = NodeKind::Marker;
    n.item = index;
    return add(std::move(n));
  }
  void setMarkers(std::vector<TokenId> markers) { a_.markers = std::move(markers); }
  /// The automaton without the whitespace around the root (a tool-call section starts with its
  /// marker token).
  Result<Automaton> finishBare(std::uint32_t value) {
    a_.root = value;
    computeNullable();
    std::vector<std::uint32_t> memo(a_.nodes.size(), kNoNode);
    if (depth(a_.root, memo) > kGuardDepth) {
      return unsupported("#", "nesting deeper than " + std::to_string(kGuardDepth / 2) + " levels");
    }
    return std::move(a_);
  }

 private:
  std::uint32_t add(Node n) {
    a_.nodes.push_back(std::move(n));
    return static_cast<std::uint32_t>(a_.nodes.size() - 1);
  }
  std::uint32_t literal(std::string bytes) {
    Node n;
    n.kind = NodeKind::Literal;
    n.bytes = std::move(bytes);
    return add(std::move(n));
  }
  std::uint32_t seq(std::vector<std::uint32_t> kids) {
    Node n;
    n.kind = NodeKind::Sequence;
    n.children = std::move(kids);
    return add(std::move(n));
  }
  std::uint32_t choice(std::vector<std::uint32_t> kids) {
    if (kids.size() == 1) return kids[0];
    Node n;
    n.kind = NodeKind::Choice;
    n.children = std::move(kids);
    return add(std::move(n));
  }
  std::uint32_t string(std::uint32_t min, std::uint32_t max, std::int32_t pattern) {
    if (max == kUnbounded && string_cap_ != kUnbounded) {
      const std::uint32_t shortest = pattern < 0 ? 0
                                                 : a_.patterns[static_cast<std::size_t>(pattern)]
                                                       .dist[a_.patterns[static_cast<std::size_t>(pattern)].start];
      max = std::max({string_cap_, min, shortest});
    }
    Node n;
    n.kind = NodeKind::String;
    n.min = min;
    n.max = max;
    n.pattern = pattern;
    return add(std::move(n));
  }
  std::uint32_t number(bool integer) {
    Node n;
    n.kind = NodeKind::Number;
    n.integer = integer;
    return add(std::move(n));
  }
  std::uint32_t list(char open, char close, std::uint32_t item, std::uint32_t min, std::uint32_t max) {
    Node n;
    n.kind = NodeKind::List;
    n.container = true;
    n.open = static_cast<std::uint8_t>(open);
    n.close = static_cast<std::uint8_t>(close);
    n.item = item;
    n.min = min;
    n.max = max;
    return add(std::move(n));
  }
  // An object with any keys, each value matching `value`.
  std::uint32_t map(std::uint32_t value) {
    const std::uint32_t member = seq({string(0, kUnbounded, -1), a_.whitespace, literal(":"), a_.whitespace, value});
    return list('{', '}', member, 0, kUnbounded);
  }
  std::uint32_t anyValue() {
    if (any_value_ != kNoNode) return any_value_;
    Node n;
    n.kind = NodeKind::Choice;
    n.depth_guard = true;
    any_value_ = add(std::move(n));
    std::vector<std::uint32_t> kids = {map(any_value_),
                                       list('[', ']', any_value_, 0, kUnbounded),
                                       string(0, kUnbounded, -1),
                                       number(false),
                                       literal("true"),
                                       literal("false"),
                                       literal("null")};
    a_.nodes[any_value_].children = std::move(kids);
    return any_value_;
  }

  Result<std::uint32_t> compileRef(const json::value& ref, const std::string& path) {
    if (!ref.is_string()) return invalid(path, "'$ref' must be a string");
    const std::string target(ref.as_string());
    std::string_view rest = target;
    std::string_view section;
    for (const std::string_view prefix : {std::string_view("#/$defs/"), std::string_view("#/definitions/")}) {
      if (rest.starts_with(prefix)) {
        section = prefix.substr(2, prefix.size() - 3);
        rest.remove_prefix(prefix.size());
        break;
      }
    }
    if (section.empty() || rest.find('/') != std::string_view::npos) {
      return unsupported(path, "the $ref '" + target + "' (only #/$defs/<name> and #/definitions/<name>)");
    }
    std::string name;
    for (std::size_t i = 0; i < rest.size(); ++i) {
      if (rest[i] == '~' && i + 1 < rest.size() && (rest[i + 1] == '0' || rest[i + 1] == '1')) {
        name += rest[i + 1] == '0' ? '~' : '/';
        ++i;
      } else {
        name += rest[i];
      }
    }
    const json::value* defs = root_->is_object() ? root_->as_object().if_contains(section) : nullptr;
    const json::value* def = (defs != nullptr && defs->is_object()) ? defs->as_object().if_contains(name) : nullptr;
    if (def == nullptr) return invalid(path, "'$ref' '" + target + "' names no definition");
    if (std::find(refs_.begin(), refs_.end(), target) != refs_.end()) {
      return unsupported(path, "the recursive $ref '" + target + "'");
    }
    refs_.push_back(target);
    auto compiled = compile(*def, target);
    refs_.pop_back();
    return compiled;
  }

  static Result<std::uint32_t> count(const json::object& obj, std::string_view key, std::uint32_t absent,
                                     const std::string& path) {
    const auto* v = obj.if_contains(key);
    if (v == nullptr) return absent;
    std::int64_t n = -1;
    if (v->is_int64()) n = v->as_int64();
    if (v->is_uint64()) n = static_cast<std::int64_t>(std::min<std::uint64_t>(v->as_uint64(), INT64_MAX));
    if (v->is_double() && v->as_double() >= 0 && v->as_double() < 1e18 &&
        v->as_double() == static_cast<double>(static_cast<std::int64_t>(v->as_double()))) {
      n = static_cast<std::int64_t>(v->as_double());
    }
    if (n < 0) return invalid(path, "'" + std::string(key) + "' must be a non-negative integer");
    if (n >= static_cast<std::int64_t>(kUnbounded)) return unsupported(path, "'" + std::string(key) + "' this large");
    return static_cast<std::uint32_t>(n);
  }

  Result<std::uint32_t> compileType(const json::object& obj, const std::string& type, const std::string& path) {
    if (type == "null") return literal("null");
    if (type == "boolean") return choice({literal("true"), literal("false")});
    if (type == "number" || type == "integer") return number(type == "integer");
    if (type == "string") {
      PD_ASSIGN_OR_RETURN(auto min, count(obj, "minLength", 0, path));
      PD_ASSIGN_OR_RETURN(auto max, count(obj, "maxLength", kUnbounded, path));
      if (min > max) return invalid(path, "minLength > maxLength");
      std::int32_t pattern = -1;
      if (const auto* p = obj.if_contains("pattern")) {
        if (!p->is_string()) return invalid(path, "'pattern' must be a string");
        if (min > 0) return unsupported(path, "'minLength' together with 'pattern'");
        auto dfa = compileRegex(std::string_view(p->as_string()));
        if (!dfa.ok()) {
          return makeError(dfa.error().code, "response schema " + path + ": " + dfa.error().message);
        }
        if (max != kUnbounded && dfa.value().dist[dfa.value().start] > max) {
          return invalid(path, "no string of at most maxLength characters matches 'pattern'");
        }
        a_.patterns.push_back(std::move(dfa).value());
        pattern = static_cast<std::int32_t>(a_.patterns.size() - 1);
      }
      return string(min, max, pattern);
    }
    if (type == "array") {
      std::uint32_t item = kNoNode;
      if (const auto* items = obj.if_contains("items")) {
        if (items->is_array()) return unsupported(path, "'items' as an array (tuples)");
        PD_ASSIGN_OR_RETURN(item, compile(*items, path + "/items"));
      } else {
        item = anyValue();
      }
      PD_ASSIGN_OR_RETURN(auto min, count(obj, "minItems", 0, path));
      PD_ASSIGN_OR_RETURN(auto max, count(obj, "maxItems", kUnbounded, path));
      if (min > max) return invalid(path, "minItems > maxItems");
      return list('[', ']', item, min, max);
    }
    // object
    const json::value* props = obj.if_contains("properties");
    if (props != nullptr && !props->is_object()) return invalid(path, "'properties' must be an object");
    std::vector<std::string> required;
    if (const auto* r = obj.if_contains("required")) {
      if (!r->is_array()) return invalid(path, "'required' must be an array of strings");
      for (const auto& x : r->as_array()) {
        if (!x.is_string()) return invalid(path, "'required' must be an array of strings");
        required.emplace_back(x.as_string());
      }
    }
    const json::value* extra = obj.if_contains("additionalProperties");
    if (extra != nullptr && !extra->is_bool() && !extra->is_object()) {
      return invalid(path, "'additionalProperties' must be a boolean or a schema");
    }
    const bool closed = extra != nullptr && extra->is_bool() && !extra->as_bool();
    if ((props == nullptr || props->as_object().empty()) && !closed) {
      if (!required.empty()) return unsupported(path, "'required' without 'properties'");
      if (extra != nullptr && extra->is_object()) {
        PD_ASSIGN_OR_RETURN(auto value, compile(*extra, path + "/additionalProperties"));
        return map(value);
      }
      return anyObject();
    }
    Node n;
    n.kind = NodeKind::Object;
    n.container = true;
    if (props != nullptr) {
      for (const auto& kv : props->as_object()) {
        const std::string name(kv.key());
        std::string member_path = path;
        member_path += "/properties/";
        member_path += name;
        PD_ASSIGN_OR_RETURN(auto value, compile(kv.value(), member_path));
        const std::uint32_t member =
            seq({literal(json::serialize(json::string(kv.key()))), a_.whitespace, literal(":"), a_.whitespace, value});
        n.children.push_back(member);
        n.required.push_back(std::find(required.begin(), required.end(), name) != required.end() ? 1 : 0);
      }
    }
    for (const auto& name : required) {
      if (props == nullptr || !props->as_object().contains(name)) {
        return unsupported(path, "the required property '" + name + "' that 'properties' does not define");
      }
    }
    const std::size_t members = n.children.size();
    n.next_required.assign(members + 1, static_cast<std::uint32_t>(members));
    for (std::size_t i = members; i > 0; --i) {
      n.next_required[i - 1] = n.required[i - 1] != 0 ? static_cast<std::uint32_t>(i - 1) : n.next_required[i];
    }
    return add(std::move(n));
  }

  void computeNullable() {
    for (bool changed = true; changed;) {
      changed = false;
      for (auto& n : a_.nodes) {
        bool nullable = n.nullable;
        if (n.kind == NodeKind::Sequence) {
          nullable = std::all_of(n.children.begin(), n.children.end(), [&](auto c) { return a_.nodes[c].nullable; });
        } else if (n.kind == NodeKind::Choice) {
          nullable = std::any_of(n.children.begin(), n.children.end(), [&](auto c) { return a_.nodes[c].nullable; });
        }
        if (nullable != n.nullable) {
          n.nullable = nullable;
          changed = true;
        }
      }
    }
  }

  // Frames a node can stack up, not counting generic JSON containers (the runtime guard bounds those).
  std::uint32_t depth(std::uint32_t id, std::vector<std::uint32_t>& memo) {
    if (memo[id] != kNoNode) return memo[id];
    const Node& n = a_.nodes[id];
    std::uint32_t d = 1;
    switch (n.kind) {
      case NodeKind::Sequence:
        // The last child replaces the sequence's frame (Automaton::feed).
        for (std::size_t i = 0; i + 1 < n.children.size(); ++i) d = std::max(d, 1 + depth(n.children[i], memo));
        if (!n.children.empty()) d = std::max(d, depth(n.children.back(), memo));
        break;
      case NodeKind::Object:
        for (const auto c : n.children) d = std::max(d, 1 + depth(c, memo));
        break;
      case NodeKind::Choice:
        d = 0;
        for (const auto c : n.children) {
          if (n.depth_guard && a_.nodes[c].container) {
            d = std::max<std::uint32_t>(d, 3);
            continue;
          }
          d = std::max(d, depth(c, memo));
        }
        break;
      case NodeKind::List:
        d = 1 + std::max<std::uint32_t>(1, depth(n.item, memo));
        break;
      default:
        break;
    }
    memo[id] = d;
    return d;
  }

  Automaton a_;
  const json::value* root_;
  std::uint32_t string_cap_;  // GrammarOptions::unbounded_string_chars, kUnbounded for none
  std::uint32_t any_value_ = kNoNode;
  std::vector<std::string> refs_;
};

}  // namespace

Result<Automaton> compileJsonSchema(const json::value& schema, const GrammarOptions& options) {
  SchemaCompiler compiler(&schema, options);
  PD_ASSIGN_OR_RETURN(auto value, compiler.compile(schema, "#"));
  return compiler.finish(value);
}

Result<Automaton> compileToolCalls(std::span<const ToolSpec> tools, ToolCallFormat format, bool parallel,
                                   std::vector<TokenId> markers, const GrammarOptions& options) {
  if (tools.empty()) return invalid("tools", "no tool to call");
  const json::value empty;
  SchemaCompiler c(&empty, options);
  c.setMarkers(std::move(markers));
  const std::uint32_t calls_begin = c.marker(kCallsBeginMarker);
  const std::uint32_t calls_end = c.marker(kCallsEndMarker);
  std::vector<std::uint32_t> named;  // per tool: its name and its arguments
  for (std::size_t i = 0; i < tools.size(); ++i) {
    const ToolSpec& tool = tools[i];
    const std::string path = "tools[" + std::to_string(i) + "]";
    if (tool.name.empty()) return invalid(path, "a tool needs a name");
    std::uint32_t args = 0;
    if (tool.parameters_json.empty()) {
      args = c.anyObject();
    } else {
      boost::system::error_code ec;
      const json::value schema = json::parse(tool.parameters_json, ec);
      if (ec) return invalid(path, "parameters are not JSON: " + ec.message());
      PD_ASSIGN_OR_RETURN(args, c.compileDocument(schema, path + ".parameters"));
    }
    if (format == ToolCallFormat::DeepSeekV3) {
      // function<｜tool▁sep｜>NAME\n```json\nARGS\n```
      named.push_back(c.sequence({c.text(tool.name + "\n```json\n"), args, c.text("\n```")}));
    } else {
      // NAME<｜tool▁sep｜>ARGS
      named.push_back(c.sequence({c.text(tool.name), c.marker(kToolSepMarker), args}));
    }
  }
  std::uint32_t call = 0;
  if (format == ToolCallFormat::DeepSeekV3) {
    call = c.sequence({c.marker(kCallBeginMarker), c.text("function"), c.marker(kToolSepMarker), c.oneOf(named),
                       c.marker(kCallEndMarker)});
  } else {
    call = c.sequence({c.marker(kCallBeginMarker), c.oneOf(named), c.marker(kCallEndMarker)});
  }
  // Further calls: up to kMaxParallelToolCalls in all, separated as the chat template does.
  std::uint32_t rest = calls_end;
  if (parallel) {
    for (std::uint32_t k = 1; k < kMaxParallelToolCalls; ++k) {
      std::vector<std::uint32_t> more;
      if (format == ToolCallFormat::DeepSeekV3) more.push_back(c.text("\n"));
      more.push_back(call);
      more.push_back(rest);
      rest = c.oneOf({calls_end, c.sequence(std::move(more))});
    }
  }
  return c.finishBare(c.sequence({calls_begin, call, rest}));
}

Result<Automaton> compileAnyJsonObject(const GrammarOptions& options) {
  const json::value empty;
  SchemaCompiler compiler(&empty, options);
  const std::uint32_t value = compiler.anyObject();
  return compiler.finish(value);
}

}  // namespace pd::structured::detail
