#pragma once
/// Shared plumbing of the pdserve subcommands: the option sections every command may read
/// (log, model), and the YAML/env/flag loading around them.
/// Thread rules: main thread only.

#include <filesystem>
#include <string>
#include <vector>

#include "pd/common/config.h"
#include "pd/common/result.h"

namespace pd::cli {

/// Settings every role shares (sections `log:` and `model:`).
struct CommonConfig {
  std::string log_level = "info";
  /// Model folder; empty means the embedded default model (created on first use).
  std::filesystem::path model_path;
  /// Tokenizer folder (tokenizer.json + tokenizer_config.json); empty: the model folder's.
  std::filesystem::path tokenizer_path;
  /// Where the embedded default model and fetched tokenizer live.
  std::filesystem::path cache_dir;
};

void registerCommonOptions(config::OptionSet& log_set, config::OptionSet& model_set, CommonConfig& cfg);

/// The default cache folder: $PDSERVE_CACHE_DIR is read through the config module (section
/// `model`, key `cache_dir`); otherwise $XDG_CACHE_HOME/pdserve or ~/.cache/pdserve.
[[nodiscard]] std::filesystem::path defaultCacheDir();

/// Prints "error: ..." to stderr and returns the exit code for a failed command (2 for bad
/// input, 1 otherwise).
int reportFailure(const Error& error);

/// Loads options for a subcommand: `sets` are the sections it uses (all of them applied).
/// On --help prints `usage` and every option table and returns std::nullopt-like
/// help_requested. Applies log.level.
Result<config::LoadOutput> loadCommandOptions(const std::string& usage, std::vector<config::OptionSet*> sets,
                                               const std::vector<std::string>& args);

int runUp(const std::vector<std::string>& args);
int runInspect(const std::vector<std::string>& args);
int runMakeModel(const std::vector<std::string>& args);

}  // namespace pd::cli
