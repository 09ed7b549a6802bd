#pragma once
// Runs the pdserve binary under test (PD_PDSERVE_BIN, set for every test target by pd_add_test)
// as a child process through the shell, with stdin fed from a string and stdout and stderr
// captured whole: the one runner the CLI tests share.

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "support/test_files.h"

namespace pd::test {

struct CommandResult {
  int exit_code = -1;  ///< -1 when the process did not exit normally
  std::string out;
  std::string err;
  std::vector<std::string> lines;  ///< `out` split at newlines
};

/// `arg` as one single-quoted shell word.
inline std::string shellQuote(const std::string& arg) {
  std::string q = "'";
  for (const char ch : arg) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

/// Runs `pdserve <command_line>`: the arguments as the shell splits `command_line`.
inline CommandResult pdserveCommandLine(const std::string& command_line, const std::string& input = {}) {
  TempDir io;
  std::ofstream(io.path() / "in", std::ios::binary) << input;
  const std::string cmd = shellQuote(PD_PDSERVE_BIN) + " " + command_line + " <" +
                          shellQuote((io.path() / "in").string()) + " >" + shellQuote((io.path() / "out").string()) +
                          " 2>" + shellQuote((io.path() / "err").string());
  const int status = std::system(cmd.c_str());
  CommandResult r;
  r.exit_code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = readFile(io.path() / "out");
  r.err = readFile(io.path() / "err");
  std::istringstream out(r.out);
  for (std::string line; std::getline(out, line);) r.lines.push_back(line);
  return r;
}

/// Runs `pdserve args...`, each argument passed as one word.
inline CommandResult pdserve(const std::vector<std::string>& args, const std::string& input = {}) {
  std::string command_line;
  for (const auto& a : args) command_line += (command_line.empty() ? "" : " ") + shellQuote(a);
  return pdserveCommandLine(command_line, input);
}

}  // namespace pd::test
