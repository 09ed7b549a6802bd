#pragma once
// Values of the Jinja-subset interpreter, with Python semantics (what Hugging Face's
// apply_chat_template renders with jinja2): None, bools, ints, floats, str, list, dict
// (insertion-ordered), namespace objects, callables, and Undefined.
// Thread rules: values are plain data; lists, dicts and namespaces are shared by reference
// (as in Python) and belong to one render call.

#include <boost/json/value.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pd::chat::jinja {

class Value;
using ValueList = std::vector<Value>;
struct ValueDict;
struct Callable;

class Value {
 public:
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace, Callable };

  Value() = default;  // Undefined
  static Value none() { return Value(Kind::None); }
  static Value boolean(bool b) {
    Value v(Kind::Bool);
    v.int_ = b ? 1 : 0;
    return v;
  }
  static Value integer(std::int64_t i) {
    Value v(Kind::Int);
    v.int_ = i;
    return v;
  }
  static Value real(double d) {
    Value v(Kind::Float);
    v.float_ = d;
    return v;
  }
  static Value string(std::string s) {
    Value v(Kind::String);
    v.string_ = std::move(s);
    return v;
  }
  static Value list(ValueList items);
  static Value dict(std::shared_ptr<ValueDict> d);
  static Value emptyDict();
  static Value ns(std::shared_ptr<ValueDict> d);
  static Value callable(std::shared_ptr<const Callable> c);

  [[nodiscard]] Kind kind() const { return kind_; }
  [[nodiscard]] bool isUndefined() const { return kind_ == Kind::Undefined; }
  [[nodiscard]] bool isNone() const { return kind_ == Kind::None; }
  [[nodiscard]] bool isString() const { return kind_ == Kind::String; }
  [[nodiscard]] bool isNumber() const { return kind_ == Kind::Int || kind_ == Kind::Float || kind_ == Kind::Bool; }
  [[nodiscard]] bool isList() const { return kind_ == Kind::List; }
  [[nodiscard]] bool isDict() const { return kind_ == Kind::Dict; }
  [[nodiscard]] bool isNamespace() const { return kind_ == Kind::Namespace; }
  [[nodiscard]] bool isCallable() const { return kind_ == Kind::Callable; }

  [[nodiscard]] bool asBool() const { return int_ != 0; }
  [[nodiscard]] std::int64_t asInt() const { return int_; }
  [[nodiscard]] double asFloat() const { return kind_ == Kind::Float ? float_ : static_cast<double>(int_); }
  [[nodiscard]] const std::string& asString() const { return string_; }
  [[nodiscard]] const std::shared_ptr<ValueList>& listPtr() const { return list_; }
  [[nodiscard]] const std::shared_ptr<ValueDict>& dictPtr() const { return dict_; }
  [[nodiscard]] const std::shared_ptr<const Callable>& callablePtr() const { return callable_; }

  /// Python truthiness (Undefined is false).
  [[nodiscard]] bool truthy() const;
  /// Python str(): what {{ value }} prints (Undefined prints nothing).
  [[nodiscard]] std::string str() const;
  /// Python repr() (strings quoted), used inside containers.
  [[nodiscard]] std::string repr() const;
  /// Python ==.
  [[nodiscard]] bool equals(const Value& other) const;
  /// Python-style type name for error messages.
  [[nodiscard]] std::string_view typeName() const;

 private:
  explicit Value(Kind kind) : kind_(kind) {}
  Kind kind_ = Kind::Undefined;
  std::int64_t int_ = 0;
  double float_ = 0;
  std::string string_;
  std::shared_ptr<ValueList> list_;
  std::shared_ptr<ValueDict> dict_;  // ValueDict and Namespace
  std::shared_ptr<const Callable> callable_;
};

/// Insertion-ordered string-keyed map (Python dict with str keys).
struct ValueDict {
  std::vector<std::pair<std::string, Value>> items;
  [[nodiscard]] const Value* find(std::string_view key) const;
  void set(std::string key, Value value);
};

/// Converts parsed JSON (objects keep their key order).
[[nodiscard]] Value fromJson(const boost::json::value& json);

/// Python json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys) with the
/// default separators (", " and ": ", or "," and ": " when indented). indent < 0: none.
/// False if the value holds something JSON cannot express (Undefined, callables).
[[nodiscard]] bool toJson(const Value& value, int indent, bool sort_keys, std::string& out);

/// Code points of a UTF-8 string (Python indexes str by code point).
[[nodiscard]] std::vector<std::string_view> codePoints(std::string_view s);

}  // namespace pd::chat::jinja
