// Runs the real pdserve binary: `pdserve bench decode --json` on a small generated model prints one
// JSON object with the batch sweep, `mbu_batch1`, the MTP rows and `mtp_speedup_over_ideal`; the
// bench-only draft override is accepted exactly as often as it proposes the greedy token (p = 0
// and p = 1), and bad options are refused with exit code 2.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "support/cli_runner.h"

namespace {

using pd::test::CommandResult;
using pd::test::pdserveCommandLine;

// The number after `"key": ` at or after `from`; NaN when absent.
double number(const std::string& json, const std::string& key, std::size_t from = 0) {
  const std::string needle = "\"" + key + "\": ";
  const std::size_t at = json.find(needle, from);
  if (at == std::string::npos) return std::nan("");
  return std::strtod(json.c_str() + at + needle.size(), nullptr);
}

TEST(BenchDecodeCli, JsonHasTheSweepAndTheMtpRatios) {
  const CommandResult r = pdserveCommandLine(
      "bench decode --preset tiny --batches 1,4 --steps 2 --context 32 --mtp-tokens 12 --bandwidth-mb 64 "
      "--threads 1 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  ASSERT_FALSE(r.out.empty());
  EXPECT_EQ(r.out.front(), '{');
  EXPECT_EQ(r.out.find('\n'), r.out.size() - 1) << "not one line";
  const double mbu1 = number(r.out, "mbu_batch1");
  EXPECT_GT(mbu1, 0.0);
  const double over_ideal = number(r.out, "mtp_speedup_over_ideal");
  EXPECT_GT(over_ideal, 0.0);
  EXPECT_GT(number(r.out, "read_bandwidth_gbs"), 0.0);
  EXPECT_NE(r.out.find("\"batch\": 4"), std::string::npos);
  // The override's rows: p = 0 never accepted, p = 1 always.
  const std::size_t p0 = r.out.find("\"p\": 0.00");
  const std::size_t p1 = r.out.find("\"p\": 1.00");
  ASSERT_NE(p0, std::string::npos);
  ASSERT_NE(p1, std::string::npos);
  EXPECT_EQ(number(r.out, "acceptance_rate", p0), 0.0);
  EXPECT_EQ(number(r.out, "acceptance_rate", p1), 1.0);
  EXPECT_NE(r.out.find("bench-only"), std::string::npos);
}

TEST(BenchDecodeCli, BadOptionsAreRefused) {
  EXPECT_EQ(pdserveCommandLine("bench decode --preset tiny --batches 0 --json").exit_code, 2);
  EXPECT_EQ(pdserveCommandLine("bench decode --preset tiny --mtp-k x --json").exit_code, 2);
  EXPECT_EQ(pdserveCommandLine("bench decode --preset no-such-preset --json").exit_code, 2);
}

}  // namespace
