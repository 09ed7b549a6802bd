#pragma once
// File helpers shared by tests: the golden data folder, whole-file reads, and a temporary
// folder removed with everything in it when the test ends.
// Thread rules: TempDir has one owner (not copyable or movable); the functions are reentrant.

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

namespace pd::test {

/// tests/data/golden (PD_TEST_DATA_DIR is set for every test target by pd_add_test).
inline std::filesystem::path goldenDir() {
  return std::filesystem::path(PD_TEST_DATA_DIR) / "golden";
}

/// The whole file as bytes; empty when it cannot be read.
inline std::string readFile(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "pd_test_XXXXXX").string();
    const char* made = ::mkdtemp(tmpl.data());
    if (made == nullptr) ADD_FAILURE() << "mkdtemp failed for " << tmpl;
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  TempDir(TempDir&&) = delete;
  TempDir& operator=(TempDir&&) = delete;

  [[nodiscard]] const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace pd::test
