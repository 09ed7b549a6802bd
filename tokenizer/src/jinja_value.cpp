#include "jinja_value.h"

#include <algorithm>
#include <boost/json.hpp>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "pd/common/json_text.h"

namespace pd::chat::jinja {
namespace {

// Python's float repr: shortest round-trip digits; positional notation for exponents in
// [-4, 16), else d.ddde+XX.
std::string pythonFloat(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  // sci is like "-1.2345e+03"
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const std::size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp = std::stoi(sci.substr(e + 1));
  if (exp >= -4 && exp < 16) {
    std::string out;
    if (exp < 0) {
      out = "0." + std::string(static_cast<std::size_t>(-exp - 1), '0') + digits;
    } else if (static_cast<std::size_t>(exp) + 1 >= digits.size()) {
      out = digits + std::string(static_cast<std::size_t>(exp) + 1 - digits.size(), '0') + ".0";
    } else {
      out =
          digits.substr(0, static_cast<std::size_t>(exp) + 1) + "." + digits.substr(static_cast<std::size_t>(exp) + 1);
    }
    return sign + out;
  }
  std::string mantissa = digits.substr(0, 1);
  if (digits.size() > 1) mantissa += "." + digits.substr(1);
  char exp_buf[16];
  std::snprintf(exp_buf, sizeof exp_buf, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
  return sign + mantissa + exp_buf;
}

std::string pythonStringRepr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (ch == quote || ch == '\\') {
      out.push_back('\\');
      out.push_back(ch);
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\r') {
      out += "\\r";
    } else if (ch == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out.push_back(ch);
    }
  }
  out.push_back(quote);
  return out;
}

bool toJsonAt(const Value& v, int indent, bool sort_keys, int depth, std::string& out) {
  const auto newline = [&](int level) {
    out.push_back('\n');
    out.append(static_cast<std::size_t>(indent) * static_cast<std::size_t>(level), ' ');
  };
  switch (v.kind()) {
    case Value::Kind::None:
      out += "null";
      return true;
    case Value::Kind::Bool:
      out += v.asBool() ? "true" : "false";
      return true;
    case Value::Kind::Int:
      out += std::to_string(v.asInt());
      return true;
    case Value::Kind::Float: {
      const double d = v.asFloat();
      if (std::isnan(d))
        out += "NaN";
      else if (std::isinf(d))
        out += d < 0 ? "-Infinity" : "Infinity";
      else
        out += pythonFloat(d);
      return true;
    }
    case Value::Kind::String:
      appendJsonString(out, v.asString());
      return true;
    case Value::Kind::List: {
      const auto& items = *v.listPtr();
      if (items.empty()) {
        out += "[]";
        return true;
      }
      out.push_back('[');
      for (std::size_t k = 0; k < items.size(); ++k) {
        if (k > 0) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(depth + 1);
        if (!toJsonAt(items[k], indent, sort_keys, depth + 1, out)) return false;
      }
      if (indent >= 0) newline(depth);
      out.push_back(']');
      return true;
    }
    case Value::Kind::Dict:
    case Value::Kind::Namespace: {
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& item : v.dictPtr()->items) items.push_back(&item);
      if (sort_keys) {
        std::stable_sort(items.begin(), items.end(), [](const auto* a, const auto* b) { return a->first < b->first; });
      }
      if (items.empty()) {
        out += "{}";
        return true;
      }
      out.push_back('{');
      for (std::size_t k = 0; k < items.size(); ++k) {
        if (k > 0) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(depth + 1);
        appendJsonString(out, items[k]->first);
        out += ": ";
        if (!toJsonAt(items[k]->second, indent, sort_keys, depth + 1, out)) return false;
      }
      if (indent >= 0) newline(depth);
      out.push_back('}');
      return true;
    }
    case Value::Kind::Undefined:
    case Value::Kind::Callable:
      return false;
  }
  return false;
}

}  // namespace

Value Value::list(ValueList items) {
  Value v(Kind::List);
  v.list_ = std::make_shared<ValueList>(std::move(items));
  return v;
}

Value Value::dict(std::shared_ptr<ValueDict> d) {
  Value v(Kind::Dict);
  v.dict_ = std::move(d);
  return v;
}

Value Value::emptyDict() {
  return dict(std::make_shared<ValueDict>());
}

Value Value::ns(std::shared_ptr<ValueDict> d) {
  Value v(Kind::Namespace);
  v.dict_ = std::move(d);
  return v;
}

Value Value::callable(std::shared_ptr<const Callable> c) {
  Value v(Kind::Callable);
  v.callable_ = std::move(c);
  return v;
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::Undefined:
    case Kind::None:
      return false;
    case Kind::Bool:
    case Kind::Int:
      return int_ != 0;
    case Kind::Float:
      return float_ != 0.0;
    case Kind::String:
      return !string_.empty();
    case Kind::List:
      return !list_->empty();
    case Kind::Dict:
      return !dict_->items.empty();
    case Kind::Namespace:
    case Kind::Callable:
      return true;
  }
  return false;
}

std::string Value::str() const {
  switch (kind_) {
    case Kind::Undefined:
      return {};
    case Kind::String:
      return string_;
    default:
      return repr();
  }
}

std::string Value::repr() const {
  switch (kind_) {
    case Kind::Undefined:
      return {};
    case Kind::None:
      return "None";
    case Kind::Bool:
      return int_ != 0 ? "True" : "False";
    case Kind::Int:
      return std::to_string(int_);
    case Kind::Float:
      return pythonFloat(float_);
    case Kind::String:
      return pythonStringRepr(string_);
    case Kind::List: {
      std::string out = "[";
      for (std::size_t k = 0; k < list_->size(); ++k) {
        if (k > 0) out += ", ";
        out += (*list_)[k].repr();
      }
      return out + "]";
    }
    case Kind::Dict: {
      std::string out = "{";
      for (std::size_t k = 0; k < dict_->items.size(); ++k) {
        if (k > 0) out += ", ";
        out += pythonStringRepr(dict_->items[k].first) + ": " + dict_->items[k].second.repr();
      }
      return out + "}";
    }
    case Kind::Namespace:
      return "<Namespace>";
    case Kind::Callable:
      return "<function>";
  }
  return {};
}

bool Value::equals(const Value& other) const {
  if (isNumber() && other.isNumber()) {
    if (kind_ == Kind::Float || other.kind_ == Kind::Float) return asFloat() == other.asFloat();
    return int_ == other.int_;
  }
  if (kind_ != other.kind_) return false;
  switch (kind_) {
    case Kind::Undefined:
    case Kind::None:
      return true;
    case Kind::String:
      return string_ == other.string_;
    case Kind::List: {
      if (list_->size() != other.list_->size()) return false;
      for (std::size_t k = 0; k < list_->size(); ++k) {
        if (!(*list_)[k].equals((*other.list_)[k])) return false;
      }
      return true;
    }
    case Kind::Dict: {
      if (dict_->items.size() != other.dict_->items.size()) return false;
      for (const auto& [key, value] : dict_->items) {
        const Value* o = other.dict_->find(key);
        if (o == nullptr || !value.equals(*o)) return false;
      }
      return true;
    }
    case Kind::Namespace:
      return dict_ == other.dict_;
    case Kind::Callable:
      return callable_ == other.callable_;
    default:
      return false;
  }
}

std::string_view Value::typeName() const {
  switch (kind_) {
    case Kind::Undefined:
      return "undefined";
    case Kind::None:
      return "none";
    case Kind::Bool:
      return "bool";
    case Kind::Int:
      return "int";
    case Kind::Float:
      return "float";
    case Kind::String:
      return "str";
    case Kind::List:
      return "list";
    case Kind::Dict:
      return "dict";
    case Kind::Namespace:
      return "namespace";
    case Kind::Callable:
      return "function";
  }
  return "?";
}

const Value* ValueDict::find(std::string_view key) const {
  for (const auto& item : items) {
    if (item.first == key) return &item.second;
  }
  return nullptr;
}

void ValueDict::set(std::string key, Value value) {
  for (auto& item : items) {
    if (item.first == key) {
      item.second = std::move(value);
      return;
    }
  }
  items.emplace_back(std::move(key), std::move(value));
}

Value fromJson(const boost::json::value& json) {
  switch (json.kind()) {
    case boost::json::kind::null:
      return Value::none();
    case boost::json::kind::bool_:
      return Value::boolean(json.get_bool());
    case boost::json::kind::int64:
      return Value::integer(json.get_int64());
    case boost::json::kind::uint64: {
      const auto u = json.get_uint64();
      if (u <= static_cast<std::uint64_t>(INT64_MAX)) return Value::integer(static_cast<std::int64_t>(u));
      return Value::real(static_cast<double>(u));
    }
    case boost::json::kind::double_:
      return Value::real(json.get_double());
    case boost::json::kind::string:
      return Value::string(std::string(json.get_string()));
    case boost::json::kind::array: {
      ValueList items;
      items.reserve(json.get_array().size());
      for (const auto& item : json.get_array()) items.push_back(fromJson(item));
      return Value::list(std::move(items));
    }
    case boost::json::kind::object: {
      auto d = std::make_shared<ValueDict>();
      d->items.reserve(json.get_object().size());
      for (const auto& kv : json.get_object()) d->items.emplace_back(std::string(kv.key()), fromJson(kv.value()));
      return Value::dict(std::move(d));
    }
  }
  return Value::none();
}

bool toJson(const Value& value, int indent, bool sort_keys, std::string& out) {
  return toJsonAt(value, indent, sort_keys, 0, out);
}

std::vector<std::string_view> codePoints(std::string_view s) {
  std::vector<std::string_view> out;
  out.reserve(s.size());
  std::size_t pos = 0;
  while (pos < s.size()) {
    const auto b = static_cast<unsigned char>(s[pos]);
    std::size_t len = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    len = std::min(len, s.size() - pos);
    out.push_back(s.substr(pos, len));
    pos += len;
  }
  return out;
}

}  // namespace pd::chat::jinja
