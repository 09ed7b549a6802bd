#pragma once
/// The shared main() of the `gpu`-labelled test programs: exit 77 (ctest's SKIP_RETURN_CODE, so
/// the run is reported as Skipped, never Passed) after saying why when no CUDA device is visible;
/// exit 1 when the gtest filter selected no test, so a mistyped filter cannot pass silently.

#include <gtest/gtest.h>

#include <cstdio>

#include "pd/engine/gpu.h"

namespace pd::testutil {

/// `what` names the tests in the skip message, e.g. "the GPU parity tests".
inline int runGpuTests(int argc, char** argv, const char* what) {
  ::testing::InitGoogleTest(&argc, argv);
  if (pd::gpu::deviceCount() == 0) {
    std::printf("SKIPPED: no CUDA device visible (built with CUDA: %s); %s did not run\n",
                pd::gpu::builtWithCuda() ? "yes" : "no", what);
    return 77;
  }
  const int rc = RUN_ALL_TESTS();
  if (::testing::UnitTest::GetInstance()->test_to_run_count() == 0) {
    std::printf("FAILED: the filter selected no test, so nothing was checked\n");
    return 1;
  }
  return rc;
}

}  // namespace pd::testutil
