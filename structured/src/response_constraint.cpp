#include "pd/structured/response_constraint.h"

#include <boost/json.hpp>

#include "pd/common/check.h"

namespace pd::structured {
namespace {

namespace json = boost::json;

Error bad(std::string what) {
  return makeError(ErrorCode::InvalidArgument, std::move(what));
}

const json::value* member(const json::object& o, std::string_view key) {
  const json::value* v = o.if_contains(key);
  return (v == nullptr || v->is_null()) ? nullptr : v;
}

std::string_view kindName(ResponseConstraint::Kind kind) {
  switch (kind) {
    case ResponseConstraint::Kind::None:
      return "none";
    case ResponseConstraint::Kind::JsonObject:
      return "json_object";
    case ResponseConstraint::Kind::JsonSchema:
      return "json_schema";
    case ResponseConstraint::Kind::ToolCalls:
      return "tool_calls";
  }
  return "none";
}

}  // namespace

Result<ResponseConstraint> responseFormatConstraint(const json::value* response_format) {
  ResponseConstraint c;
  if (response_format == nullptr || response_format->is_null()) return c;
  const json::object* o = response_format->if_object();
  const json::value* type = o != nullptr ? member(*o, "type") : nullptr;
  if (type == nullptr || !type->is_string()) return bad("'response_format' must be an object with a string 'type'");
  const std::string_view t = type->get_string();
  if (t == "text") return c;
  if (t == "json_object") {
    c.kind = ResponseConstraint::Kind::JsonObject;
    return c;
  }
  if (t != "json_schema") {
    return bad("'response_format.type' must be 'text', 'json_object' or 'json_schema'");
  }
  const json::value* js = member(*o, "json_schema");
  if (js == nullptr || !js->is_object()) return bad("'response_format.json_schema' must be an object");
  const json::value* schema = member(js->get_object(), "schema");
  if (schema == nullptr) return bad("'response_format.json_schema.schema' is required");
  if (!schema->is_object() && !schema->is_bool()) {
    return bad("'response_format.json_schema.schema' must be a JSON Schema object");
  }
  if (const json::value* strict = member(js->get_object(), "strict"); strict != nullptr && !strict->is_bool()) {
    return bad("'response_format.json_schema.strict' must be a boolean");
  }
  c.kind = ResponseConstraint::Kind::JsonSchema;
  c.schema_json = json::serialize(*schema);
  return c;
}

Result<ResponseConstraint> toolChoiceConstraint(const json::value* tools, const json::value* tool_choice,
                                                bool parallel_tool_calls) {
  ResponseConstraint c;
  std::vector<ToolSpec> specs;
  if (tools != nullptr && !tools->is_null()) {
    if (!tools->is_array()) return bad("'tools' must be an array");
    for (std::size_t i = 0; i < tools->get_array().size(); ++i) {
      const std::string where = "'tools[" + std::to_string(i) + "]";
      const json::object* tool = tools->get_array()[i].if_object();
      const json::value* type = tool != nullptr ? member(*tool, "type") : nullptr;
      if (type == nullptr || !type->is_string() || type->get_string() != "function") {
        return bad(where + ".type' must be 'function'");
      }
      const json::value* fn = member(*tool, "function");
      if (fn == nullptr || !fn->is_object()) return bad(where + ".function' must be an object");
      const json::value* name = member(fn->get_object(), "name");
      if (name == nullptr || !name->is_string() || name->get_string().empty()) {
        return bad(where + ".function.name' must be a non-empty string");
      }
      ToolSpec spec;
      spec.name = std::string(name->get_string());
      if (const json::value* params = member(fn->get_object(), "parameters")) {
        if (!params->is_object()) return bad(where + ".function.parameters' must be a JSON Schema object");
        spec.parameters_json = json::serialize(*params);
      }
      for (const auto& seen : specs) {
        if (seen.name == spec.name) return bad("'tools' names the function '" + spec.name + "' twice");
      }
      specs.push_back(std::move(spec));
    }
  }
  if (tool_choice == nullptr || tool_choice->is_null()) return c;
  if (tool_choice->is_string()) {
    const std::string_view choice = tool_choice->get_string();
    if (choice == "auto" || choice == "none") return c;
    if (choice != "required") return bad("'tool_choice' must be 'none', 'auto', 'required' or a named function");
    if (specs.empty()) return bad("'tool_choice' is 'required' but 'tools' is empty");
    c.kind = ResponseConstraint::Kind::ToolCalls;
    c.tools = std::move(specs);
    c.parallel_tool_calls = parallel_tool_calls;
    return c;
  }
  const json::object* o = tool_choice->if_object();
  const json::value* fn = o != nullptr ? member(*o, "function") : nullptr;
  const json::value* name = (fn != nullptr && fn->is_object()) ? member(fn->get_object(), "name") : nullptr;
  if (name == nullptr || !name->is_string()) {
    return bad(
        "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}");
  }
  for (auto& spec : specs) {
    if (spec.name == name->get_string()) {
      c.kind = ResponseConstraint::Kind::ToolCalls;
      c.tools.push_back(std::move(spec));
      c.parallel_tool_calls = false;  // one named call
      return c;
    }
  }
  return bad("'tool_choice' names a function that 'tools' does not define");
}

std::string encodeConstraint(const ResponseConstraint& c) {
  json::object o;
  o["kind"] = kindName(c.kind);
  if (c.kind == ResponseConstraint::Kind::JsonSchema) o["schema"] = c.schema_json;
  if (c.kind == ResponseConstraint::Kind::ToolCalls) {
    json::array tools;
    for (const auto& t : c.tools) tools.push_back(json::object{{"name", t.name}, {"parameters", t.parameters_json}});
    o["tools"] = std::move(tools);
    o["parallel_tool_calls"] = c.parallel_tool_calls;
  }
  return json::serialize(o);
}

Result<ResponseConstraint> decodeConstraint(std::string_view text) {
  boost::system::error_code ec;
  const json::value v = json::parse(text, ec);
  if (ec || !v.is_object()) return bad("constraint: not a JSON object");
  const json::object& o = v.get_object();
  const json::value* kind = o.if_contains("kind");
  if (kind == nullptr || !kind->is_string()) return bad("constraint: 'kind' must be a string");
  ResponseConstraint c;
  const std::string_view k = kind->get_string();
  if (k == "none") return c;
  if (k == "json_object") {
    c.kind = ResponseConstraint::Kind::JsonObject;
    return c;
  }
  if (k == "json_schema") {
    const json::value* schema = o.if_contains("schema");
    if (schema == nullptr || !schema->is_string()) return bad("constraint: 'schema' must be a string");
    c.kind = ResponseConstraint::Kind::JsonSchema;
    c.schema_json = std::string(schema->get_string());
    return c;
  }
  if (k != "tool_calls") return bad("constraint: unknown kind");
  const json::value* tools = o.if_contains("tools");
  const json::value* parallel = o.if_contains("parallel_tool_calls");
  if (tools == nullptr || !tools->is_array() || tools->get_array().empty()) {
    return bad("constraint: 'tools' must be a non-empty array");
  }
  if (parallel == nullptr || !parallel->is_bool()) return bad("constraint: 'parallel_tool_calls' must be a boolean");
  c.kind = ResponseConstraint::Kind::ToolCalls;
  c.parallel_tool_calls = parallel->get_bool();
  for (const auto& t : tools->get_array()) {
    const json::object* to = t.if_object();
    const json::value* name = to != nullptr ? to->if_contains("name") : nullptr;
    const json::value* params = to != nullptr ? to->if_contains("parameters") : nullptr;
    if (name == nullptr || !name->is_string() || name->get_string().empty() || params == nullptr ||
        !params->is_string()) {
      return bad("constraint: each tool needs a 'name' and a 'parameters' string");
    }
    c.tools.push_back({std::string(name->get_string()), std::string(params->get_string())});
  }
  return c;
}

Result<std::shared_ptr<const Grammar>> compileConstraint(const ResponseConstraint& c, ToolCallFormat format,
                                                         std::shared_ptr<const TokenVocabulary> vocabulary,
                                                         const GrammarOptions& options) {
  switch (c.kind) {
    case ResponseConstraint::Kind::JsonObject:
      return Grammar::anyJsonObject(std::move(vocabulary), options);
    case ResponseConstraint::Kind::JsonSchema:
      return Grammar::fromJsonSchema(c.schema_json, std::move(vocabulary), options);
    case ResponseConstraint::Kind::ToolCalls:
      return Grammar::forToolCalls(c.tools, format, c.parallel_tool_calls, std::move(vocabulary), options);
    case ResponseConstraint::Kind::None:
      break;
  }
  PD_CHECK_MSG(false, "compileConstraint: an unconstrained request has no grammar");
  return makeError(ErrorCode::Internal, "unreachable");
}

GrammarCache::GrammarCache(std::shared_ptr<const TokenVocabulary> vocabulary, ToolCallFormat format,
                           GrammarOptions options, std::size_t capacity)
    : vocabulary_(std::move(vocabulary)), format_(format), options_(options), capacity_(capacity) {
  PD_CHECK(vocabulary_ != nullptr);
  PD_CHECK(capacity_ > 0);
}

Result<std::shared_ptr<const Grammar>> GrammarCache::get(const ResponseConstraint& constraint) {
  std::string key = encodeConstraint(constraint);
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (const auto it = index_.find(key); it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return it->second->second;
    }
  }
  PD_ASSIGN_OR_RETURN(auto grammar, compileConstraint(constraint, format_, vocabulary_, options_));
  const std::lock_guard<std::mutex> lock(mutex_);
  if (const auto it = index_.find(key); it != index_.end()) return it->second->second;  // compiled twice: keep one
  lru_.emplace_front(key, grammar);
  index_.emplace(std::move(key), lru_.begin());
  if (lru_.size() > capacity_) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  return grammar;
}

std::size_t GrammarCache::size() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return lru_.size();
}

}  // namespace pd::structured
