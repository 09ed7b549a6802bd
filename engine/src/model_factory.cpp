#include "pd/engine/model_factory.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <numbers>
#include <system_error>
#include <thread>
#include <vector>

#include "pd/common/dtype.h"
#include "pd/engine/default_model.h"
#include "pd/engine/safetensors.h"

namespace pd {
namespace {

// ---- Presets ----

constexpr std::string_view kV3Prefix = "deepseek-v3-layers=";
constexpr std::int64_t kV3MaxLayers = 61;

/// The golden tiny model (golden README 1).
ModelConfig tinyConfig() {
  ModelConfig c;
  c.vocab_size = 2048;
  c.hidden_size = 256;
  c.intermediate_size = 512;
  c.moe_intermediate_size = 64;
  c.num_hidden_layers = 3;
  c.first_k_dense_replace = 1;
  c.num_attention_heads = 4;
  c.q_lora_rank = 96;
  c.kv_lora_rank = 64;
  c.qk_nope_head_dim = 32;
  c.qk_rope_head_dim = 16;
  c.v_head_dim = 32;
  c.n_routed_experts = 16;
  c.num_experts_per_tok = 4;
  c.n_group = 4;
  c.topk_group = 2;
  c.n_shared_experts = 1;
  c.routed_scaling_factor = 2.5;
  c.max_position_embeddings = 256;
  c.rope_scaling = RopeScaling{"yarn", 4.0, 64, 32.0, 1.0, 1.0, 1.0};
  c.num_nextn_predict_layers = 1;
  return c;
}

ModelConfig smallConfig() {
  ModelConfig c = tinyConfig();
  c.vocab_size = 4096;
  c.hidden_size = 512;
  c.intermediate_size = 1024;
  c.moe_intermediate_size = 128;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 8;
  c.q_lora_rank = 192;
  c.kv_lora_rank = 128;
  c.qk_nope_head_dim = 64;
  c.qk_rope_head_dim = 32;
  c.v_head_dim = 64;
  c.max_position_embeddings = 2048;
  c.rope_scaling = RopeScaling{"yarn", 4.0, 512, 32.0, 1.0, 1.0, 1.0};
  return c;
}

/// ~750 M parameters: big enough that a decode step streams weights from DRAM, not cache.
ModelConfig benchConfig() {
  ModelConfig c = tinyConfig();
  c.vocab_size = 16384;
  c.hidden_size = 2048;
  c.intermediate_size = 8192;
  c.moe_intermediate_size = 512;
  c.num_hidden_layers = 5;
  c.num_attention_heads = 16;
  c.q_lora_rank = 512;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.n_routed_experts = 32;
  c.num_experts_per_tok = 8;
  c.n_group = 8;
  c.topk_group = 4;
  c.max_position_embeddings = 16384;
  c.rope_scaling = RopeScaling{"yarn", 4.0, 4096, 32.0, 1.0, 1.0, 1.0};
  return c;
}

ModelConfig defaultConfig() {
  ModelConfig c = tinyConfig();
  c.vocab_size = 129280;  // the real DeepSeek-V3 tokenizer
  c.max_position_embeddings = 4096;
  c.rope_scaling = RopeScaling{"yarn", 4.0, 1024, 32.0, 1.0, 1.0, 1.0};
  c.bos_token_id = 0;
  c.eos_token_id = 1;
  return c;
}

/// The real DeepSeek-V3 config.json values with `layers` main layers.
ModelConfig deepseekV3Config(std::int64_t layers) {
  ModelConfig c;
  c.vocab_size = 129280;
  c.hidden_size = 7168;
  c.intermediate_size = 18432;
  c.moe_intermediate_size = 2048;
  c.num_hidden_layers = layers;
  c.first_k_dense_replace = std::min<std::int64_t>(3, layers);
  c.num_attention_heads = 128;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.n_routed_experts = 256;
  c.num_experts_per_tok = 8;
  c.n_group = 8;
  c.topk_group = 4;
  c.n_shared_experts = 1;
  c.routed_scaling_factor = 2.5;
  c.max_position_embeddings = 163840;
  c.rope_scaling = RopeScaling{"yarn", 40.0, 4096, 32.0, 1.0, 1.0, 1.0};
  c.num_nextn_predict_layers = 1;
  return c;
}

struct DimensionField {
  std::string_view key;
  std::int64_t ModelConfig::*field;
};

constexpr std::array kDimensionFields = {
    DimensionField{"vocab_size", &ModelConfig::vocab_size},
    DimensionField{"hidden_size", &ModelConfig::hidden_size},
    DimensionField{"intermediate_size", &ModelConfig::intermediate_size},
    DimensionField{"moe_intermediate_size", &ModelConfig::moe_intermediate_size},
    DimensionField{"num_hidden_layers", &ModelConfig::num_hidden_layers},
    DimensionField{"first_k_dense_replace", &ModelConfig::first_k_dense_replace},
    DimensionField{"num_attention_heads", &ModelConfig::num_attention_heads},
    DimensionField{"q_lora_rank", &ModelConfig::q_lora_rank},
    DimensionField{"kv_lora_rank", &ModelConfig::kv_lora_rank},
    DimensionField{"qk_nope_head_dim", &ModelConfig::qk_nope_head_dim},
    DimensionField{"qk_rope_head_dim", &ModelConfig::qk_rope_head_dim},
    DimensionField{"v_head_dim", &ModelConfig::v_head_dim},
    DimensionField{"n_routed_experts", &ModelConfig::n_routed_experts},
    DimensionField{"num_experts_per_tok", &ModelConfig::num_experts_per_tok},
    DimensionField{"n_group", &ModelConfig::n_group},
    DimensionField{"topk_group", &ModelConfig::topk_group},
    DimensionField{"n_shared_experts", &ModelConfig::n_shared_experts},
    DimensionField{"num_nextn_predict_layers", &ModelConfig::num_nextn_predict_layers},
    DimensionField{"max_position_embeddings", &ModelConfig::max_position_embeddings},
};

// ---- Random numbers: splitmix64 for seeding, xoshiro256** for streams, Box-Muller normals. ----

std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

std::uint64_t fnv1a64(std::string_view text) {
  std::uint64_t h = 0xCBF29CE484222325ULL;
  for (const char ch : text) {
    h ^= static_cast<unsigned char>(ch);
    h *= 0x100000001B3ULL;
  }
  return h;
}

class Xoshiro256 {
 public:
  explicit Xoshiro256(std::uint64_t seed) {
    for (auto& s : s_) s = splitmix64(seed);
  }
  std::uint64_t next() {
    const std::uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const std::uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::array<std::uint64_t, 4> s_{};
};

// Box-Muller needs ln, sin and cos. libm's versions differ between C libraries (and cost most
// of the generation time), so these are computed here with plain IEEE multiply/add/divide/sqrt:
// the bytes then depend on the seed alone, on every platform. Accuracy (~1e-12 relative) is far
// below the bf16 rounding applied afterwards.

/// ln(x) for x in (0, 1]: x = m * 2^e with m in [1/sqrt2, sqrt2), ln m = 2 atanh((m-1)/(m+1)).
double lnUnit(double x) {
  const auto bits = std::bit_cast<std::uint64_t>(x);
  auto e = static_cast<std::int64_t>((bits >> 52) & 0x7FF) - 1023;
  double m = std::bit_cast<double>((bits & 0x000FFFFFFFFFFFFFULL) | 0x3FF0000000000000ULL);  // [1, 2)
  if (m > std::numbers::sqrt2) {
    m *= 0.5;
    ++e;
  }
  const double s = (m - 1.0) / (m + 1.0);  // |s| <= 0.1716
  const double s2 = s * s;
  double series = 1.0 / 19.0;
  for (int k = 17; k >= 1; k -= 2) series = series * s2 + 1.0 / k;
  return static_cast<double>(e) * std::numbers::ln2 + 2.0 * s * series;
}

/// cos and sin of x for |x| <= pi/4 (Taylor to x^12 and x^13: error < 1e-12).
void cosSinQuarter(double x, double* c, double* s) {
  const double x2 = x * x;
  double cp = 1.0 / 479001600.0;   // 1/12!
  double sp = 1.0 / 6227020800.0;  // 1/13!
  constexpr double kCos[] = {-1.0 / 3628800.0, 1.0 / 40320.0, -1.0 / 720.0, 1.0 / 24.0, -1.0 / 2.0, 1.0};
  constexpr double kSin[] = {-1.0 / 39916800.0, 1.0 / 362880.0, -1.0 / 5040.0, 1.0 / 120.0, -1.0 / 6.0, 1.0};
  for (int k = 0; k < 6; ++k) {
    cp = cp * x2 + kCos[k];
    sp = sp * x2 + kSin[k];
  }
  *c = cp;
  *s = sp * x;
}

/// Fills `out` with standard normal values: Box-Muller, both outputs of each pair used.
void fillStandardNormal(Xoshiro256& rng, float* out, std::int64_t n) {
  constexpr double kInv53 = 1.0 / 9007199254740992.0;  // 2^-53
  constexpr double kQuarterPi = std::numbers::pi / 4.0;
  for (std::int64_t i = 0; i < n; i += 2) {
    const double u1 = (static_cast<double>(rng.next() >> 11) + 1.0) * kInv53;  // (0, 1]: log is finite
    const std::uint64_t a = rng.next();
    // The uniform angle: quadrant q from two bits, then an offset in [-pi/4, pi/4) from 53 more.
    const auto q = static_cast<unsigned>(a & 3);
    const double x = (static_cast<double>(a >> 11) * kInv53 * 2.0 - 1.0) * kQuarterPi;
    double c = 0;
    double s = 0;
    cosSinQuarter(x, &c, &s);
    // Rotate by q quarter turns.
    const double cq = q == 0 ? c : q == 1 ? -s : q == 2 ? -c : s;
    const double sq = q == 0 ? s : q == 1 ? c : q == 2 ? -s : -c;
    const double r = std::sqrt(-2.0 * lnUnit(u1));
    out[i] = static_cast<float>(r * cq);
    if (i + 1 < n) out[i + 1] = static_cast<float>(r * sq);
  }
}

/// float -> nearest bf16 value (ties to even), for the finite values generated here.
float roundToBf16(float v) {
  std::uint32_t bits = std::bit_cast<std::uint32_t>(v);
  bits += 0x7FFFU + ((bits >> 16) & 1U);
  return std::bit_cast<float>(bits & 0xFFFF0000U);
}

// ---- How each tensor is initialised ----

struct Recipe {
  double mean = 0.0;
  double stddev = 1.0;
  std::uint64_t stream_key = 0;  ///< copies (MTP embed/head) share the original's key
  bool round_to_bf16 = true;
};

bool endsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

Recipe recipeFor(const ModelConfig& config, const TensorSpec& spec, std::uint64_t seed) {
  std::string_view stream_name = spec.name;
  Recipe r;
  const auto fan_in = [&] { return static_cast<double>(spec.shape.back()); };
  const bool is_head = spec.name == "lm_head.weight" || endsWith(spec.name, "shared_head.head.weight");
  if (endsWith(spec.name, "embed_tokens.weight") || (is_head && config.tie_word_embeddings)) {
    stream_name = "model.embed_tokens.weight";
    r.stddev = 0.5;
  } else if (is_head) {
    stream_name = "lm_head.weight";
    r.stddev = 2.5 / std::sqrt(fan_in());  // logits std ~2.5 (golden README 1)
  } else if (endsWith(spec.name, "norm.weight")) {
    r.mean = 1.0;
    r.stddev = 0.1;
  } else if (endsWith(spec.name, "e_score_correction_bias")) {
    r.stddev = 0.05;
    r.round_to_bf16 = false;
  } else {
    r.stddev = 1.0 / std::sqrt(fan_in());
  }
  std::uint64_t state = seed;
  r.stream_key = splitmix64(state) ^ fnv1a64(stream_name);
  return r;
}

/// Row `row` of a tensor, as the values a BF16 checkpoint holds (exact in float).
void generateRow(const Recipe& recipe, std::int64_t row, float* out, std::int64_t cols) {
  std::uint64_t state = recipe.stream_key ^ (static_cast<std::uint64_t>(row) * 0xD1B54A32D192ED03ULL);
  Xoshiro256 rng(splitmix64(state));
  fillStandardNormal(rng, out, cols);
  for (std::int64_t j = 0; j < cols; ++j) {
    const auto v = static_cast<float>(recipe.mean + recipe.stddev * static_cast<double>(out[j]));
    out[j] = recipe.round_to_bf16 ? roundToBf16(v) : v;
  }
}

// ---- Generation plan ----

struct PlannedTensor {
  TensorSpec spec;
  Recipe recipe;
  std::int64_t rows = 1;  ///< shape[0] for 2-D tensors, 1 for vectors
  std::int64_t cols = 1;
  std::uint64_t bytes = 0;
  std::int64_t scale_index = -1;  ///< index (in the shard's list) of this weight's scale tensor
};

std::uint64_t specBytes(const TensorSpec& s) {
  std::uint64_t n = 1;
  for (const auto d : s.shape) n *= static_cast<std::uint64_t>(d);
  return n * dtypeSize(s.dtype);
}

/// One unit of parallel work: rows [row_begin, row_end) of one tensor (whole FP8 row blocks).
struct WorkItem {
  std::size_t tensor = 0;
  std::int64_t row_begin = 0;
  std::int64_t row_end = 0;
};

void runWorkItem(const std::vector<PlannedTensor>& tensors, std::vector<std::vector<std::byte>>& buffers,
                 const WorkItem& item, std::int64_t block_out, std::int64_t block_in) {
  const PlannedTensor& t = tensors[item.tensor];
  std::byte* out = buffers[item.tensor].data();
  const std::int64_t cols = t.cols;
  const std::int64_t nrows = item.row_end - item.row_begin;
  std::vector<float> values(static_cast<std::size_t>(nrows * cols));
  for (std::int64_t r = 0; r < nrows; ++r) {
    generateRow(t.recipe, item.row_begin + r, values.data() + r * cols, cols);
  }
  switch (t.spec.dtype) {
    case DType::F32:
      std::memcpy(out + item.row_begin * cols * 4, values.data(), values.size() * 4);
      return;
    case DType::BF16:
      for (std::size_t i = 0; i < values.size(); ++i) {
        // The values are bf16-exact already, so the top half of the float is the bf16 code.
        const auto bits = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(values[i]) >> 16);
        std::memcpy(out + (static_cast<std::size_t>(item.row_begin * cols) + i) * 2, &bits, 2);
      }
      return;
    case DType::F8E4M3: {
      PD_CHECK(t.scale_index >= 0 && item.row_begin % block_out == 0);
      std::byte* scales = buffers[static_cast<std::size_t>(t.scale_index)].data();
      const std::int64_t scale_cols = (cols + block_in - 1) / block_in;
      for (std::int64_t rb = 0; rb < nrows; rb += block_out) {
        const std::int64_t r_end = std::min(nrows, rb + block_out);
        for (std::int64_t cb = 0; cb < cols; cb += block_in) {
          const std::int64_t c_end = std::min(cols, cb + block_in);
          float amax = 0.0F;
          for (std::int64_t r = rb; r < r_end; ++r) {
            for (std::int64_t c = cb; c < c_end; ++c)
              amax = std::max(amax, std::fabs(values[static_cast<std::size_t>(r * cols + c)]));
          }
          const float scale = amax > 0.0F ? amax / 448.0F : 1.0F;
          const std::int64_t scale_pos = ((item.row_begin + rb) / block_out) * scale_cols + cb / block_in;
          std::memcpy(scales + scale_pos * 4, &scale, 4);
          for (std::int64_t r = rb; r < r_end; ++r) {
            for (std::int64_t c = cb; c < c_end; ++c) {
              const std::uint8_t code = floatToFp8e4m3(values[static_cast<std::size_t>(r * cols + c)] / scale);
              out[(item.row_begin + r) * cols + c] = static_cast<std::byte>(code);
            }
          }
        }
      }
      return;
    }
    default:
      PD_CHECK_MSG(false, "make-model generates only BF16, F32 and F8_E4M3 tensors");
  }
}

/// Generates every tensor of one shard (scales included) on all cores.
void generateShard(const std::vector<PlannedTensor>& tensors, std::vector<std::vector<std::byte>>& buffers,
                   std::int64_t block_out, std::int64_t block_in) {
  constexpr std::int64_t kElementsPerItem = std::int64_t{1} << 20;
  std::vector<WorkItem> items;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const PlannedTensor& t = tensors[i];
    buffers[i].assign(t.bytes, std::byte{0});
    if (t.spec.is_scale) continue;  // filled by its weight's work items
    const std::int64_t granule = t.spec.dtype == DType::F8E4M3 ? block_out : 1;
    std::int64_t rows_per_item = std::max<std::int64_t>(1, kElementsPerItem / std::max<std::int64_t>(1, t.cols));
    rows_per_item = std::max(granule, rows_per_item / granule * granule);
    for (std::int64_t r = 0; r < t.rows; r += rows_per_item) {
      items.push_back(WorkItem{i, r, std::min(t.rows, r + rows_per_item)});
    }
  }
  std::atomic<std::size_t> next{0};
  auto worker = [&] {
    for (std::size_t k = next.fetch_add(1); k < items.size(); k = next.fetch_add(1)) {
      runWorkItem(tensors, buffers, items[k], block_out, block_in);
    }
  };
  const unsigned threads = std::clamp(std::thread::hardware_concurrency(), 1U, 64U);
  std::vector<std::thread> pool;
  for (unsigned i = 1; i < threads && i < items.size(); ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

Status writeTextFile(const std::filesystem::path& path, std::string_view text) {
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    if (!out) return makeError(ErrorCode::Io, fmt::format("{}: write failed", tmp.string()));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return makeError(ErrorCode::Io, fmt::format("{}: rename failed: {}", path.string(), ec.message()));
  return okStatus();
}

/// Copies one file atomically (temp name + rename) so readers never see a partial file.
Status copyFileAtomic(const std::filesystem::path& from, const std::filesystem::path& to) {
  const std::filesystem::path tmp = to.string() + ".tmp";
  std::error_code ec;
  std::filesystem::copy_file(from, tmp, std::filesystem::copy_options::overwrite_existing, ec);
  if (!ec) std::filesystem::rename(tmp, to, ec);
  if (ec) {
    return makeError(ErrorCode::Io, fmt::format("copying {} to {}: {}", from.string(), to.string(), ec.message()));
  }
  return okStatus();
}

constexpr std::array<std::string_view, 2> kTokenizerFiles = {"tokenizer.json", "tokenizer_config.json"};

Status copyTokenizer(const std::filesystem::path& tokenizer_dir, const std::filesystem::path& model_dir) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(tokenizer_dir / "tokenizer.json", ec)) {
    return makeError(ErrorCode::NotFound, fmt::format("{}: no such file (the tokenizer folder needs tokenizer.json)",
                                                      (tokenizer_dir / "tokenizer.json").string()));
  }
  for (const auto name : kTokenizerFiles) {
    const std::filesystem::path from = tokenizer_dir / name;
    if (!std::filesystem::is_regular_file(from, ec)) continue;
    PD_TRY(copyFileAtomic(from, model_dir / name));
  }
  return okStatus();
}

bool isModelFile(const std::filesystem::path& p) {
  const std::string name = p.filename().string();
  return name == "config.json" || name == "model.safetensors.index.json" || endsWith(name, ".safetensors");
}

Status prepareOutDir(const std::filesystem::path& out_dir, bool overwrite) {
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return makeError(ErrorCode::Io, fmt::format("{}: cannot create: {}", out_dir.string(), ec.message()));
  std::vector<std::filesystem::path> stale;
  bool non_empty = false;
  for (const auto& entry : std::filesystem::directory_iterator(out_dir, ec)) {
    non_empty = true;
    if (isModelFile(entry.path())) stale.push_back(entry.path());
  }
  if (ec) return makeError(ErrorCode::Io, fmt::format("{}: cannot list: {}", out_dir.string(), ec.message()));
  if (non_empty && !overwrite) {
    return makeError(
        ErrorCode::InvalidArgument,
        fmt::format("{}: folder is not empty (pass --force to replace the model in it)", out_dir.string()));
  }
  for (const auto& p : stale) {
    std::filesystem::remove(p, ec);
    if (ec) return makeError(ErrorCode::Io, fmt::format("{}: cannot remove: {}", p.string(), ec.message()));
  }
  return okStatus();
}

}  // namespace

std::vector<std::string> presetNames() {
  return {"tiny", "small", "bench", "default", std::string(kV3Prefix) + "N"};
}

Result<ModelConfig> presetConfig(std::string_view preset) {
  if (preset == "tiny") return tinyConfig();
  if (preset == "small") return smallConfig();
  if (preset == "bench") return benchConfig();
  if (preset == "default") return defaultConfig();
  if (preset.starts_with(kV3Prefix)) {
    const std::string_view digits = preset.substr(kV3Prefix.size());
    std::int64_t layers = 0;
    const auto res = std::from_chars(digits.data(), digits.data() + digits.size(), layers);
    if (res.ec == std::errc() && res.ptr == digits.data() + digits.size() && layers >= 1 && layers <= kV3MaxLayers) {
      return deepseekV3Config(layers);
    }
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("preset '{}': the layer count must be an integer in 1..{}", preset, kV3MaxLayers));
  }
  return makeError(ErrorCode::InvalidArgument, fmt::format("unknown preset '{}' (one of: tiny, small, bench, default, "
                                                           "deepseek-v3-layers=N)",
                                                           preset));
}

std::vector<std::string> dimensionKeys() {
  std::vector<std::string> keys;
  keys.reserve(kDimensionFields.size());
  for (const auto& f : kDimensionFields) keys.emplace_back(f.key);
  return keys;
}

Status setDimension(ModelConfig& config, std::string_view key, std::int64_t value) {
  for (const auto& f : kDimensionFields) {
    if (f.key == key) {
      config.*f.field = value;
      return okStatus();
    }
  }
  return makeError(ErrorCode::InvalidArgument, fmt::format("'{}' is not a model dimension", key));
}

Result<MakeModelSummary> makeModel(const ModelConfig& config, const std::filesystem::path& out_dir,
                                   const MakeModelOptions& options) {
  PD_TRY(config.validate());
  if (options.max_shard_bytes == 0) return makeError(ErrorCode::InvalidArgument, "max shard size must be positive");
  if (!options.tokenizer_dir.empty()) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(options.tokenizer_dir / "tokenizer.json", ec)) {
      return makeError(ErrorCode::NotFound, fmt::format("{}: no such file (the tokenizer folder needs tokenizer.json)",
                                                        (options.tokenizer_dir / "tokenizer.json").string()));
    }
  }
  PD_TRY(prepareOutDir(out_dir, options.overwrite));

  // Plan: a weight and its scale are one unit, kept in the same shard.
  const std::vector<TensorSpec> specs = expectedTensors(config);
  std::vector<std::vector<PlannedTensor>> shards(1);
  std::uint64_t shard_bytes = 0;
  MakeModelSummary summary;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const bool has_scale = i + 1 < specs.size() && specs[i + 1].is_scale;
    std::uint64_t unit_bytes = specBytes(specs[i]) + (has_scale ? specBytes(specs[i + 1]) : 0);
    if (!shards.back().empty() && shard_bytes + unit_bytes > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    for (std::size_t j = i; j <= i + (has_scale ? 1 : 0); ++j) {
      PlannedTensor t;
      t.spec = specs[j];
      t.recipe = recipeFor(config, specs[j], options.seed);
      t.rows = specs[j].shape.size() == 2 ? specs[j].shape[0] : 1;
      t.cols = specs[j].shape.back();
      t.bytes = specBytes(specs[j]);
      shards.back().push_back(std::move(t));
    }
    if (has_scale) {
      shards.back()[shards.back().size() - 2].scale_index = static_cast<std::int64_t>(shards.back().size() - 1);
      ++i;
    }
    shard_bytes += unit_bytes;
    summary.tensor_bytes += unit_bytes;
  }
  summary.shards = static_cast<std::int64_t>(shards.size());

  const std::int64_t block_out = config.quantization ? config.quantization->block_out : 128;
  const std::int64_t block_in = config.quantization ? config.quantization->block_in : 128;
  std::map<std::string, std::string> weight_map;
  for (std::size_t s = 0; s < shards.size(); ++s) {
    const std::string file_name = shards.size() == 1
                                      ? std::string("model.safetensors")
                                      : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    std::vector<std::vector<std::byte>> buffers(shards[s].size());
    generateShard(shards[s], buffers, block_out, block_in);
    std::vector<TensorToWrite> to_write;
    to_write.reserve(shards[s].size());
    for (std::size_t i = 0; i < shards[s].size(); ++i) {
      const TensorSpec& spec = shards[s][i].spec;
      to_write.push_back(TensorToWrite{spec.name, spec.dtype, spec.shape, buffers[i]});
      weight_map[spec.name] = file_name;
    }
    PD_TRY(writeSafetensors(out_dir / file_name, to_write));
    summary.tensors += static_cast<std::int64_t>(to_write.size());
  }
  if (shards.size() > 1) {
    PD_TRY(writeSafetensorsIndex(out_dir / "model.safetensors.index.json", weight_map, summary.tensor_bytes));
  }
  if (!options.tokenizer_dir.empty()) PD_TRY(copyTokenizer(options.tokenizer_dir, out_dir));
  // config.json last: a folder with a config.json is a finished model.
  PD_TRY(writeTextFile(out_dir / "config.json", config.toJson()));
  return summary;
}

Result<std::filesystem::path> ensureDefaultModel(const std::filesystem::path& cache_dir) {
  const std::filesystem::path models = cache_dir / "models";
  const std::filesystem::path dir = models / ("default-" + std::string(defaultModelSha256().substr(0, 12)));
  std::error_code ec;
  if (std::filesystem::is_regular_file(dir / "config.json", ec)) return dir;

  std::filesystem::create_directories(models, ec);
  if (ec) return makeError(ErrorCode::Io, fmt::format("{}: cannot create: {}", models.string(), ec.message()));
  const auto nonce = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  const std::filesystem::path tmp = models / fmt::format(".default.tmp-{}-{:x}", ::getpid(), nonce);
  auto write_all = [&]() -> Status {
    std::filesystem::create_directories(tmp, ec);
    if (ec) return makeError(ErrorCode::Io, fmt::format("{}: cannot create: {}", tmp.string(), ec.message()));
    // config.json last: its presence marks a complete folder.
    std::vector<EmbeddedFile> files(defaultModelFiles().begin(), defaultModelFiles().end());
    std::stable_partition(files.begin(), files.end(), [](const EmbeddedFile& f) { return f.name != "config.json"; });
    for (const EmbeddedFile& f : files) {
      const std::filesystem::path path = tmp / f.name;
      std::FILE* out = std::fopen(path.c_str(), "wb");
      if (out == nullptr) return makeError(ErrorCode::Io, fmt::format("{}: cannot create", path.string()));
      const bool ok = std::fwrite(f.bytes.data(), 1, f.bytes.size(), out) == f.bytes.size();
      if (std::fclose(out) != 0 || !ok) return makeError(ErrorCode::Io, fmt::format("{}: write failed", path.string()));
    }
    return okStatus();
  };
  if (Status s = write_all(); !s.ok()) {
    std::filesystem::remove_all(tmp, ec);
    return s.error();
  }
  std::filesystem::rename(tmp, dir, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove_all(tmp, ignored);
    // Another process may have finished first: its copy is as good as ours.
    if (std::filesystem::is_regular_file(dir / "config.json", ignored)) return dir;
    return makeError(ErrorCode::Io, fmt::format("{}: cannot create the default model: {}", dir.string(), ec.message()));
  }
  return dir;
}

}  // namespace pd
