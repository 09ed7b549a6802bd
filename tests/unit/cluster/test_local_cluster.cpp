// pdserve up's pure parts (local_cluster.h, cluster_supervisor.h): the short flags, the port
// check, the resolved settings file, the restart backoff.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cluster/cluster_supervisor.h"
#include "cluster/local_cluster.h"
#include "support/test_files.h"

namespace pd::cluster {
namespace {

using std::chrono::milliseconds;

TEST(LocalCluster, ShortFlagsBecomeTheLongNames) {
  const std::vector<std::string> in{"--model", "/m", "--prefill=2", "--tp",           "4", "--smoke", "--port=0",
                                    "--mtp",   "1",  "--modelx",    "--decode.port=9"};
  const std::vector<std::string> want{"--model.path",
                                      "/m",
                                      "--up.prefill=2",
                                      "--decode.tensor_parallel",
                                      "4",
                                      "--up.smoke",
                                      "--router.port=0",
                                      "--decode.num_speculative_tokens",
                                      "1",
                                      "--modelx",
                                      "--decode.port=9"};
  EXPECT_EQ(expandUpAliases(in), want);
  EXPECT_EQ(expandUpAliases({"--device", "cuda", "--device=cuda:1", "--devices"}),
            (std::vector<std::string>{"--model.device", "cuda", "--model.device=cuda:1", "--devices"}));
}

TEST(LocalCluster, OneGpuIsSplitEquallyBetweenTheWorkers) {
  auto one_each = splitGpuMemory(0.9, 1, 1);
  ASSERT_TRUE(one_each.ok()) << one_each.error().toString();
  EXPECT_DOUBLE_EQ(one_each->prefill, 0.45);
  EXPECT_DOUBLE_EQ(one_each->decode, 0.45);
  auto three = splitGpuMemory(0.6, 1, 2);
  ASSERT_TRUE(three.ok());
  EXPECT_DOUBLE_EQ(three->prefill + 2 * three->decode, 0.6);  // never more than the cluster's part
  for (double bad : {0.0, -0.5, 1.5}) {
    EXPECT_EQ(splitGpuMemory(bad, 1, 1).error().code, pd::ErrorCode::InvalidArgument) << bad;
  }
  EXPECT_EQ(splitGpuMemory(0.9, 0, 0).error().code, pd::ErrorCode::InvalidArgument);
}

TEST(LocalCluster, SeveralWorkersOfARoleNeedPortZero) {
  UpConfig cfg;
  EXPECT_TRUE(validateUpConfig(cfg, 8100, 8200).ok()) << "one of each may have a fixed port";
  cfg.prefill_workers = 2;
  auto s = validateUpConfig(cfg, 8100, 0);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::InvalidArgument);
  EXPECT_NE(s.error().message.find("prefill.port"), std::string::npos);
  EXPECT_TRUE(validateUpConfig(cfg, 0, 8200).ok());
  cfg.decode_workers = 3;
  s = validateUpConfig(cfg, 0, 8200);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find("decode.port"), std::string::npos);
}

TEST(LocalCluster, ResolvedSettingsFileQuotesEveryValue) {
  std::string name = R"(a "quoted" \ name)";
  std::int64_t workers = 3;
  config::OptionSet set("router");
  set.add("served_model_name", &name, "a name").add("io_threads", &workers, "threads", 1, 64);
  test::TempDir dir;
  const auto file = dir.path() / "config.yaml";
  ASSERT_TRUE(writeResolvedConfig(file, {&set}).ok());
  EXPECT_EQ(test::readFile(file),
            "router:\n"
            "  served_model_name: \"a \\\"quoted\\\" \\\\ name\"\n"
            "  io_threads: \"3\"\n");
  auto bad = writeResolvedConfig(dir.path() / "no" / "such" / "dir.yaml", {&set});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, ErrorCode::Io);
}

TEST(ClusterSupervisor, RestartDelayDoublesUpToTheMaximum) {
  RestartPolicy p;
  p.backoff_initial = milliseconds(500);
  p.backoff_max = milliseconds(3000);
  EXPECT_EQ(restartDelay(p, 0), milliseconds(500));
  EXPECT_EQ(restartDelay(p, 1), milliseconds(1000));
  EXPECT_EQ(restartDelay(p, 2), milliseconds(2000));
  EXPECT_EQ(restartDelay(p, 3), milliseconds(3000));
  EXPECT_EQ(restartDelay(p, 60), milliseconds(3000)) << "no overflow after many restarts";
  p.backoff_initial = milliseconds(0);
  EXPECT_EQ(restartDelay(p, 5), milliseconds(0));
}

}  // namespace
}  // namespace pd::cluster
