#pragma once
// The e2e tests' model: a random-weight `pdserve make-model --preset default` checkpoint with the
// real DeepSeek-V3 tokenizer (PD_TOKENIZER_DIR). Needs PD_PDSERVE_BIN (pd_add_test defines both).
// Thread rules: free function; blocking (runs a process).

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>

#include "pd/common/subprocess.h"

namespace pd::test {

/// Writes the checkpoint to `dir`. A failure is a fatal test failure: callers that go on
/// afterwards check ::testing::Test::HasFatalFailure().
inline void makeDefaultModel(const std::filesystem::path& dir) {
  auto make = proc::Subprocess::spawn(
      {{PD_PDSERVE_BIN, "make-model", dir.string(), "--preset", "default", "--tokenizer", PD_TOKENIZER_DIR},
       {},
       false,
       false});
  ASSERT_TRUE(make.ok());
  ASSERT_EQ((*make)->wait(std::chrono::seconds(120)), 0) << "make-model failed";
}

}  // namespace pd::test
