// SHA-256 against the FIPS 180-2 / NIST example vectors, incremental feeding at every split, and
// files (including the golden checkpoint, whose digest golden.json records).

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/sha256.h"

namespace pd {
namespace {

std::span<const std::byte> bytesOf(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

TEST(Sha256, KnownVectors) {
  EXPECT_EQ(sha256Hex(bytesOf("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256Hex(bytesOf("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // 56 bytes: the length no longer fits in the last block, so padding needs a second one.
  EXPECT_EQ(sha256Hex(bytesOf("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256Hex(bytesOf(
                "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrs"
                "mnopqrstnopqrstu")),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  const std::string million_a(1000000, 'a');
  EXPECT_EQ(sha256Hex(bytesOf(million_a)), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, IncrementalEqualsOneShotAtEverySplit) {
  std::mt19937 rng(1234);
  std::vector<std::byte> data(300);
  for (std::byte& b : data) b = static_cast<std::byte>(rng() & 0xFF);
  for (std::size_t length : {0, 1, 55, 56, 63, 64, 65, 119, 120, 128, 300}) {
    const std::span<const std::byte> whole(data.data(), length);
    const std::string want = sha256Hex(whole);
    for (std::size_t split = 0; split <= length; ++split) {
      Sha256 hasher;
      hasher.update(whole.first(split));
      hasher.update(whole.subspan(split));
      ASSERT_EQ(hasher.finishHex(), want) << "length " << length << " split " << split;
    }
    Sha256 byte_by_byte;
    for (std::size_t i = 0; i < length; ++i) byte_by_byte.update(whole.subspan(i, 1));
    EXPECT_EQ(byte_by_byte.finishHex(), want);
  }
}

TEST(Sha256, RawDigestMatchesHex) {
  Sha256 hasher;
  hasher.update(bytesOf("abc"));
  const std::array<std::uint8_t, 32> digest = hasher.finish();
  EXPECT_EQ(digest[0], 0xba);
  EXPECT_EQ(digest[31], 0xad);
}

class Sha256File : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (std::filesystem::temp_directory_path() / "pd_sha256_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::filesystem::path dir_;
};

TEST_F(Sha256File, MatchesInMemoryDigestAcrossChunks) {
  std::mt19937 rng(99);
  std::string data(3 * (1 << 20) + 17, '\0');  // crosses the reader's 1 MiB chunks
  for (char& c : data) c = static_cast<char>(rng() & 0xFF);
  const std::filesystem::path path = dir_ / "blob.bin";
  std::ofstream(path, std::ios::binary) << data;
  Result<std::string> digest = sha256File(path);
  ASSERT_TRUE(digest.ok()) << digest.error().toString();
  EXPECT_EQ(*digest, sha256Hex(bytesOf(data)));

  const std::filesystem::path abc = dir_ / "abc.txt";
  std::ofstream(abc, std::ios::binary) << "abc";
  Result<std::string> abc_digest = sha256File(abc);
  ASSERT_TRUE(abc_digest.ok());
  EXPECT_EQ(*abc_digest, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST_F(Sha256File, MissingFileIsNotFound) {
  const std::filesystem::path missing = dir_ / "missing.bin";
  Result<std::string> digest = sha256File(missing);
  ASSERT_FALSE(digest.ok());
  EXPECT_EQ(digest.error().code, ErrorCode::NotFound);
  EXPECT_NE(digest.error().message.find(missing.string()), std::string::npos);
}

TEST_F(Sha256File, DirectoryIsIo) {
  Result<std::string> digest = sha256File(dir_);
  ASSERT_FALSE(digest.ok());
  EXPECT_EQ(digest.error().code, ErrorCode::Io);
}

TEST(Sha256Golden, CheckpointDigestMatchesGoldenJson) {
  const std::filesystem::path dir = std::filesystem::path(PD_TEST_DATA_DIR) / "golden" / "tiny-bf16";
  std::ifstream in(dir / "golden.json");
  ASSERT_TRUE(in) << "missing " << (dir / "golden.json");
  std::stringstream text;
  text << in.rdbuf();
  const std::string json = text.str();
  const std::string key = "\"model_safetensors_sha256\": \"";
  const std::size_t at = json.find(key);
  ASSERT_NE(at, std::string::npos);
  const std::string want = json.substr(at + key.size(), 64);
  Result<std::string> digest = sha256File(dir / "model.safetensors");
  ASSERT_TRUE(digest.ok()) << digest.error().toString();
  EXPECT_EQ(*digest, want);
}

}  // namespace
}  // namespace pd
