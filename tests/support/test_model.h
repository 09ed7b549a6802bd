#pragma once
// The e2e tests' model: a random-weight `pdserve make-model --preset default` checkpoint with the
// real DeepSeek-V3 tokenizer (PD_TOKENIZER_DIR). Needs PD_PDSERVE_BIN (pd_add_test defines both).
// Thread rules: free function; blocking (runs a process).

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "pd/common/subprocess.h"
#include "support/test_files.h"

namespace pd::test {

/// Writes the checkpoint to `dir`: a copy of the ctest fixture's (PD_TEST_DEFAULT_MODEL, set for
/// tests declared with pd_add_test(... DEFAULT_MODEL)) when there is one, else make-model's own.
/// A failure is a fatal test failure: callers that go on afterwards check
/// ::testing::Test::HasFatalFailure().
inline void makeDefaultModel(const std::filesystem::path& dir) {
  const char* shared = std::getenv("PD_TEST_DEFAULT_MODEL");
  if (shared != nullptr && std::filesystem::is_regular_file(std::filesystem::path(shared) / "config.json")) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    ASSERT_FALSE(ec) << "create " << dir << ": " << ec.message();
    std::filesystem::copy(shared, dir, std::filesystem::copy_options::recursive, ec);
    ASSERT_FALSE(ec) << "copy " << shared << " to " << dir << ": " << ec.message();
    return;
  }
  auto make = proc::Subprocess::spawn(
      {{PD_PDSERVE_BIN, "make-model", dir.string(), "--preset", "default", "--tokenizer", PD_TOKENIZER_DIR},
       {},
       false,
       false});
  ASSERT_TRUE(make.ok());
  ASSERT_EQ((*make)->wait(std::chrono::seconds(120)), 0) << "make-model failed";
}

/// A test suite whose tests share one default model folder, written once for the suite:
/// `class MySuite : public DefaultModelSuite<MySuite> {};`, then modelDir() in its tests.
template <class Suite>
class DefaultModelSuite : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_dir_ = std::make_unique<TempDir>();
    makeDefaultModel(model_dir_->path() / "m");
  }
  static void TearDownTestSuite() { model_dir_.reset(); }
  static std::string modelDir() { return (model_dir_->path() / "m").string(); }

 private:
  static inline std::unique_ptr<TempDir> model_dir_;
};

}  // namespace pd::test
