// bench serve's sweep checks and level sizes (bench_serve.h).
#include <gtest/gtest.h>

#include "bench/serve/bench_serve.h"

namespace pd::bench {
namespace {

TEST(BenchServeSweep, LevelsAreConcurrenciesOrRates) {
  ServeBenchConfig cfg;
  cfg.concurrency = "1,8";
  auto levels = serveLevels(cfg);
  ASSERT_TRUE(levels.ok()) << levels.error().toString();
  EXPECT_EQ(*levels, (std::vector<double>{1, 8}));
  cfg.request_rate = "0.5,2";
  levels = serveLevels(cfg);
  ASSERT_TRUE(levels.ok()) << levels.error().toString();
  EXPECT_EQ(*levels, (std::vector<double>{0.5, 2})) << "rates replace the concurrencies";
}

TEST(BenchServeSweep, RejectsWhatTheOptionTableCannot) {
  ServeBenchConfig cfg;
  for (const char* bad : {"1.5", "4097", "0", "x"}) {
    cfg.concurrency = bad;
    auto r = serveLevels(cfg);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().code, ErrorCode::InvalidArgument) << bad;
  }
  cfg.concurrency = "1";
  cfg.token_id_min = 500;
  cfg.token_id_max = 500;
  auto r = serveLevels(cfg);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("--token-id-min"), std::string::npos);
  cfg.token_id_max = 0;  // 0: the served vocabulary, no bound to check
  EXPECT_TRUE(serveLevels(cfg).ok());
}

TEST(BenchServeSweep, LevelSizesOfBothModes) {
  ServeBenchConfig cfg;
  LevelSize s = levelSize(cfg, 2);
  EXPECT_EQ(s.workers, 2);
  EXPECT_EQ(s.requests, 16) << "max(16, 4 x 2)";
  EXPECT_EQ(s.warmup, 2) << "one per worker";
  s = levelSize(cfg, 32);
  EXPECT_EQ(s.requests, 128);
  cfg.num_prompts = 7;
  cfg.warmup = 0;
  s = levelSize(cfg, 32);
  EXPECT_EQ(s.requests, 7);
  EXPECT_EQ(s.warmup, 0);

  ServeBenchConfig rate;
  rate.request_rate = "5";
  rate.max_concurrency = 3;
  s = levelSize(rate, 5);
  EXPECT_EQ(s.workers, 3);
  EXPECT_EQ(s.requests, 100) << "20 s of arrivals";
  EXPECT_EQ(s.warmup, 3) << "min(4, workers)";
  EXPECT_EQ(levelSize(rate, 0.1).requests, 16);
  EXPECT_EQ(levelSize(rate, 1e6).requests, 10000);
}

}  // namespace
}  // namespace pd::bench
