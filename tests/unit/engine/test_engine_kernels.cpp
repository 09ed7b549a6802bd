// CPU kernels of the model engine (every ISA against the generic one, FP8 dequantization exact),
// the thread pool and the sampler.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "pd/common/dtype.h"
#include "pd/engine/kernels.h"
#include "pd/engine/sampling.h"
#include "pd/engine/thread_pool.h"

namespace pd::model {
namespace {

// A random weight matrix in one dtype, with the bytes kept alive.
struct TestMatrix {
  std::vector<std::uint8_t> bytes;
  std::vector<float> scales;
  WeightMatrix w;
};

TestMatrix makeMatrix(DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t block, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  TestMatrix m;
  m.w.dtype = dtype;
  m.w.rows = rows;
  m.w.cols = cols;
  m.w.block_rows = block;
  m.w.block_cols = block;
  m.bytes.resize(static_cast<std::size_t>(rows * cols) * dtypeSize(dtype));
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    const float v = normal(rng);
    switch (dtype) {
      case DType::F32:
        std::memcpy(m.bytes.data() + i * 4, &v, 4);
        break;
      case DType::BF16: {
        const std::uint16_t h = floatToBf16(v);
        std::memcpy(m.bytes.data() + i * 2, &h, 2);
        break;
      }
      case DType::F16: {
        // Random normal f16 numbers of magnitude 2^-5 .. 2^5.
        const auto h = static_cast<std::uint16_t>(((rng() & 1U) << 15) | ((10 + rng() % 10) << 10) | (rng() & 0x3FFU));
        std::memcpy(m.bytes.data() + i * 2, &h, 2);
        break;
      }
      case DType::F8E4M3:
        m.bytes[static_cast<std::size_t>(i)] = floatToFp8e4m3(v * 100.0F);
        break;
      default:
        break;
    }
  }
  m.w.data = m.bytes.data();
  if (dtype == DType::F8E4M3) {
    m.scales.resize(static_cast<std::size_t>(m.w.scaleRows() * m.w.scaleCols()));
    std::uniform_real_distribution<float> u(0.001F, 0.02F);
    for (float& s : m.scales) s = u(rng);
    m.w.scale_inv = m.scales.data();
  }
  return m;
}

std::vector<float> randomVector(std::int64_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

std::vector<CpuIsa> supportedIsas() {
  std::vector<CpuIsa> out;
  for (const CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512}) {
    if (cpuSupports(isa)) out.push_back(isa);
  }
  return out;
}

// Float64 reference of y = W x over dequantized rows.
std::vector<double> referenceMatmul(const WeightMatrix& w, const std::vector<float>& x, std::int64_t n) {
  std::vector<double> y(static_cast<std::size_t>(n * w.rows));
  std::vector<float> row(static_cast<std::size_t>(w.cols));
  for (std::int64_t r = 0; r < w.rows; ++r) {
    dequantizeRow(w, r, row.data());
    for (std::int64_t t = 0; t < n; ++t) {
      double s = 0.0;
      for (std::int64_t c = 0; c < w.cols; ++c)
        s += static_cast<double>(row[static_cast<std::size_t>(c)]) * x[static_cast<std::size_t>(t * w.cols + c)];
      y[static_cast<std::size_t>(t * w.rows + r)] = s;
    }
  }
  return y;
}

TEST(EngineKernels, Fp8DequantizationIsTheFloat32Product) {
  const TestMatrix m = makeMatrix(DType::F8E4M3, 200, 300, 128, 1);
  std::vector<float> row(300);
  const float* table = fp8e4m3Table();
  for (std::int64_t r = 0; r < 200; r += 37) {
    dequantizeRow(m.w, r, row.data());
    for (std::int64_t c = 0; c < 300; ++c) {
      const float want = table[m.bytes[static_cast<std::size_t>(r * 300 + c)]] *
                         m.scales[static_cast<std::size_t>((r / 128) * 3 + c / 128)];
      ASSERT_EQ(row[static_cast<std::size_t>(c)], want) << r << "," << c;
    }
  }
}

TEST(EngineKernels, MatmulEveryIsaAndDtypeMatchesFloat64) {
  struct Shape {
    std::int64_t rows, cols, tokens, block;
  };
  const Shape shapes[] = {{13, 100, 1, 128}, {64, 256, 5, 128}, {37, 300, 7, 128}, {40, 96, 3, 32}, {9, 17, 2, 128}};
  for (const CpuIsa isa : supportedIsas()) {
    const KernelTable& k = kernelTable(isa);
    for (const DType dtype : {DType::F32, DType::BF16, DType::F16, DType::F8E4M3}) {
      for (const Shape& s : shapes) {
        const TestMatrix m = makeMatrix(dtype, s.rows, s.cols, s.block, 7);
        const std::vector<float> x = randomVector(s.tokens * s.cols, 11);
        const std::vector<double> want = referenceMatmul(m.w, x, s.tokens);
        // Whole matrix, then a row range written with an output stride.
        std::vector<float> y(static_cast<std::size_t>(s.tokens * s.rows), -1.0F);
        k.matmul(m.w, 0, s.rows, x.data(), s.cols, s.tokens, y.data(), s.rows);
        double scale = 0.0;
        for (const double v : want) scale = std::max(scale, std::abs(v));
        for (std::size_t i = 0; i < y.size(); ++i) {
          ASSERT_NEAR(y[i], want[i], 1e-5 * (scale + 1.0))
              << cpuIsaName(isa) << " " << dtypeName(dtype) << " " << s.rows << "x" << s.cols << " i=" << i;
        }
        const std::int64_t r0 = s.rows / 3;
        const std::int64_t r1 = s.rows - 1;
        std::vector<float> part(static_cast<std::size_t>(s.tokens * (r1 - r0)));
        k.matmul(m.w, r0, r1, x.data(), s.cols, s.tokens, part.data(), r1 - r0);
        for (std::int64_t t = 0; t < s.tokens; ++t) {
          for (std::int64_t r = r0; r < r1; ++r) {
            ASSERT_NEAR(part[static_cast<std::size_t>(t * (r1 - r0) + r - r0)],
                        want[static_cast<std::size_t>(t * s.rows + r)], 1e-5 * (scale + 1.0));
          }
        }
      }
    }
  }
}

// matmul_batch_invariant: each output element has the same bits whatever the number of tokens in
// the call (1, the one-token GEMV's case; 2-7, the tiles; 8 and more, the row panels) and whatever
// rows share it. And it is a correct product (float64 reference).
TEST(EngineKernels, BatchInvariantMatmulGivesEveryTokenTheBitsOfItsOwnCall) {
  const std::int64_t rows = 37;
  const std::int64_t cols = 300;
  for (const CpuIsa isa : supportedIsas()) {
    const KernelTable& k = kernelTable(isa);
    for (const DType dtype : {DType::F32, DType::BF16, DType::F16, DType::F8E4M3}) {
      const TestMatrix m = makeMatrix(dtype, rows, cols, 128, 5);
      for (const std::int64_t n : {2, 5, 8, 13}) {
        const std::vector<float> x = randomVector(n * cols, 17);
        std::vector<float> all(static_cast<std::size_t>(n * rows));
        k.matmul_batch_invariant(m.w, 0, rows, x.data(), cols, n, all.data(), rows);
        const std::vector<double> want = referenceMatmul(m.w, x, n);
        double scale = 0.0;
        for (const double v : want) scale = std::max(scale, std::abs(v));
        for (std::int64_t t = 0; t < n; ++t) {
          std::vector<float> one(static_cast<std::size_t>(rows));
          k.matmul_batch_invariant(m.w, 0, rows, x.data() + t * cols, cols, 1, one.data(), rows);
          std::vector<float> some(static_cast<std::size_t>(rows - 5));  // rows [5, rows) alone
          k.matmul_batch_invariant(m.w, 5, rows, x.data() + t * cols, cols, 1, some.data(), rows - 5);
          for (std::int64_t r = 0; r < rows; ++r) {
            const float y = all[static_cast<std::size_t>(t * rows + r)];
            ASSERT_EQ(std::bit_cast<std::uint32_t>(one[static_cast<std::size_t>(r)]), std::bit_cast<std::uint32_t>(y))
                << cpuIsaName(isa) << " " << dtypeName(dtype) << " n=" << n << " t=" << t << " r=" << r;
            if (r >= 5) {
              ASSERT_EQ(std::bit_cast<std::uint32_t>(some[static_cast<std::size_t>(r - 5)]),
                        std::bit_cast<std::uint32_t>(y));
            }
            ASSERT_NEAR(y, want[static_cast<std::size_t>(t * rows + r)], 1e-5 * (scale + 1.0));
          }
        }
      }
    }
  }
}

TEST(EngineKernels, MatmulTransposedEveryIsaAndDtypeMatchesFloat64) {
  for (const CpuIsa isa : supportedIsas()) {
    const KernelTable& k = kernelTable(isa);
    for (const DType dtype : {DType::F32, DType::BF16, DType::F16, DType::F8E4M3}) {
      for (const std::int64_t cols : {64, 100, 512}) {
        const std::int64_t rows = 80;
        const std::int64_t r0 = 16, r1 = 48, tokens = 6;
        const TestMatrix m = makeMatrix(dtype, rows, cols, 128, 3);
        const std::vector<float> x = randomVector(tokens * (r1 - r0), 5);
        std::vector<float> y = randomVector(tokens * cols, 9);
        std::vector<double> want(y.begin(), y.end());
        std::vector<float> row(static_cast<std::size_t>(cols));
        for (std::int64_t r = r0; r < r1; ++r) {
          dequantizeRow(m.w, r, row.data());
          for (std::int64_t t = 0; t < tokens; ++t) {
            for (std::int64_t c = 0; c < cols; ++c) {
              want[static_cast<std::size_t>(t * cols + c)] +=
                  static_cast<double>(x[static_cast<std::size_t>(t * (r1 - r0) + r - r0)]) *
                  row[static_cast<std::size_t>(c)];
            }
          }
        }
        k.matmulTransposed(m.w, r0, r1, x.data(), r1 - r0, tokens, y.data(), cols);
        for (std::size_t i = 0; i < y.size(); ++i) {
          ASSERT_NEAR(y[i], want[i], 1e-4 * (std::abs(want[i]) + 1.0)) << cpuIsaName(isa) << " " << dtypeName(dtype);
        }
      }
    }
  }
}

TEST(EngineKernels, DotAndAxpyEveryIsa) {
  for (const CpuIsa isa : supportedIsas()) {
    const KernelTable& k = kernelTable(isa);
    for (const std::int64_t n : {1, 15, 16, 33, 576}) {
      const std::vector<float> a = randomVector(n, 1);
      const std::vector<float> b = randomVector(n, 2);
      double want = 0.0;
      for (std::int64_t i = 0; i < n; ++i)
        want += static_cast<double>(a[static_cast<std::size_t>(i)]) * b[static_cast<std::size_t>(i)];
      EXPECT_NEAR(k.dot(a.data(), b.data(), n), want, 1e-4) << cpuIsaName(isa) << " n=" << n;
      std::vector<float> y = b;
      k.axpy(0.5F, a.data(), y.data(), n);
      for (std::int64_t i = 0; i < n; ++i) {
        EXPECT_FLOAT_EQ(y[static_cast<std::size_t>(i)],
                        b[static_cast<std::size_t>(i)] + 0.5F * a[static_cast<std::size_t>(i)]);
      }
    }
  }
}

TEST(EngineKernels, DetectedIsaIsSupported) {
  EXPECT_TRUE(cpuSupports(detectCpuIsa()));
  EXPECT_TRUE(cpuSupports(CpuIsa::Generic));
}

TEST(ThreadPool, EveryTaskRunsOnceAcrossManyRegions) {
  ThreadPool pool(3);
  EXPECT_EQ(pool.size(), 3);
  std::vector<std::atomic<int>> hits(1000);
  for (int region = 0; region < 200; ++region) {
    const std::int64_t n = 1 + (region * 37) % 1000;
    pool.run(n, [&](std::int64_t t) { hits[static_cast<std::size_t>(t)].fetch_add(1); });
  }
  std::int64_t total = 0;
  for (auto& h : hits) total += h.load();
  std::int64_t want = 0;
  for (int region = 0; region < 200; ++region) want += 1 + (region * 37) % 1000;
  EXPECT_EQ(total, want);
  std::vector<int> covered(1001, 0);
  pool.parallelFor(1001, 10, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) covered[static_cast<std::size_t>(i)] += 1;
  });
  for (const int c : covered) EXPECT_EQ(c, 1);
}

std::vector<float> someLogits() {
  std::vector<float> l = randomVector(500, 42);
  for (float& v : l) v *= 2.5F;
  return l;
}

TEST(Sampling, GreedyIsArgmaxLowestIdOnTies) {
  std::vector<float> l{0.0F, 3.0F, -1.0F, 3.0F};
  Sampler s(SamplingParams{});
  EXPECT_EQ(s.sample(l).token, 1);
  EXPECT_EQ(argmax(l), 1);
}

TEST(Sampling, SameSeedSameTokensDifferentSeedDifferent) {
  const std::vector<float> l = someLogits();
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 1234;
  Sampler a(p), b(p);
  p.seed = 99;
  Sampler c(p);
  int differ = 0;
  for (int i = 0; i < 64; ++i) {
    const std::int32_t ta = a.sample(l).token;
    EXPECT_EQ(ta, b.sample(l).token);
    differ += ta != c.sample(l).token;
  }
  EXPECT_GT(differ, 10);
}

TEST(Sampling, FrequenciesFollowTheSoftmax) {
  const std::vector<float> l{1.0F, 2.0F, 0.0F, 1.5F};
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 7;
  Sampler s(p);
  std::map<std::int32_t, int> counts;
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++counts[s.sample(l).token];
  double z = 0.0;
  for (const float v : l) z += std::exp(v);
  for (int t = 0; t < 4; ++t) {
    EXPECT_NEAR(counts[t] / static_cast<double>(n), std::exp(l[static_cast<std::size_t>(t)]) / z, 0.015) << t;
  }
}

TEST(Sampling, TopKTopPMinPRestrictTheSupport) {
  const std::vector<float> l = someLogits();
  const std::int32_t best = argmax(l);
  SamplingParams p;
  p.temperature = 5.0;  // flat enough that anything could come out
  p.seed = 3;
  p.top_k = 1;
  Sampler k1(p);
  p.top_k = 0;
  p.top_p = 1e-6;
  Sampler p_small(p);
  p.top_p = 1.0;
  p.min_p = 1.0;
  Sampler m1(p);
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(k1.sample(l).token, best);
    EXPECT_EQ(p_small.sample(l).token, best);
    EXPECT_EQ(m1.sample(l).token, best);
  }
  // top_k = 3: only the three largest logits ever come out.
  std::vector<std::int32_t> idx(l.size());
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<std::int32_t>(i);
  std::sort(idx.begin(), idx.end(), [&](std::int32_t a, std::int32_t b) {
    return l[static_cast<std::size_t>(a)] > l[static_cast<std::size_t>(b)];
  });
  p.min_p = 0.0;
  p.top_k = 3;
  Sampler k3(p);
  std::map<std::int32_t, int> seen;
  for (int i = 0; i < 300; ++i) ++seen[k3.sample(l).token];
  EXPECT_EQ(seen.size(), 3U);
  for (const auto& [tok, cnt] : seen) EXPECT_TRUE(tok == idx[0] || tok == idx[1] || tok == idx[2]);
}

TEST(Sampling, PenaltiesDiscourageRepeats) {
  std::vector<float> l(10, 0.0F);
  l[4] = 1.0F;
  SamplingParams p;
  p.presence_penalty = 1.5;
  Sampler s(p);
  EXPECT_EQ(s.sample(l).token, 4);
  EXPECT_EQ(s.sample(l).token, 0);  // 4 is now 1 - 1.5 < 0; the first zero wins
  SamplingParams f;
  f.frequency_penalty = 0.4;
  Sampler fs(f);
  EXPECT_EQ(fs.sample(l).token, 4);  // 1.0
  EXPECT_EQ(fs.sample(l).token, 4);  // 0.6
  EXPECT_EQ(fs.sample(l).token, 4);  // 0.2
  EXPECT_EQ(fs.sample(l).token, 0);  // -0.2
}

TEST(Sampling, LogprobsAreRawLogSoftmax) {
  const std::vector<float> l = someLogits();
  SamplingParams p;
  p.top_logprobs = 5;
  p.temperature = 0.7;
  p.seed = 5;
  Sampler s(p);
  const SampledToken t = s.sample(l);
  double z = 0.0;
  for (const float v : l) z += std::exp(static_cast<double>(v));
  EXPECT_NEAR(t.logprob, l[static_cast<std::size_t>(t.token)] - std::log(z), 1e-4);
  ASSERT_EQ(t.top.size(), 5U);
  EXPECT_EQ(t.top[0].token, argmax(l));
  for (std::size_t i = 1; i < t.top.size(); ++i) EXPECT_GE(t.top[i - 1].logprob, t.top[i].logprob);
}

TEST(Sampling, WithoutLogprobsTheSameTokensComeWithoutValues) {
  const std::vector<float> l = someLogits();
  SamplingParams p;
  p.top_logprobs = 3;
  p.temperature = 0.9;
  p.presence_penalty = 0.3;
  p.seed = 17;
  Sampler with(p);
  Sampler without(p, /*logprobs=*/false);
  for (int i = 0; i < 16; ++i) {
    const SampledToken a = with.sample(l);
    const SampledToken b = without.sample(l);
    EXPECT_EQ(a.token, b.token) << i;  // same draws, same penalties
    EXPECT_LT(a.logprob, 0.0F);
    EXPECT_EQ(a.top.size(), 3U);
    EXPECT_EQ(b.logprob, 0.0F);
    EXPECT_TRUE(b.top.empty());
  }
}

TEST(Sampling, LogitBiasShiftsTheLogitsBeforeSampling) {
  const std::vector<float> l{0.0F, 3.0F, -1.0F, 2.0F};
  SamplingParams p;
  p.logit_bias = {{1, -100.0F}};
  Sampler greedy(p);
  EXPECT_EQ(greedy.sample(l).token, 3) << "the best token biased away";
  p.logit_bias = {{2, 4.5F}, {99, 100.0F}};  // id 99 is past the vocabulary: ignored
  Sampler boost(p);
  const SampledToken t = boost.sample(l);
  EXPECT_EQ(t.token, 2);
  double z = 0.0;
  for (const float v : l) z += std::exp(static_cast<double>(v));
  EXPECT_NEAR(t.logprob, -1.0 - std::log(z), 1e-5) << "logprobs stay those of the raw model";
  p.temperature = 1.0;
  p.seed = 11;
  p.logit_bias = {{0, -100.0F}, {1, -100.0F}, {2, -100.0F}};
  Sampler hot(p);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(hot.sample(l).token, 3);
}

TEST(Sampling, AllowedMaskRestrictsEveryMode) {
  const std::vector<float> l = someLogits();  // 500 tokens: 8 mask words
  std::vector<std::uint64_t> mask(8, 0);
  const std::vector<std::int32_t> allowed_ids{3, 77, 130, 499};
  for (const auto id : allowed_ids) mask[static_cast<std::size_t>(id) / 64] |= std::uint64_t{1} << (id % 64);
  auto isAllowed = [&](std::int32_t t) {
    return std::find(allowed_ids.begin(), allowed_ids.end(), t) != allowed_ids.end();
  };
  SamplingParams p;
  Sampler greedy(p);
  std::int32_t best = allowed_ids[0];
  for (const auto id : allowed_ids) {
    if (l[static_cast<std::size_t>(id)] > l[static_cast<std::size_t>(best)]) best = id;
  }
  EXPECT_EQ(greedy.sample(l, mask).token, best);
  p.temperature = 5.0;
  p.seed = 2;
  Sampler flat(p);
  p.top_k = 50;
  p.top_p = 0.9;
  p.min_p = 0.01;
  Sampler filtered(p);
  std::map<std::int32_t, int> seen;
  for (int i = 0; i < 400; ++i) {
    const auto a = flat.sample(l, mask).token;
    EXPECT_TRUE(isAllowed(a)) << a;
    ++seen[a];
    const auto b = filtered.sample(l, mask).token;
    EXPECT_TRUE(isAllowed(b)) << b;
  }
  EXPECT_EQ(seen.size(), allowed_ids.size()) << "at temperature 5 every allowed token comes out";
}

// A sparse mask (at most one token in 16 allowed) is applied by gathering the allowed tokens; a
// dense one by masking a copy of every logit. Both must draw exactly what sampling the logits with
// -inf outside the mask draws, in every mode (greedy with ties, flat, top-k/top-p/min-p,
// penalties, logit_bias on allowed and masked ids), draw for draw over one RNG stream.
TEST(Sampling, SparseAndDenseMasksDrawWhatMinusInfinityLogitsDraw) {
  std::vector<float> l = randomVector(4096, 7);
  for (float& v : l) v *= 3.0F;
  l[1000] = l[2000] = 50.0F;  // a tie for greedy, both allowed below
  std::mt19937_64 rng(11);
  for (const std::size_t allowed_count : {1U, 2U, 5U, 60U, 256U, 257U, 1500U}) {  // 256 = 4096 / 16
    std::vector<std::uint64_t> mask(64, 0);
    std::vector<float> masked(l.size(), -std::numeric_limits<float>::infinity());
    std::set<std::size_t> ids{1000, 2000};
    while (ids.size() < allowed_count) ids.insert(rng() % l.size());
    while (ids.size() > allowed_count) ids.erase(ids.begin());
    for (const std::size_t id : ids) {
      mask[id / 64] |= std::uint64_t{1} << (id % 64);
      masked[id] = l[id];
    }
    SamplingParams greedy;
    SamplingParams flat;
    flat.temperature = 1.3;
    flat.seed = 3;
    flat.presence_penalty = 0.7;
    flat.frequency_penalty = 0.3;
    flat.logit_bias = {{static_cast<std::int32_t>(*ids.begin()), 2.0F}, {4095, 5.0F}};
    SamplingParams filtered = flat;
    filtered.top_k = 40;
    filtered.top_p = 0.8;
    filtered.min_p = 0.02;
    SamplingParams wide_k = flat;
    wide_k.top_k = 3000;  // more than the allowed tokens
    for (const SamplingParams& p : {greedy, flat, filtered, wide_k}) {
      Sampler with_mask(p, false);
      Sampler reference(p, false);
      for (int i = 0; i < 200; ++i) {
        const auto a = with_mask.sample(l, mask).token;
        const auto b = reference.sample(masked).token;
        ASSERT_EQ(a, b) << allowed_count << " allowed, draw " << i << ", temperature " << p.temperature;
        ASSERT_TRUE(ids.count(static_cast<std::size_t>(a)) == 1);
      }
    }
  }
}

// Whole mask words (all allowed, none allowed) and a partial last word (500 tokens end inside
// word 7) restrict sampling exactly as a per-token test would.
TEST(Sampling, AllowedMaskWithWholeWordsAndAPartialLastWord) {
  const std::vector<float> l = someLogits();  // 500 tokens
  std::vector<std::uint64_t> mask(8, 0);
  mask[1] = ~std::uint64_t{0};                   // 64..127
  mask[7] = std::uint64_t{1} << (498 - 7 * 64);  // 498
  const auto allowed = [](std::int32_t t) { return (t >= 64 && t < 128) || t == 498; };
  std::int32_t best = 64;
  for (std::int32_t t = 0; t < 500; ++t) {
    if (allowed(t) && l[static_cast<std::size_t>(t)] > l[static_cast<std::size_t>(best)]) best = t;
  }
  SamplingParams p;
  Sampler greedy(p);
  EXPECT_EQ(greedy.sample(l, mask).token, best);
  p.temperature = 50.0;
  p.seed = 5;
  Sampler flat(p);
  std::set<std::int32_t> seen;
  for (int i = 0; i < 3000; ++i) {
    const auto t = flat.sample(l, mask).token;
    EXPECT_TRUE(allowed(t)) << t;
    seen.insert(t);
  }
  EXPECT_TRUE(seen.contains(498));
  EXPECT_GT(seen.size(), 40U) << "a hot sampler reaches most of the all-allowed word";
}

TEST(Sampling, ValidateRejectsOutOfRange) {
  SamplingParams p;
  EXPECT_TRUE(validate(p).ok());
  p.top_p = 0.0;
  EXPECT_FALSE(validate(p).ok());
  p = {};
  p.temperature = -1.0;
  EXPECT_FALSE(validate(p).ok());
  p = {};
  p.top_logprobs = 21;
  EXPECT_FALSE(validate(p).ok());
  p = {};
  p.min_p = 1.5;
  EXPECT_FALSE(validate(p).ok());
  p = {};
  p.logit_bias = {{1, 100.5F}};
  EXPECT_FALSE(validate(p).ok());
  p.logit_bias = {{1, 1.0F}, {1, 2.0F}};
  EXPECT_FALSE(validate(p).ok());
  p.logit_bias = {{-1, 1.0F}};
  EXPECT_FALSE(validate(p).ok());
  p.logit_bias = {{1, -100.0F}, {2, 100.0F}};
  EXPECT_TRUE(validate(p).ok());
}

}  // namespace
}  // namespace pd::model
