#pragma once
/// Typed configuration. Each role keeps a plain struct of settings; an OptionSet binds every
/// field to its name, type, default (the field's initial value), bounds and help text — the one
/// table of options. `loadConfig` fills the structs once, in `main`, from (lowest to highest
/// precedence) the defaults, a YAML file, environment variables, then command-line flags, and
/// validates everything. Unknown keys and bad values are errors naming the key and its source.
///
/// YAML layout: one top-level mapping per section (`log:`, `router:`, `prefill:`, `decode:` …),
/// keys as the option names. Environment: PDSERVE_<SECTION>_<NAME> (upper case). Flags:
/// `--name=value` or `--name value` (dashes and underscores are interchangeable); bool flags may
/// omit the value. This is the only module that reads the environment.
///
/// Thread rules: build and load on one thread (main); afterwards the structs are read-only and
/// passed down by const&.

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "pd/common/result.h"

namespace pd::config {

enum class OptionType { Bool, Int, Double, String, Path, StringList };

struct OptionInfo {
  std::string name;
  OptionType type = OptionType::String;
  std::string default_text;  ///< the field's value when the option was registered
  std::string help;
  std::string constraint;  ///< e.g. "1..1048576" or "one of: debug, info"; may be empty
};

/// Options of one section bound to fields of a config struct. The fields must outlive it.
class OptionSet {
 public:
  explicit OptionSet(std::string section);

  OptionSet& add(const std::string& name, bool* field, std::string help);
  OptionSet& add(const std::string& name, std::int64_t* field, std::string help, std::int64_t min, std::int64_t max);
  OptionSet& add(const std::string& name, double* field, std::string help, double min, double max);
  OptionSet& add(const std::string& name, std::string* field, std::string help, std::vector<std::string> choices = {});
  OptionSet& add(const std::string& name, std::filesystem::path* field, std::string help);
  /// A list of strings: a YAML sequence of scalars, or (YAML scalar, env, flag) comma-separated
  /// text; items are trimmed and empty items dropped.
  OptionSet& add(const std::string& name, std::vector<std::string>* field, std::string help);

  [[nodiscard]] const std::string& section() const { return section_; }
  [[nodiscard]] const std::vector<OptionInfo>& options() const { return infos_; }
  [[nodiscard]] bool has(std::string_view name) const;
  /// The option's type; nullopt for an unknown name.
  [[nodiscard]] std::optional<OptionType> typeOf(std::string_view name) const;
  /// Parses `text` into the option's field. `source` (file:key, flag, env var) goes in errors.
  Status set(std::string_view name, std::string_view text, std::string_view source);
  /// The help table: name, type, default, constraint, help.
  [[nodiscard]] std::string helpText() const;
  /// "name=value" for every option, for the startup log.
  [[nodiscard]] std::vector<std::string> describeValues() const;

 private:
  struct Binding {
    OptionInfo info;
    std::function<Status(std::string_view text, std::string_view source)> parse;
    std::function<std::string()> show;
  };
  Binding* lookup(std::string_view name);
  const Binding* lookup(std::string_view name) const;

  std::string section_;
  std::vector<OptionInfo> infos_;
  std::vector<Binding> bindings_;
};

struct LoadInput {
  std::optional<std::filesystem::path> yaml_file;
  std::vector<std::string> args;  ///< flags, after the subcommand; positionals are returned
  /// Environment to read; when unset, the process environment.
  std::optional<std::map<std::string, std::string>> environment;
};

struct LoadOutput {
  std::vector<std::string> positionals;
  bool help_requested = false;
};

/// Applies the YAML file to every set in `all` (so the whole file is validated, whatever the
/// role), then the environment and the flags to the sets in `active`. A flag or variable that no
/// active set knows is an error. `--config FILE` among `args` names the YAML file.
/// The per-user cache folder: $PDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pdserve, else
/// $HOME/.cache/pdserve, else ./.cache/pdserve.
[[nodiscard]] std::filesystem::path defaultCacheDir();

Result<LoadOutput> loadConfig(const std::vector<OptionSet*>& all, const std::vector<OptionSet*>& active,
                              LoadInput input);

}  // namespace pd::config
