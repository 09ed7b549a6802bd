// Safetensors reader, checkpoint and writer: the golden checkpoints, write/read round trips,
// sharded checkpoints, one test per kind of corruption, and a seeded random-mutation run.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iostream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/dtype.h"
#include "pd/engine/safetensors.h"

namespace pd {
namespace {

namespace fs = std::filesystem;

fs::path goldenDir(std::string_view model) {
  return fs::path(PD_TEST_DATA_DIR) / "golden" / std::string(model);
}

std::vector<std::byte> readFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(chars.size());
  std::memcpy(out.data(), chars.data(), chars.size());
  return out;
}

void writeFile(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(std::uint64_t v) {
  std::string out(8, '\0');
  for (std::size_t i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return out;
}

// A safetensors image: length prefix, header text, data.
std::string image(std::string_view header, std::string_view data = {}) {
  return le64(header.size()) + std::string(header) + std::string(data);
}

std::uint64_t headerLength(std::span<const std::byte> bytes) {
  std::uint64_t len = 0;
  for (std::size_t i = 0; i < 8; ++i)
    len |= static_cast<std::uint64_t>(std::to_integer<std::uint8_t>(bytes[i])) << (8 * i);
  return len;
}

std::span<const std::byte> bytesOf(const std::vector<std::uint8_t>& v) {
  return std::as_bytes(std::span(v));
}

template <class T>
::testing::AssertionResult isError(const Result<T>& result, ErrorCode code,
                                   std::initializer_list<std::string_view> mentions) {
  if (result.ok()) return ::testing::AssertionFailure() << "succeeded; expected " << errorCodeName(code);
  const Error& error = result.error();
  if (error.code != code) {
    return ::testing::AssertionFailure() << "got '" << error.toString() << "'; expected code " << errorCodeName(code);
  }
  for (const std::string_view mention : mentions) {
    if (error.message.find(mention) == std::string::npos) {
      return ::testing::AssertionFailure() << "message '" << error.message << "' does not mention '" << mention << "'";
    }
  }
  return ::testing::AssertionSuccess() << error.toString();
}

class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::temp_directory_path() / "pd_safetensors_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes `bytes` to dir_/name and opens it.
  Result<SafetensorsFile> openImage(std::string_view bytes, const std::string& name = "bad.safetensors") {
    writeFile(dir_ / name, bytes);
    return SafetensorsFile::open(dir_ / name);
  }

  fs::path dir_;
};

// ---------------------------------------------------------------------------------------------
// Golden checkpoints (tests/data/golden/README.md section 2)

void expectTensor(const Checkpoint& ckpt, const std::string& name, DType dtype, std::vector<std::int64_t> shape) {
  const TensorView* t = ckpt.find(name);
  ASSERT_NE(t, nullptr) << name;
  EXPECT_EQ(t->dtype, dtype) << name;
  EXPECT_EQ(t->shape, shape) << name;
}

// Layers 0-2 plus the MTP layer 3: q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o, and the two
// layer norms. Layer 0 is dense (gate/up/down); layers 1-3 are MoE: router weight and bias,
// 16 experts x 3, one shared expert x 3. Globals: embed, final norm, lm_head. MTP extras: enorm,
// hnorm, eh_proj, shared_head.norm, shared_head.head, embed_tokens.
constexpr std::size_t kTinyTensorCount = 4 * 9 + 3 + 3 * (2 + 16 * 3 + 3) + 3 + 6;
// FP8 quantizes the 5 attention projections of 4 layers, the dense MLP and every expert MLP;
// each quantized weight gains an F32 weight_scale_inv.
constexpr std::size_t kTinyQuantizedCount = 4 * 5 + 3 + 3 * (16 * 3 + 3);

TEST(SafetensorsGolden, TinyBf16MatchesReadme) {
  const fs::path dir = goldenDir("tiny-bf16");
  Result<Checkpoint> opened = Checkpoint::open(dir);
  ASSERT_TRUE(opened.ok()) << opened.error().toString();
  const Checkpoint& ckpt = *opened;
  ASSERT_EQ(ckpt.files().size(), 1U);
  EXPECT_EQ(ckpt.files()[0].metadata().at("format"), "pt");

  const std::vector<const TensorView*> tensors = ckpt.tensors();
  EXPECT_EQ(tensors.size(), kTinyTensorCount);
  EXPECT_EQ(tensors.size(), 207U);
  EXPECT_TRUE(std::is_sorted(tensors.begin(), tensors.end(),
                             [](const TensorView* a, const TensorView* b) { return a->name < b->name; }));
  std::map<DType, std::size_t> by_dtype;
  for (const TensorView* t : tensors) {
    ++by_dtype[t->dtype];
    EXPECT_EQ(t->data.size(), static_cast<std::size_t>(t->numel()) * dtypeSize(t->dtype)) << t->name;
    EXPECT_EQ(std::bit_cast<std::uintptr_t>(t->data.data()) % dtypeSize(t->dtype), 0U) << t->name;
  }
  EXPECT_EQ(by_dtype[DType::F32], 3U);  // the three e_score_correction_bias
  EXPECT_EQ(by_dtype[DType::BF16], 204U);

  expectTensor(ckpt, "model.embed_tokens.weight", DType::BF16, {2048, 256});
  expectTensor(ckpt, "lm_head.weight", DType::BF16, {2048, 256});
  expectTensor(ckpt, "model.norm.weight", DType::BF16, {256});
  expectTensor(ckpt, "model.layers.0.self_attn.q_a_proj.weight", DType::BF16, {96, 256});
  expectTensor(ckpt, "model.layers.0.self_attn.q_b_proj.weight", DType::BF16, {192, 96});
  expectTensor(ckpt, "model.layers.2.self_attn.kv_a_proj_with_mqa.weight", DType::BF16, {80, 256});
  expectTensor(ckpt, "model.layers.1.self_attn.kv_b_proj.weight", DType::BF16, {256, 64});
  expectTensor(ckpt, "model.layers.0.self_attn.o_proj.weight", DType::BF16, {256, 128});
  expectTensor(ckpt, "model.layers.0.mlp.gate_proj.weight", DType::BF16, {512, 256});
  expectTensor(ckpt, "model.layers.0.mlp.down_proj.weight", DType::BF16, {256, 512});
  expectTensor(ckpt, "model.layers.1.mlp.gate.weight", DType::BF16, {16, 256});
  expectTensor(ckpt, "model.layers.2.mlp.gate.e_score_correction_bias", DType::F32, {16});
  expectTensor(ckpt, "model.layers.1.mlp.experts.15.up_proj.weight", DType::BF16, {64, 256});
  expectTensor(ckpt, "model.layers.2.mlp.experts.0.down_proj.weight", DType::BF16, {256, 64});
  expectTensor(ckpt, "model.layers.1.mlp.shared_experts.down_proj.weight", DType::BF16, {256, 64});
  expectTensor(ckpt, "model.layers.3.eh_proj.weight", DType::BF16, {256, 512});
  expectTensor(ckpt, "model.layers.3.shared_head.head.weight", DType::BF16, {2048, 256});
  EXPECT_EQ(ckpt.find("model.layers.0.self_attn.q_proj.weight"), nullptr);

  // The MTP copies hold identical bits.
  const auto same_bits = [&](const std::string& a, const std::string& b) {
    const TensorView* ta = ckpt.find(a);
    const TensorView* tb = ckpt.find(b);
    return ta != nullptr && tb != nullptr && ta->data.size() == tb->data.size() &&
           std::memcmp(ta->data.data(), tb->data.data(), ta->data.size()) == 0;
  };
  EXPECT_TRUE(same_bits("model.layers.3.shared_head.head.weight", "lm_head.weight"));
  EXPECT_TRUE(same_bits("model.layers.3.embed_tokens.weight", "model.embed_tokens.weight"));

  // Contiguous data: the tensor bytes fill the file after the header.
  const std::vector<std::byte> raw = readFile(dir / "model.safetensors");
  EXPECT_EQ(ckpt.totalTensorBytes(), raw.size() - 8 - headerLength(raw));
  EXPECT_EQ(ckpt.files()[0].fileSize(), raw.size());
}

TEST(SafetensorsGolden, TinyFp8MatchesReadme) {
  Result<Checkpoint> opened = Checkpoint::open(goldenDir("tiny-fp8"));
  ASSERT_TRUE(opened.ok()) << opened.error().toString();
  const Checkpoint& ckpt = *opened;
  const std::vector<const TensorView*> tensors = ckpt.tensors();
  EXPECT_EQ(tensors.size(), kTinyTensorCount + kTinyQuantizedCount);
  EXPECT_EQ(tensors.size(), 383U);

  std::size_t fp8 = 0;
  for (const TensorView* t : tensors) {
    if (t->dtype != DType::F8E4M3) continue;
    ++fp8;
    ASSERT_EQ(t->shape.size(), 2U) << t->name;
    const TensorView* scale = ckpt.find(t->name + "_scale_inv");
    ASSERT_NE(scale, nullptr) << t->name;
    EXPECT_EQ(scale->dtype, DType::F32);
    const std::vector<std::int64_t> want = {(t->shape[0] + 127) / 128, (t->shape[1] + 127) / 128};
    EXPECT_EQ(scale->shape, want) << t->name;
    // README: 0x7F / 0xFF (NaN) never occur.
    const bool has_nan = std::any_of(t->data.begin(), t->data.end(),
                                     [](std::byte b) { return (std::to_integer<unsigned>(b) & 0x7FU) == 0x7FU; });
    EXPECT_FALSE(has_nan) << t->name;
  }
  EXPECT_EQ(fp8, kTinyQuantizedCount);
  expectTensor(ckpt, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", DType::F8E4M3, {80, 256});
  expectTensor(ckpt, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv", DType::F32, {1, 2});
  expectTensor(ckpt, "model.layers.0.self_attn.q_b_proj.weight_scale_inv", DType::F32, {2, 1});
  expectTensor(ckpt, "model.layers.1.mlp.gate.weight", DType::BF16, {16, 256});
  expectTensor(ckpt, "model.layers.3.eh_proj.weight", DType::BF16, {256, 512});
  expectTensor(ckpt, "model.embed_tokens.weight", DType::BF16, {2048, 256});
  expectTensor(ckpt, "model.layers.3.mlp.experts.7.gate_proj.weight", DType::F8E4M3, {64, 256});
}

float loadF32(const TensorView& t, std::size_t i) {
  float v = 0;
  std::memcpy(&v, t.data.data() + i * 4, 4);
  return v;
}

float loadBf16(const TensorView& t, std::size_t i) {
  std::uint16_t bits = 0;
  std::memcpy(&bits, t.data.data() + i * 2, 2);
  return bf16ToFloat(bits);
}

// The golden's dequantized weights are float32(e4m3(q)) * scale, one float32 rounding.
TEST(SafetensorsGolden, Fp8DequantizationMatchesGoldenBitForBit) {
  Result<Checkpoint> model = Checkpoint::open(goldenDir("tiny-fp8"));
  ASSERT_TRUE(model.ok()) << model.error().toString();
  Result<SafetensorsFile> golden = SafetensorsFile::open(goldenDir("tiny-fp8") / "golden.safetensors");
  ASSERT_TRUE(golden.ok()) << golden.error().toString();
  std::size_t compared = 0;
  for (const TensorView& want : golden->tensors()) {
    if (want.name.rfind("dequant.", 0) != 0) continue;
    const std::string name = want.name.substr(std::string_view("dequant.").size());
    const TensorView* q = model->find(name);
    const TensorView* scale = model->find(name + "_scale_inv");
    ASSERT_NE(q, nullptr) << name;
    ASSERT_NE(scale, nullptr) << name;
    ASSERT_EQ(q->shape, want.shape);
    const auto rows = static_cast<std::size_t>(q->shape[0]);
    const auto cols = static_cast<std::size_t>(q->shape[1]);
    const auto scale_cols = static_cast<std::size_t>(scale->shape[1]);
    for (std::size_t i = 0; i < rows; ++i) {
      for (std::size_t j = 0; j < cols; ++j) {
        const auto code = std::to_integer<std::uint8_t>(q->data[i * cols + j]);
        const float got = fp8e4m3ToFloat(code) * loadF32(*scale, (i / 128) * scale_cols + j / 128);
        ASSERT_EQ(std::bit_cast<std::uint32_t>(got), std::bit_cast<std::uint32_t>(loadF32(want, i * cols + j)))
            << name << " [" << i << ", " << j << "]";
      }
    }
    ++compared;
  }
  EXPECT_EQ(compared, 12U);
}

// tiny-fp8 was made from tiny-bf16 by round-to-nearest-even with saturation; encoding the bf16
// weights divided by the stored block scale must reproduce every stored code (up to zero's sign).
TEST(SafetensorsGolden, Fp8EncodingReproducesCheckpointCodes) {
  Result<Checkpoint> bf16 = Checkpoint::open(goldenDir("tiny-bf16"));
  Result<Checkpoint> fp8 = Checkpoint::open(goldenDir("tiny-fp8"));
  ASSERT_TRUE(bf16.ok() && fp8.ok());
  std::size_t mismatches = 0;
  std::size_t total = 0;
  for (const TensorView* q : fp8->tensors()) {
    if (q->dtype != DType::F8E4M3) continue;
    const TensorView* w = bf16->find(q->name);
    const TensorView* scale = fp8->find(q->name + "_scale_inv");
    ASSERT_NE(w, nullptr);
    ASSERT_NE(scale, nullptr);
    const auto cols = static_cast<std::size_t>(q->shape[1]);
    const auto scale_cols = static_cast<std::size_t>(scale->shape[1]);
    for (std::size_t k = 0; k < q->data.size(); ++k) {
      const std::size_t i = k / cols;
      const std::size_t j = k % cols;
      const float s = loadF32(*scale, (i / 128) * scale_cols + j / 128);
      const std::uint8_t code = floatToFp8e4m3(loadBf16(*w, k) / s);
      const auto stored = std::to_integer<std::uint8_t>(q->data[k]);
      // The generator wrote +0 where a tiny negative rounds to zero; we keep IEEE's -0 (0x80).
      const bool both_zero = (code & 0x7FU) == 0 && (stored & 0x7FU) == 0;
      mismatches += code != stored && !both_zero ? 1 : 0;
      ++total;
    }
  }
  EXPECT_GT(total, 1000000U);
  EXPECT_EQ(mismatches, 0U);
}

// ---------------------------------------------------------------------------------------------
// Writer round trips

struct OwnedTensor {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::uint8_t> bytes;
};

std::vector<OwnedTensor> sampleTensors(std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<OwnedTensor> out = {
      {"a.u8", DType::U8, {3}, {}},   {"b.f32", DType::F32, {2, 3}, {}},    {"c.bf16", DType::BF16, {5}, {}},
      {"d.i64", DType::I64, {3}, {}}, {"e.fp8", DType::F8E4M3, {7, 1}, {}}, {"f.f16", DType::F16, {1, 1, 3}, {}},
      {"g.i32", DType::I32, {}, {}},  {"h.empty", DType::F32, {0, 4}, {}},  {"i.bf16", DType::BF16, {2, 2}, {}},
  };
  for (OwnedTensor& t : out) {
    std::size_t n = dtypeSize(t.dtype);
    for (const std::int64_t d : t.shape) n *= static_cast<std::size_t>(d);
    t.bytes.resize(n);
    for (std::uint8_t& b : t.bytes) b = static_cast<std::uint8_t>(rng() & 0xFF);
  }
  return out;
}

std::vector<TensorToWrite> toWrite(const std::vector<OwnedTensor>& owned) {
  std::vector<TensorToWrite> out;
  for (const OwnedTensor& t : owned) out.push_back({t.name, t.dtype, t.shape, bytesOf(t.bytes)});
  return out;
}

class SafetensorsWriter : public TempDirTest {};

TEST_F(SafetensorsWriter, RoundTripKeepsEverythingAndAlignsTensors) {
  const std::vector<OwnedTensor> owned = sampleTensors(7);
  const fs::path path = dir_ / "out.safetensors";
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"source", "unit test"}};
  const Status written = writeSafetensors(path, toWrite(owned), metadata);
  ASSERT_TRUE(written.ok()) << written.error().toString();

  Result<SafetensorsFile> file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.error().toString();
  EXPECT_EQ(file->metadata(), metadata);
  EXPECT_EQ(file->path(), path);
  ASSERT_EQ(file->tensors().size(), owned.size());
  for (const OwnedTensor& want : owned) {
    const TensorView* got = file->find(want.name);
    ASSERT_NE(got, nullptr) << want.name;
    EXPECT_EQ(got->dtype, want.dtype);
    EXPECT_EQ(got->shape, want.shape);
    EXPECT_EQ(got->file, path);
    ASSERT_EQ(got->data.size(), want.bytes.size());
    const std::span<const std::byte> want_bytes = bytesOf(want.bytes);
    EXPECT_TRUE(std::equal(want_bytes.begin(), want_bytes.end(), got->data.begin(), got->data.end())) << want.name;
    EXPECT_EQ(std::bit_cast<std::uintptr_t>(got->data.data()) % dtypeSize(got->dtype), 0U) << want.name;
  }
  EXPECT_EQ(file->find("g.i32")->numel(), 1);
  EXPECT_EQ(file->find("h.empty")->numel(), 0);
  EXPECT_EQ(file->find("missing"), nullptr);

  // File order: element size descending, then name.
  std::vector<std::string> order;
  for (const TensorView& t : file->tensors()) order.push_back(t.name);
  const std::vector<std::string> want_order = {"d.i64", "b.f32",  "g.i32", "h.empty", "c.bf16",
                                               "f.f16", "i.bf16", "a.u8",  "e.fp8"};
  // h.empty holds no bytes; it sits at the offset where the 4-byte group ends.
  EXPECT_EQ(order, want_order);

  const std::vector<std::byte> raw = readFile(path);
  EXPECT_EQ(headerLength(raw) % 8, 0U);
  EXPECT_EQ(file->fileSize(), raw.size());
  // Nothing but the file itself is left in the folder (the temporary was renamed).
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);

  // The in-memory reader sees the same image.
  Result<SafetensorsFile> in_memory = SafetensorsFile::fromBytes(raw, "image");
  ASSERT_TRUE(in_memory.ok()) << in_memory.error().toString();
  EXPECT_EQ(in_memory->tensors().size(), owned.size());
  EXPECT_EQ(in_memory->path(), fs::path("image"));
}

TEST_F(SafetensorsWriter, OverwritesAtomically) {
  const fs::path path = dir_ / "out.safetensors";
  const std::vector<OwnedTensor> first = sampleTensors(1);
  ASSERT_TRUE(writeSafetensors(path, toWrite(first)).ok());
  const std::vector<std::uint8_t> bytes = {1, 2, 3, 4};
  ASSERT_TRUE(writeSafetensors(path, {{"only", DType::U8, {4}, bytesOf(bytes)}}, {}).ok());
  Result<SafetensorsFile> file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.error().toString();
  ASSERT_EQ(file->tensors().size(), 1U);
  EXPECT_TRUE(file->metadata().empty());
  EXPECT_EQ(std::to_integer<int>(file->tensors()[0].data[3]), 4);
}

TEST_F(SafetensorsWriter, RejectsInconsistentInput) {
  const std::vector<std::uint8_t> bytes(8, 0);
  const fs::path path = dir_ / "out.safetensors";
  EXPECT_TRUE(isError(writeSafetensors(path, {{"w", DType::F32, {3}, bytesOf(bytes)}}), ErrorCode::InvalidArgument,
                      {"out.safetensors", "'w'"}));
  EXPECT_TRUE(
      isError(writeSafetensors(path, {{"w", DType::F32, {-2}, bytesOf(bytes)}}), ErrorCode::InvalidArgument, {"'w'"}));
  EXPECT_TRUE(
      isError(writeSafetensors(path, {{"w", DType::U8, {8}, bytesOf(bytes)}, {"w", DType::U8, {8}, bytesOf(bytes)}}),
              ErrorCode::InvalidArgument, {"'w'", "twice"}));
  EXPECT_TRUE(isError(writeSafetensors(path, {{"", DType::U8, {8}, bytesOf(bytes)}}), ErrorCode::InvalidArgument, {}));
  EXPECT_TRUE(isError(writeSafetensors(path, {{"__metadata__", DType::U8, {8}, bytesOf(bytes)}}),
                      ErrorCode::InvalidArgument, {"__metadata__"}));
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(
      isError(writeSafetensors(dir_ / "no_such_dir" / "x.safetensors", {}), ErrorCode::NotFound, {"no_such_dir"}));
}

// ---------------------------------------------------------------------------------------------
// Checkpoints: single file, folder, sharded folder with index

class CheckpointTest : public TempDirTest {
 protected:
  // Two shards and an index; tensors a.* in shard 1, b.* in shard 2.
  void writeSharded() {
    owned1_ = {{"a.x", DType::F32, {2}, std::vector<std::uint8_t>(8, 1)},
               {"a.y", DType::BF16, {3}, std::vector<std::uint8_t>(6, 2)}};
    owned2_ = {{"b.z", DType::U8, {5}, std::vector<std::uint8_t>(5, 3)}};
    ASSERT_TRUE(writeSafetensors(dir_ / kShard1, toWrite(owned1_)).ok());
    ASSERT_TRUE(writeSafetensors(dir_ / kShard2, toWrite(owned2_)).ok());
    ASSERT_TRUE(writeSafetensorsIndex(dir_ / kIndex, {{"a.x", kShard1}, {"a.y", kShard1}, {"b.z", kShard2}}, 19).ok());
  }

  static constexpr const char* kShard1 = "model-00001-of-00002.safetensors";
  static constexpr const char* kShard2 = "model-00002-of-00002.safetensors";
  static constexpr const char* kIndex = "model.safetensors.index.json";
  std::vector<OwnedTensor> owned1_;
  std::vector<OwnedTensor> owned2_;
};

TEST_F(CheckpointTest, ShardedFolderWithIndex) {
  writeSharded();
  for (const fs::path& target : {dir_, dir_ / kIndex}) {
    Result<Checkpoint> ckpt = Checkpoint::open(target);
    ASSERT_TRUE(ckpt.ok()) << ckpt.error().toString();
    EXPECT_EQ(ckpt->files().size(), 2U);
    const std::vector<const TensorView*> tensors = ckpt->tensors();
    ASSERT_EQ(tensors.size(), 3U);
    EXPECT_EQ(tensors[0]->name, "a.x");
    EXPECT_EQ(tensors[2]->name, "b.z");
    EXPECT_EQ(ckpt->find("a.y")->file, dir_ / kShard1);
    EXPECT_EQ(ckpt->find("b.z")->file, dir_ / kShard2);
    EXPECT_EQ(std::to_integer<int>(ckpt->find("b.z")->data[4]), 3);
    EXPECT_EQ(ckpt->totalTensorBytes(), 19U);
    EXPECT_EQ(ckpt->find("nope"), nullptr);
  }
}

TEST_F(CheckpointTest, SingleFileAndFolderWithModelSafetensors) {
  const std::vector<OwnedTensor> owned = sampleTensors(3);
  ASSERT_TRUE(writeSafetensors(dir_ / "model.safetensors", toWrite(owned)).ok());
  Result<Checkpoint> by_dir = Checkpoint::open(dir_);
  ASSERT_TRUE(by_dir.ok()) << by_dir.error().toString();
  EXPECT_EQ(by_dir->tensors().size(), owned.size());
  Result<Checkpoint> by_file = Checkpoint::open(dir_ / "model.safetensors");
  ASSERT_TRUE(by_file.ok()) << by_file.error().toString();
  EXPECT_EQ(by_file->tensors().size(), owned.size());
}

TEST_F(CheckpointTest, MissingPathsAreNotFound) {
  EXPECT_TRUE(isError(Checkpoint::open(dir_ / "nothing"), ErrorCode::NotFound, {"nothing"}));
  EXPECT_TRUE(isError(Checkpoint::open(dir_), ErrorCode::NotFound, {dir_.string(), "model.safetensors"}));
  EXPECT_TRUE(isError(SafetensorsFile::open(dir_ / "x.safetensors"), ErrorCode::NotFound, {"x.safetensors"}));
  EXPECT_TRUE(isError(SafetensorsFile::open(dir_), ErrorCode::Io, {dir_.string()}));
}

TEST_F(CheckpointTest, MovedObjectsKeepTheirViews) {
  writeSharded();
  Result<Checkpoint> opened = Checkpoint::open(dir_);
  ASSERT_TRUE(opened.ok());
  Checkpoint moved = std::move(opened).value();
  std::vector<Checkpoint> holder;
  holder.push_back(std::move(moved));
  const TensorView* t = holder[0].find("a.x");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(std::to_integer<int>(t->data[0]), 1);
}

// ---------------------------------------------------------------------------------------------
// Corruption: one test per kind. Each checks the code and that the message names file and tensor.

constexpr std::string_view kGoodEntry = R"("w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})";
const std::string kSixteenBytes(16, 'x');

class SafetensorsCorrupt : public TempDirTest {};

TEST_F(SafetensorsCorrupt, ValidBaselineOpens) {
  Result<SafetensorsFile> file = openImage(image(std::string("{") + std::string(kGoodEntry) + "}", kSixteenBytes));
  ASSERT_TRUE(file.ok()) << file.error().toString();
  EXPECT_EQ(file->tensors().size(), 1U);
}

TEST_F(SafetensorsCorrupt, ShorterThanEightBytes) {
  EXPECT_TRUE(isError(openImage("abcde"), ErrorCode::Corrupt, {"bad.safetensors", "shorter"}));
  EXPECT_TRUE(isError(openImage(""), ErrorCode::Corrupt, {"bad.safetensors", "shorter"}));
}

TEST_F(SafetensorsCorrupt, HeaderLengthOverLimit) {
  EXPECT_TRUE(isError(openImage(le64(200ULL << 20) + "{}"), ErrorCode::Corrupt, {"bad.safetensors", "limit"}));
  EXPECT_TRUE(isError(openImage(le64(~0ULL) + "{}"), ErrorCode::Corrupt, {"bad.safetensors"}));
}

TEST_F(SafetensorsCorrupt, HeaderLengthBeyondFile) {
  EXPECT_TRUE(isError(openImage(le64(1000) + "{}"), ErrorCode::Corrupt, {"bad.safetensors", "file size"}));
}

TEST_F(SafetensorsCorrupt, MalformedJson) {
  EXPECT_TRUE(isError(openImage(image(R"({"w": )")), ErrorCode::Corrupt, {"bad.safetensors", "JSON"}));
  EXPECT_TRUE(isError(openImage(image("{} x")), ErrorCode::Corrupt, {"bad.safetensors"}));
  EXPECT_TRUE(isError(openImage(image("")), ErrorCode::Corrupt, {"bad.safetensors"}));
  EXPECT_TRUE(isError(openImage(image("{\"w\xff\": 1}")), ErrorCode::Corrupt, {"bad.safetensors"}));  // bad UTF-8
  EXPECT_TRUE(isError(openImage(image(std::string(100, '[') + std::string(100, ']'))), ErrorCode::Corrupt,
                      {"bad.safetensors"}));  // deeper than the parser allows
}

TEST_F(SafetensorsCorrupt, HeaderNotAnObject) {
  EXPECT_TRUE(isError(openImage(image("[1, 2]")), ErrorCode::Corrupt, {"bad.safetensors", "not a JSON object"}));
  EXPECT_TRUE(isError(openImage(image(R"({"w": 5})")), ErrorCode::Corrupt, {"bad.safetensors", "'w'"}));
}

TEST_F(SafetensorsCorrupt, UnknownDtype) {
  EXPECT_TRUE(isError(openImage(image(R"({"w":{"dtype":"F7","shape":[2],"data_offsets":[0,2]}})", "ab")),
                      ErrorCode::Corrupt, {"bad.safetensors", "'w'", "F7"}));
  EXPECT_TRUE(isError(openImage(image(R"({"w":{"dtype":4,"shape":[2],"data_offsets":[0,2]}})", "ab")),
                      ErrorCode::Corrupt, {"bad.safetensors", "'w'", "dtype"}));
  EXPECT_TRUE(isError(openImage(image(R"({"w":{"shape":[2],"data_offsets":[0,2]}})", "ab")), ErrorCode::Corrupt,
                      {"bad.safetensors", "'w'", "dtype"}));
}

TEST_F(SafetensorsCorrupt, ShapeNotListOfNonNegativeInts) {
  for (const std::string shape : {"3", "[-1]", "[1.5]", "[\"2\"]", "[2, null]", "[[2]]", "{}"}) {
    SCOPED_TRACE(shape);
    const std::string header = R"({"w":{"dtype":"U8","shape":)" + shape + R"(,"data_offsets":[0,2]}})";
    EXPECT_TRUE(isError(openImage(image(header, "ab")), ErrorCode::Corrupt, {"bad.safetensors", "'w'", "shape"}));
  }
  EXPECT_TRUE(isError(openImage(image(R"({"w":{"dtype":"U8","data_offsets":[0,2]}})", "ab")), ErrorCode::Corrupt,
                      {"bad.safetensors", "'w'", "shape"}));
  EXPECT_TRUE(
      isError(openImage(image(R"({"w":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,2]}})", "ab")),
              ErrorCode::Corrupt, {"bad.safetensors", "'w'", "shape"}));
}

TEST_F(SafetensorsCorrupt, NumelTimesSizeOverflows) {
  EXPECT_TRUE(
      isError(openImage(image(R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,2]}})", "ab")),
              ErrorCode::Corrupt, {"bad.safetensors", "'w'", "overflow"}));
  // numel fits in int64 but numel x 8 does not.
  EXPECT_TRUE(isError(
      openImage(image(R"({"w":{"dtype":"I64","shape":[4611686018427387904],"data_offsets":[0,8]}})", "abcdefgh")),
      ErrorCode::Corrupt, {"bad.safetensors", "'w'", "overflow"}));
}

TEST_F(SafetensorsCorrupt, DataOffsetsNotTwoInts) {
  for (const std::string offsets : {"[0]", "[0,2,4]", "[0,\"2\"]", "[-1,2]", "[0,2.0]", "7", "null"}) {
    SCOPED_TRACE(offsets);
    const std::string header = R"({"w":{"dtype":"U8","shape":[2],"data_offsets":)" + offsets + "}}";
    EXPECT_TRUE(
        isError(openImage(image(header, "ab")), ErrorCode::Corrupt, {"bad.safetensors", "'w'", "data_offsets"}));
  }
  EXPECT_TRUE(isError(openImage(image(R"({"w":{"dtype":"U8","shape":[2]}})", "ab")), ErrorCode::Corrupt,
                      {"bad.safetensors", "'w'", "data_offsets"}));
}

TEST_F(SafetensorsCorrupt, BeginAfterEnd) {
  EXPECT_TRUE(isError(openImage(image(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[8,4]}})", kSixteenBytes)),
                      ErrorCode::Corrupt, {"bad.safetensors", "'w'", "begin"}));
}

TEST_F(SafetensorsCorrupt, EndBeyondDataSection) {
  EXPECT_TRUE(isError(openImage(image(R"({"w":{"dtype":"U8","shape":[1000],"data_offsets":[0,1000]}})", kSixteenBytes)),
                      ErrorCode::Corrupt, {"bad.safetensors", "'w'", "beyond"}));
  EXPECT_TRUE(isError(
      openImage(image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551614,18446744073709551615]}})",
                      kSixteenBytes)),
      ErrorCode::Corrupt, {"bad.safetensors", "'w'", "beyond"}));
}

TEST_F(SafetensorsCorrupt, TruncatedRealCheckpoint) {
  const std::vector<std::byte> raw = readFile(goldenDir("tiny-bf16") / "model.safetensors");
  ASSERT_GT(raw.size(), 1000U);
  const std::string_view whole(reinterpret_cast<const char*>(raw.data()), raw.size());
  // Cut inside the data: the header parses but the last tensors end past the end of the file.
  EXPECT_TRUE(isError(openImage(whole.substr(0, raw.size() / 2)), ErrorCode::Corrupt,
                      {"bad.safetensors", "tensor '", "beyond"}));
  // Cut inside the header.
  EXPECT_TRUE(isError(openImage(whole.substr(0, 100)), ErrorCode::Corrupt, {"bad.safetensors", "file size"}));
}

TEST_F(SafetensorsCorrupt, OverlappingTensors) {
  const std::string header =
      R"({"first":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"second":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})";
  EXPECT_TRUE(isError(openImage(image(header, kSixteenBytes)), ErrorCode::Corrupt,
                      {"bad.safetensors", "'second'", "'first'", "overlap"}));
  // One tensor inside another (same begin) also overlaps.
  const std::string nested =
      R"({"big":{"dtype":"U8","shape":[16],"data_offsets":[0,16]},"small":{"dtype":"U8","shape":[2],"data_offsets":[6,8]}})";
  EXPECT_TRUE(isError(openImage(image(nested, kSixteenBytes)), ErrorCode::Corrupt, {"'small'", "'big'", "overlap"}));
  // Empty tensors share offsets harmlessly.
  const std::string empties =
      R"({"e1":{"dtype":"U8","shape":[0],"data_offsets":[4,4]},"e2":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4]},"w":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}})";
  Result<SafetensorsFile> ok = openImage(image(empties, kSixteenBytes));
  EXPECT_TRUE(ok.ok()) << ok.error().toString();
}

TEST_F(SafetensorsCorrupt, ByteLengthNotNumelTimesSize) {
  EXPECT_TRUE(isError(openImage(image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", kSixteenBytes)),
                      ErrorCode::Corrupt, {"bad.safetensors", "'w'", "needs 8"}));
  EXPECT_TRUE(isError(openImage(image(R"({"w":{"dtype":"BF16","shape":[],"data_offsets":[0,4]}})", kSixteenBytes)),
                      ErrorCode::Corrupt, {"bad.safetensors", "'w'", "needs 2"}));
}

TEST_F(SafetensorsCorrupt, DuplicateTensorNames) {
  const std::string header =
      R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"w":{"dtype":"U8","shape":[8],"data_offsets":[8,16]}})";
  EXPECT_TRUE(
      isError(openImage(image(header, kSixteenBytes)), ErrorCode::Corrupt, {"bad.safetensors", "'w'", "twice"}));
  // The same name spelled with an escape is the same key.
  const std::string escaped =
      R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"\u0077":{"dtype":"U8","shape":[8],"data_offsets":[8,16]}})";
  EXPECT_TRUE(
      isError(openImage(image(escaped, kSixteenBytes)), ErrorCode::Corrupt, {"bad.safetensors", "'w'", "twice"}));
}

TEST_F(SafetensorsCorrupt, MetadataNotStringToString) {
  const std::string suffix = std::string(",") + std::string(kGoodEntry) + "}";
  EXPECT_TRUE(isError(openImage(image(R"({"__metadata__":{"format":1})" + suffix, kSixteenBytes)), ErrorCode::Corrupt,
                      {"bad.safetensors", "__metadata__", "'format'"}));
  EXPECT_TRUE(isError(openImage(image(R"({"__metadata__":["pt"])" + suffix, kSixteenBytes)), ErrorCode::Corrupt,
                      {"bad.safetensors", "__metadata__"}));
  EXPECT_TRUE(isError(openImage(image(R"({"__metadata__":{"a":"1","a":"2"})" + suffix, kSixteenBytes)),
                      ErrorCode::Corrupt, {"bad.safetensors", "'a'", "twice"}));
}

TEST_F(SafetensorsCorrupt, FromBytesNamesTheGivenName) {
  const std::string bytes = le64(1000) + "{}";
  EXPECT_TRUE(isError(SafetensorsFile::fromBytes(std::as_bytes(std::span(bytes.data(), bytes.size())), "memory-image"),
                      ErrorCode::Corrupt, {"memory-image"}));
}

class CheckpointIndexCorrupt : public CheckpointTest {};

TEST_F(CheckpointIndexCorrupt, MalformedIndexJson) {
  writeSharded();
  writeFile(dir_ / kIndex, R"({"weight_map": {"a.x": )");
  EXPECT_TRUE(isError(Checkpoint::open(dir_), ErrorCode::Corrupt, {kIndex, "JSON"}));
  writeFile(dir_ / kIndex, "[]");
  EXPECT_TRUE(isError(Checkpoint::open(dir_), ErrorCode::Corrupt, {kIndex, "not a JSON object"}));
  writeFile(dir_ / kIndex, R"({"metadata": {}})");
  EXPECT_TRUE(isError(Checkpoint::open(dir_), ErrorCode::Corrupt, {kIndex, "weight_map"}));
  writeFile(dir_ / kIndex, R"({"weight_map": []})");
  EXPECT_TRUE(isError(Checkpoint::open(dir_), ErrorCode::Corrupt, {kIndex, "weight_map"}));
  writeFile(dir_ / kIndex, R"({"weight_map": {}})");
  EXPECT_TRUE(isError(Checkpoint::open(dir_), ErrorCode::Corrupt, {kIndex, "empty"}));
  writeFile(dir_ / kIndex, R"({"weight_map": {"a.x": 3}})");
  EXPECT_TRUE(isError(Checkpoint::open(dir_), ErrorCode::Corrupt, {kIndex, "'a.x'"}));
  writeFile(dir_ / kIndex, R"({"weight_map": {"a.x": "../model-00001-of-00002.safetensors"}})");
  EXPECT_TRUE(isError(Checkpoint::open(dir_), ErrorCode::Corrupt, {kIndex, "'a.x'", "leaves the folder"}));
  writeFile(dir_ / kIndex, "");
  EXPECT_TRUE(isError(Checkpoint::open(dir_), ErrorCode::Corrupt, {kIndex}));
}

TEST_F(CheckpointIndexCorrupt, IndexDuplicateTensorEntry) {
  writeSharded();
  writeFile(dir_ / kIndex,
            std::string(R"({"weight_map": {"a.x": ")") + kShard1 + R"(", "a.x": ")" + kShard2 + R"("}})");
  EXPECT_TRUE(isError(Checkpoint::open(dir_), ErrorCode::Corrupt, {kIndex, "'a.x'", "twice"}));
}

TEST_F(CheckpointIndexCorrupt, ShardMissing) {
  writeSharded();
  ASSERT_TRUE(
      writeSafetensorsIndex(dir_ / kIndex, {{"a.x", kShard1}, {"b.z", "model-00003-of-00002.safetensors"}}, 0).ok());
  EXPECT_TRUE(
      isError(Checkpoint::open(dir_), ErrorCode::NotFound, {kIndex, "'b.z'", "model-00003-of-00002.safetensors"}));
}

TEST_F(CheckpointIndexCorrupt, TensorNotInItsShard) {
  writeSharded();
  ASSERT_TRUE(writeSafetensorsIndex(dir_ / kIndex, {{"a.x", kShard1}, {"b.z", kShard1}}, 0).ok());
  EXPECT_TRUE(isError(Checkpoint::open(dir_), ErrorCode::Corrupt, {kIndex, "'b.z'", kShard1}));
}

TEST_F(CheckpointIndexCorrupt, TensorInTwoShards) {
  writeSharded();
  // Shard 2 also stores a.x; the index maps it to shard 1.
  const std::vector<OwnedTensor> clash = {{"a.x", DType::F32, {2}, std::vector<std::uint8_t>(8, 9)},
                                          {"b.z", DType::U8, {5}, std::vector<std::uint8_t>(5, 3)}};
  ASSERT_TRUE(writeSafetensors(dir_ / kShard2, toWrite(clash)).ok());
  EXPECT_TRUE(isError(Checkpoint::open(dir_), ErrorCode::Corrupt, {kIndex, "'a.x'", kShard1, kShard2, "two shards"}));
}

TEST_F(CheckpointIndexCorrupt, CorruptShardNamesTheShard) {
  writeSharded();
  writeFile(dir_ / kShard2, "tiny");
  EXPECT_TRUE(isError(Checkpoint::open(dir_), ErrorCode::Corrupt, {kShard2}));
}

// ---------------------------------------------------------------------------------------------
// Random mutation: thousands of damaged images must each be rejected or yield views inside
// the buffer; nothing may crash or read out of bounds (run under PD_SANITIZE to catch reads).

struct MutationStats {
  std::size_t accepted = 0;
  std::size_t rejected = 0;
  std::uint64_t checksum = 0;  // of accepted tensors' first and last bytes, so the reads happen
};

MutationStats mutateAndParse(const std::vector<std::byte>& original, std::uint64_t seed, int iterations) {
  MutationStats stats;
  std::vector<std::byte> work = original;
  const std::size_t header_end =
      std::min<std::size_t>(original.size(), 8 + static_cast<std::size_t>(headerLength(original)));
  std::mt19937_64 rng(seed);
  const auto below = [&](std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(rng() % n); };
  const std::string_view interesting = "\"{}[],:-0123456789.eE \\u";
  for (int it = 0; it < iterations; ++it) {
    std::size_t length = work.size();
    switch (rng() % 7) {
      case 0:  // flip bits in the header
        for (std::size_t k = 0, n = 1 + below(8); k < n; ++k) {
          work[below(header_end)] ^= static_cast<std::byte>(1U << below(8));
        }
        break;
      case 1:  // random bytes in the header
        for (std::size_t k = 0, n = 1 + below(4); k < n; ++k) work[below(header_end)] = static_cast<std::byte>(rng());
        break;
      case 2:  // a JSON-significant character somewhere in the header
        work[8 + below(header_end - 8)] = static_cast<std::byte>(interesting[below(interesting.size())]);
        break;
      case 3:  // truncate, mostly near the header
        length = rng() % 2 == 0 ? below(header_end + 64) : below(original.size());
        break;
      case 4: {  // damage the length prefix: near the true value, huge, or random
        std::uint64_t len = headerLength(original);
        const std::uint64_t choice = rng() % 3;
        len = choice == 0 ? len + below(33) - 16 : (choice == 1 ? rng() : len ^ (1ULL << below(64)));
        for (std::size_t i = 0; i < 8; ++i) work[i] = static_cast<std::byte>((len >> (8 * i)) & 0xFF);
        break;
      }
      case 5: {  // delete or duplicate a header byte, keeping the header length
        const std::size_t at = 8 + below(header_end - 9);
        if (rng() % 2 == 0) {
          std::memmove(&work[at], &work[at + 1], header_end - at - 1);
          work[header_end - 1] = std::byte{' '};
        } else {
          std::memmove(&work[at + 1], &work[at], header_end - at - 1);
        }
        break;
      }
      default: {  // a random digit: shapes and offsets change
        std::size_t at = 8 + below(header_end - 8);
        while (at < header_end && (std::to_integer<char>(work[at]) < '0' || std::to_integer<char>(work[at]) > '9'))
          ++at;
        if (at < header_end) work[at] = static_cast<std::byte>('0' + below(10));
        break;
      }
    }
    const std::span<const std::byte> input(work.data(), length);
    Result<SafetensorsFile> file = SafetensorsFile::fromBytes(input, "mutant");
    if (file.ok()) {
      ++stats.accepted;
      for (const TensorView& t : file->tensors()) {
        EXPECT_GE(t.data.data(), input.data());
        EXPECT_LE(t.data.data() + t.data.size(), input.data() + input.size());
        EXPECT_EQ(t.data.size(), static_cast<std::size_t>(t.numel()) * dtypeSize(t.dtype));
        EXPECT_EQ(file->find(t.name), &t);
        if (!t.data.empty()) {  // the ends suffice: the checks above bound the span
          stats.checksum +=
              std::to_integer<std::uint8_t>(t.data.front()) + std::to_integer<std::uint8_t>(t.data.back());
        }
      }
    } else {
      ++stats.rejected;
      EXPECT_EQ(file.error().code, ErrorCode::Corrupt);
      EXPECT_NE(file.error().message.find("mutant"), std::string::npos) << file.error().message;
    }
    std::copy(original.begin(), original.begin() + static_cast<std::ptrdiff_t>(header_end), work.begin());
  }
  return stats;
}

TEST(SafetensorsMutation, GoldenFilesSurviveRandomDamage) {
  for (const std::string_view model : {"tiny-bf16", "tiny-fp8"}) {
    SCOPED_TRACE(model);
    const std::vector<std::byte> original = readFile(goldenDir(model) / "model.safetensors");
    ASSERT_GT(original.size(), 1000U);
    const MutationStats stats = mutateAndParse(original, 20261129, 2000);
    std::cout << model << ": " << stats.accepted << " accepted, " << stats.rejected << " rejected, checksum "
              << stats.checksum << "\n";
    EXPECT_GT(stats.rejected, 1000U);
    EXPECT_GT(stats.accepted, 10U);  // e.g. a renamed tensor is still a valid file
  }
}

TEST(SafetensorsMutation, SmallMultiDtypeFileSurvivesRandomDamage) {
  std::string templ = (fs::temp_directory_path() / "pd_safetensors_XXXXXX").string();
  ASSERT_NE(::mkdtemp(templ.data()), nullptr);
  const fs::path dir(templ);
  const std::vector<OwnedTensor> owned = sampleTensors(11);
  ASSERT_TRUE(writeSafetensors(dir / "small.safetensors", toWrite(owned)).ok());
  const std::vector<std::byte> original = readFile(dir / "small.safetensors");
  fs::remove_all(dir);
  const MutationStats stats = mutateAndParse(original, 42, 5000);
  std::cout << "small: " << stats.accepted << " accepted, " << stats.rejected << " rejected, checksum "
            << stats.checksum << "\n";
  EXPECT_GT(stats.rejected, 1000U);
  EXPECT_GT(stats.accepted, 10U);
}

}  // namespace
}  // namespace pd
