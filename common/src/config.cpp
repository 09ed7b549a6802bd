#include "pd/common/config.h"

#include <fmt/format.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>

extern char** environ;  // POSIX; read only here (STYLE: no getenv outside the config module)

namespace pd::config {
namespace {

std::string normalizeName(std::string_view name) {
  std::string out(name);
  std::replace(out.begin(), out.end(), '-', '_');
  return out;
}

std::string typeName(OptionType type) {
  switch (type) {
    case OptionType::Bool:
      return "bool";
    case OptionType::Int:
      return "int";
    case OptionType::Double:
      return "float";
    case OptionType::String:
      return "string";
    case OptionType::Path:
      return "path";
    case OptionType::StringList:
      return "list";
  }
  return "?";
}

Error badValue(std::string_view source, std::string_view name, std::string_view text, std::string_view why) {
  return makeError(ErrorCode::InvalidArgument,
                   fmt::format("{}: invalid value '{}' for '{}': {}", source, text, name, why));
}

std::string formatDouble(double v) {
  return fmt::format("{}", v);
}

}  // namespace

OptionSet::OptionSet(std::string section) : section_(std::move(section)) {}

OptionSet& OptionSet::add(const std::string& name, bool* field, std::string help) {
  PD_CHECK(field != nullptr);
  Binding b;
  b.info = {name, OptionType::Bool, *field ? "true" : "false", std::move(help), "true or false"};
  b.parse = [field, name](std::string_view text, std::string_view source) -> Status {
    if (text == "true" || text == "1" || text == "yes" || text == "on") {
      *field = true;
      return okStatus();
    }
    if (text == "false" || text == "0" || text == "no" || text == "off") {
      *field = false;
      return okStatus();
    }
    return badValue(source, name, text, "expected true or false");
  };
  b.show = [field] { return std::string(*field ? "true" : "false"); };
  infos_.push_back(b.info);
  bindings_.push_back(std::move(b));
  return *this;
}

OptionSet& OptionSet::add(const std::string& name, std::int64_t* field, std::string help, std::int64_t min,
                          std::int64_t max) {
  PD_CHECK(field != nullptr);
  PD_CHECK(min <= *field && *field <= max);
  Binding b;
  b.info = {name, OptionType::Int, std::to_string(*field), std::move(help), fmt::format("{}..{}", min, max)};
  b.parse = [field, name, min, max](std::string_view text, std::string_view source) -> Status {
    std::int64_t v = 0;
    const auto* end = text.data() + text.size();
    // NOLINTNEXTLINE(bugprone-suspicious-stringview-data-usage): [data, end) is the whole view.
    auto [ptr, ec] = std::from_chars(text.data(), end, v);
    if (ec != std::errc() || ptr != end || text.empty()) return badValue(source, name, text, "expected an integer");
    if (v < min || v > max) return badValue(source, name, text, fmt::format("must be in {}..{}", min, max));
    *field = v;
    return okStatus();
  };
  b.show = [field] { return std::to_string(*field); };
  infos_.push_back(b.info);
  bindings_.push_back(std::move(b));
  return *this;
}

OptionSet& OptionSet::add(const std::string& name, double* field, std::string help, double min, double max) {
  PD_CHECK(field != nullptr);
  Binding b;
  b.info = {name, OptionType::Double, formatDouble(*field), std::move(help),
            fmt::format("{}..{}", formatDouble(min), formatDouble(max))};
  b.parse = [field, name, min, max](std::string_view text, std::string_view source) -> Status {
    const std::string copy(text);
    char* end = nullptr;
    const double v = std::strtod(copy.c_str(), &end);
    if (copy.empty() || end != copy.c_str() + copy.size() || !std::isfinite(v)) {
      return badValue(source, name, text, "expected a finite number");
    }
    if (v < min || v > max) {
      return badValue(source, name, text, fmt::format("must be in {}..{}", formatDouble(min), formatDouble(max)));
    }
    *field = v;
    return okStatus();
  };
  b.show = [field] { return formatDouble(*field); };
  infos_.push_back(b.info);
  bindings_.push_back(std::move(b));
  return *this;
}

OptionSet& OptionSet::add(const std::string& name, std::string* field, std::string help,
                          std::vector<std::string> choices) {
  PD_CHECK(field != nullptr);
  Binding b;
  std::string constraint;
  if (!choices.empty()) constraint = "one of: " + fmt::format("{}", fmt::join(choices, ", "));
  b.info = {name, OptionType::String, *field, std::move(help), constraint};
  b.parse = [field, name, choices, constraint](std::string_view text, std::string_view source) -> Status {
    if (!choices.empty() && std::find(choices.begin(), choices.end(), text) == choices.end()) {
      return badValue(source, name, text, constraint);
    }
    *field = std::string(text);
    return okStatus();
  };
  b.show = [field] { return *field; };
  infos_.push_back(b.info);
  bindings_.push_back(std::move(b));
  return *this;
}

OptionSet& OptionSet::add(const std::string& name, std::filesystem::path* field, std::string help) {
  PD_CHECK(field != nullptr);
  Binding b;
  b.info = {name, OptionType::Path, field->string(), std::move(help), ""};
  b.parse = [field](std::string_view text, std::string_view /*source*/) -> Status {
    *field = std::filesystem::path(std::string(text));
    return okStatus();
  };
  b.show = [field] { return field->string(); };
  infos_.push_back(b.info);
  bindings_.push_back(std::move(b));
  return *this;
}

OptionSet& OptionSet::add(const std::string& name, std::vector<std::string>* field, std::string help) {
  PD_CHECK(field != nullptr);
  Binding b;
  b.info = {name, OptionType::StringList, fmt::format("{}", fmt::join(*field, ",")), std::move(help),
            "comma-separated"};
  b.parse = [field](std::string_view text, std::string_view /*source*/) -> Status {
    std::vector<std::string> items;
    while (!text.empty()) {
      const auto comma = text.find(',');
      std::string_view item = text.substr(0, comma);
      text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
      while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front())) != 0) item.remove_prefix(1);
      while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back())) != 0) item.remove_suffix(1);
      if (!item.empty()) items.emplace_back(item);
    }
    *field = std::move(items);
    return okStatus();
  };
  b.show = [field] { return fmt::format("{}", fmt::join(*field, ",")); };
  infos_.push_back(b.info);
  bindings_.push_back(std::move(b));
  return *this;
}

OptionSet::Binding* OptionSet::lookup(std::string_view name) {
  const std::string key = normalizeName(name);
  for (auto& b : bindings_) {
    if (b.info.name == key) return &b;
  }
  return nullptr;
}

const OptionSet::Binding* OptionSet::lookup(std::string_view name) const {
  return const_cast<OptionSet*>(this)->lookup(name);  // NOLINT(cppcoreguidelines-pro-type-const-cast)
}

bool OptionSet::has(std::string_view name) const {
  return lookup(name) != nullptr;
}

std::optional<OptionType> OptionSet::typeOf(std::string_view name) const {
  const Binding* b = lookup(name);
  if (b == nullptr) return std::nullopt;
  return b->info.type;
}

Status OptionSet::set(std::string_view name, std::string_view text, std::string_view source) {
  Binding* b = lookup(name);
  if (b == nullptr) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("{}: unknown option '{}' in section '{}'", source, name, section_));
  }
  return b->parse(text, source);
}

std::string OptionSet::helpText() const {
  std::string out = fmt::format("  [{}]\n", section_);
  for (const auto& i : infos_) {
    out += fmt::format("    --{:<26} {:<6} default: {}{}\n", i.name, typeName(i.type),
                       i.default_text.empty() ? "\"\"" : i.default_text,
                       i.constraint.empty() ? "" : "  (" + i.constraint + ")");
    out += fmt::format("        {}\n", i.help);
  }
  return out;
}

std::vector<std::string> OptionSet::describeValues() const {
  std::vector<std::string> out;
  out.reserve(bindings_.size());
  for (const auto& b : bindings_) out.push_back(fmt::format("{}.{}={}", section_, b.info.name, b.show()));
  return out;
}

namespace {

OptionSet* findSet(const std::vector<OptionSet*>& sets, std::string_view section) {
  for (auto* s : sets) {
    if (s->section() == section) return s;
  }
  return nullptr;
}

Status applyYaml(const std::vector<OptionSet*>& all, const std::filesystem::path& file) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(file.string());
  } catch (const YAML::BadFile&) {
    return makeError(ErrorCode::NotFound, fmt::format("{}: cannot read config file", file.string()));
  } catch (const YAML::Exception& e) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("{}: malformed YAML: {}", file.string(), e.what()));
  }
  if (root.IsNull()) return okStatus();
  if (!root.IsMap()) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("{}: top level must be a mapping of sections", file.string()));
  }
  for (const auto& section : root) {
    const std::string section_name = section.first.as<std::string>();
    OptionSet* set = findSet(all, section_name);
    if (set == nullptr) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("{}: unknown section '{}'", file.string(), section_name));
    }
    if (section.second.IsNull()) continue;
    if (!section.second.IsMap()) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("{}: section '{}' must be a mapping", file.string(), section_name));
    }
    for (const auto& kv : section.second) {
      const std::string key = kv.first.as<std::string>();
      const std::string source = fmt::format("{}: {}.{}", file.string(), section_name, key);
      if (!set->has(key)) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("{}: unknown key '{}' in section '{}'", file.string(), key, section_name));
      }
      if (kv.second.IsSequence() && set->typeOf(key) == OptionType::StringList) {
        std::vector<std::string> items;
        for (const auto& item : kv.second) {
          if (!item.IsScalar() || item.Scalar().find(',') != std::string::npos) {
            return makeError(ErrorCode::InvalidArgument,
                             fmt::format("{}: expected a list of plain values (no commas)", source));
          }
          items.push_back(item.Scalar());
        }
        PD_TRY(set->set(key, fmt::format("{}", fmt::join(items, ",")), source));
        continue;
      }
      if (!kv.second.IsScalar()) {
        return makeError(ErrorCode::InvalidArgument, fmt::format("{}: expected a scalar value", source));
      }
      PD_TRY(set->set(key, kv.second.Scalar(), source));
    }
  }
  return okStatus();
}

std::map<std::string, std::string> processEnvironment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view entry(*e);
    const auto eq = entry.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(entry.substr(0, eq)), std::string(entry.substr(eq + 1)));
  }
  return env;
}

std::string envName(std::string_view section, std::string_view option) {
  std::string out = "PDSERVE_";
  for (char c : section) out += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  out += '_';
  for (char c : option) out += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

std::filesystem::path defaultCacheDir() {
  const auto env = processEnvironment();
  auto get = [&env](const char* name) -> std::string {
    auto it = env.find(name);
    return it == env.end() ? std::string() : it->second;
  };
  if (auto v = get("PDSERVE_CACHE_DIR"); !v.empty()) return v;
  if (auto v = get("XDG_CACHE_HOME"); !v.empty()) return std::filesystem::path(v) / "pdserve";
  if (auto v = get("HOME"); !v.empty()) return std::filesystem::path(v) / ".cache" / "pdserve";
  return std::filesystem::path(".cache") / "pdserve";
}

Result<LoadOutput> loadConfig(const std::vector<OptionSet*>& all, const std::vector<OptionSet*>& active,
                              LoadInput input) {
  LoadOutput out;
  // First pass: find --config and --help; everything else is applied after the file.
  struct Flag {
    std::string section;
    std::string name;
    std::string value;
  };
  std::vector<Flag> flags;
  for (size_t i = 0; i < input.args.size(); ++i) {
    const std::string& arg = input.args[i];
    if (arg == "--help" || arg == "-h") {
      out.help_requested = true;
      continue;
    }
    if (arg == "--") {
      out.positionals.insert(out.positionals.end(), input.args.begin() + static_cast<long>(i) + 1, input.args.end());
      break;
    }
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      out.positionals.push_back(arg);
      continue;
    }
    std::string name = arg.substr(2);
    std::optional<std::string> value;
    if (const auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    name = normalizeName(name);
    if (name == "config") {
      if (!value) {
        if (i + 1 >= input.args.size()) return makeError(ErrorCode::InvalidArgument, "--config needs a file");
        value = input.args[++i];
      }
      input.yaml_file = std::filesystem::path(*value);
      continue;
    }
    // Find the option (section-qualified as --section.name, or unique among active sections)
    // to know whether a bare flag is a bool.
    std::string section;
    if (const auto dot = name.find('.'); dot != std::string::npos) {
      section = name.substr(0, dot);
      name = name.substr(dot + 1);
    }
    const config::OptionInfo* info = nullptr;
    std::string found_section;
    int matches = 0;
    for (auto* s : active) {
      if (!section.empty() && s->section() != section) continue;
      for (const auto& o : s->options()) {
        if (o.name == name) {
          info = &o;
          ++matches;
          found_section = s->section();
        }
      }
    }
    section = found_section;
    if (info == nullptr) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("unknown flag '{}' (see --help)", arg));
    }
    if (matches > 1) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("flag '--{}' is ambiguous here: qualify it as --<section>.{}", name, name));
    }
    if (!value) {
      const bool next_is_value = i + 1 < input.args.size() && input.args[i + 1].rfind("--", 0) != 0;
      if (info->type == OptionType::Bool) {
        if (next_is_value && (input.args[i + 1] == "true" || input.args[i + 1] == "false")) {
          value = input.args[++i];
        } else {
          value = "true";
        }
      } else {
        if (!next_is_value)
          return makeError(ErrorCode::InvalidArgument, fmt::format("flag '--{}' needs a value", name));
        value = input.args[++i];
      }
    }
    flags.push_back({section, name, *value});
  }
  if (out.help_requested) return out;

  if (input.yaml_file) PD_TRY(applyYaml(all, *input.yaml_file));

  const auto env = input.environment ? *input.environment : processEnvironment();
  for (auto* s : active) {
    for (const auto& o : s->options()) {
      const std::string var = envName(s->section(), o.name);
      if (auto it = env.find(var); it != env.end()) PD_TRY(s->set(o.name, it->second, "environment " + var));
    }
  }
  // Unknown PDSERVE_* variables of an active section are mistakes worth reporting.
  for (const auto& [var, value] : env) {
    for (auto* s : active) {
      const std::string prefix = envName(s->section(), "");
      if (var.rfind(prefix, 0) != 0) continue;
      bool known = false;
      for (const auto& o : s->options()) known = known || envName(s->section(), o.name) == var;
      if (!known) return makeError(ErrorCode::InvalidArgument, fmt::format("environment {}: unknown option", var));
    }
  }

  for (const auto& f : flags) {
    OptionSet* set = findSet(active, f.section);
    PD_CHECK(set != nullptr);
    PD_TRY(set->set(f.name, f.value, "flag --" + f.section + "." + f.name));
  }
  return out;
}

}  // namespace pd::config
