#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "pd/common/config.h"

namespace {

namespace fs = std::filesystem;
using pd::config::LoadInput;
using pd::config::OptionSet;

struct Settings {
  std::int64_t block_size = 64;
  double temperature = 1.0;
  bool verbose = false;
  std::string level = "info";
  fs::path dir;
};

struct Fixture : ::testing::Test {
  Settings s;
  Settings other;
  OptionSet set{"decode"};
  OptionSet other_set{"router"};
  fs::path tmp;

  void SetUp() override {
    set.add("block_size", &s.block_size, "tokens per block", 1, 4096)
        .add("temperature", &s.temperature, "t", 0.0, 2.0)
        .add("verbose", &s.verbose, "v")
        .add("level", &s.level, "l", {"debug", "info"})
        .add("dir", &s.dir, "d");
    other_set.add("block_size", &other.block_size, "x", 1, 4096);
    tmp = fs::temp_directory_path() / ("pd_config_test_" + std::to_string(::getpid()) + "_" +
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(tmp);
  }
  void TearDown() override { fs::remove_all(tmp); }

  fs::path writeYaml(const std::string& text) {
    const fs::path p = tmp / "config.yaml";
    std::ofstream(p) << text;
    return p;
  }

  pd::Result<pd::config::LoadOutput> load(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
    LoadInput in;
    in.args = std::move(args);
    in.environment = std::move(env);
    return pd::config::loadConfig({&set, &other_set}, {&set}, in);
  }
};

TEST_F(Fixture, DefaultsComeFromFieldsAndAppearInHelp) {
  ASSERT_TRUE(load({}).ok());
  EXPECT_EQ(s.block_size, 64);
  const std::string help = set.helpText();
  EXPECT_NE(help.find("--block_size"), std::string::npos);
  EXPECT_NE(help.find("default: 64"), std::string::npos);
  EXPECT_NE(help.find("1..4096"), std::string::npos);
  EXPECT_NE(help.find("tokens per block"), std::string::npos);
}

TEST_F(Fixture, PrecedenceIsYamlThenEnvThenFlags) {
  const auto yaml =
      writeYaml("decode:\n  block_size: 16\n  temperature: 0.5\n  level: debug\nrouter:\n  block_size: 7\n");
  auto r = load({"--config", yaml.string(), "--block-size=32", "pos1", "--verbose"},
                {{"PDSERVE_DECODE_TEMPERATURE", "0.25"}, {"PDSERVE_DECODE_BLOCK_SIZE", "8"}});
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_EQ(s.block_size, 32);            // flag beats env and file
  EXPECT_DOUBLE_EQ(s.temperature, 0.25);  // env beats file
  EXPECT_EQ(s.level, "debug");            // file beats default
  EXPECT_TRUE(s.verbose);                 // bare bool flag
  EXPECT_EQ(other.block_size, 7);         // inactive sections are still read from the file
  ASSERT_EQ(r->positionals.size(), 1u);
  EXPECT_EQ(r->positionals[0], "pos1");
}

TEST_F(Fixture, UnknownYamlKeyNamesKeyAndFile) {
  const auto yaml = writeYaml("decode:\n  blok_size: 16\n");
  auto r = load({"--config", yaml.string()});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("blok_size"), std::string::npos);
  EXPECT_NE(r.error().message.find(yaml.string()), std::string::npos);
}

TEST_F(Fixture, UnknownSectionIsAnError) {
  auto r = load({"--config", writeYaml("decoder:\n  block_size: 16\n").string()});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("unknown section 'decoder'"), std::string::npos);
}

TEST_F(Fixture, BadValuesNameKeyAndSource) {
  auto r = load({"--config", writeYaml("decode:\n  block_size: 0\n").string()});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("block_size"), std::string::npos);
  EXPECT_NE(r.error().message.find("1..4096"), std::string::npos);
  EXPECT_NE(r.error().message.find("config.yaml"), std::string::npos);

  EXPECT_FALSE(load({"--block-size", "12x"}).ok());
  EXPECT_FALSE(load({"--temperature", "nan"}).ok());
  EXPECT_FALSE(load({"--level", "loud"}).ok());
  EXPECT_FALSE(load({"--verbose=maybe"}).ok());
  EXPECT_FALSE(load({"--block-size"}).ok());
  auto env_bad = load({}, {{"PDSERVE_DECODE_BLOCK_SIZE", "-3"}});
  ASSERT_FALSE(env_bad.ok());
  EXPECT_NE(env_bad.error().message.find("PDSERVE_DECODE_BLOCK_SIZE"), std::string::npos);
}

TEST_F(Fixture, UnknownFlagsAndVariablesAreErrors) {
  auto r = load({"--no-such-flag", "1"});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("--no-such-flag"), std::string::npos);
  EXPECT_FALSE(load({}, {{"PDSERVE_DECODE_BLOK", "1"}}).ok());
  EXPECT_TRUE(load({}, {{"PDSERVE_OTHER_THING", "1"}}).ok());  // not our section
}

TEST_F(Fixture, MalformedYamlIsAClearError) {
  auto r = load({"--config", writeYaml("decode: [1, 2\n").string()});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("malformed YAML"), std::string::npos);
  auto missing = load({"--config", (tmp / "absent.yaml").string()});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, pd::ErrorCode::NotFound);
}

TEST_F(Fixture, AmbiguousFlagsNeedASection) {
  LoadInput in;
  in.args = {"--block_size", "5"};
  in.environment = std::map<std::string, std::string>{};
  auto r = pd::config::loadConfig({&set, &other_set}, {&set, &other_set}, in);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("ambiguous"), std::string::npos);
  in.args = {"--router.block_size", "5"};
  ASSERT_TRUE(pd::config::loadConfig({&set, &other_set}, {&set, &other_set}, in).ok());
  EXPECT_EQ(other.block_size, 5);
  EXPECT_EQ(s.block_size, 64);
}

TEST_F(Fixture, HelpStopsBeforeApplying) {
  auto r = load({"--help", "--block-size", "9"});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->help_requested);
  EXPECT_EQ(s.block_size, 64);
}

}  // namespace
