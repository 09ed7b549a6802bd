// The CUDA engine's host plan (engine/cuda/forward_plan.h): a batch of chunks checked as the CPU
// engine checks it and cut into device steps of rows, each row attending to the positions up to
// its own; and the runs of cache slots copied between the host and device caches. Host
// arithmetic: runs in every build, GPU or not.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "forward_plan.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/model_config.h"

namespace {

namespace fs = std::filesystem;
using pd::gpu::CacheRun;
using pd::gpu::cacheRuns;
using pd::gpu::planForward;
using pd::model::OutputRows;
using pd::model::SequenceChunk;

pd::ModelConfig tiny() {
  auto c = pd::ModelConfig::load(fs::path(PD_TEST_DATA_DIR) / "golden" / "tiny-bf16");
  EXPECT_TRUE(c.ok()) << c.error().toString();
  return *c;
}

// A view with the geometry only (the plan never touches the memory).
pd::model::LatentCacheView view(const pd::ModelConfig& c, std::int64_t blocks, std::int64_t block_size,
                                pd::DType dtype = pd::DType::F32) {
  pd::model::LatentCacheView v;
  v.dtype = dtype;
  v.latent_dim = c.latentDim();
  v.block_size = block_size;
  v.num_blocks = blocks;
  v.layers.assign(static_cast<std::size_t>(c.kvLayers()), nullptr);
  return v;
}

TEST(ForwardPlan, CutsAPrefillChunkAndADecodeStepIntoRows) {
  const pd::ModelConfig c = tiny();
  const auto cache = view(c, 16, 4);
  const std::vector<std::int32_t> prompt{10, 11, 12, 13, 14};
  const std::vector<std::int32_t> one{99};
  const std::vector<std::int32_t> ta{3, 7};  // positions 0..7
  const std::vector<std::int32_t> tb{5, 9};
  std::vector<SequenceChunk> batch(2);
  batch[0].tokens = prompt;
  batch[0].start_pos = 3;  // positions 3..7: block 3 offset 3, then block 7
  batch[0].block_table = ta;
  batch[1].tokens = one;
  batch[1].start_pos = 6;
  batch[1].block_table = tb;
  batch[1].rope_offset = 1;
  auto plan = planForward(c, cache, batch, c.num_hidden_layers - 1, false, OutputRows::Last, OutputRows::All, 4);
  ASSERT_TRUE(plan.ok()) << plan.error().toString();
  EXPECT_EQ(plan->rows, 6);
  ASSERT_EQ(plan->steps.size(), 2U);
  const auto& s0 = plan->steps[0];
  const auto& s1 = plan->steps[1];
  EXPECT_EQ(s0.first_row, 0);
  EXPECT_EQ(s1.first_row, 4);
  EXPECT_EQ(s0.plan.token_ids, (std::vector<std::int32_t>{10, 11, 12, 13}));
  EXPECT_EQ(s0.plan.positions, (std::vector<std::int64_t>{3, 4, 5, 6}));
  EXPECT_EQ(s0.plan.ctx_len, (std::vector<std::int64_t>{4, 5, 6, 7}));  // causal: each row sees itself
  EXPECT_EQ(s0.plan.write_slot, (std::vector<std::int64_t>{3 * 4 + 3, 7 * 4, 7 * 4 + 1, 7 * 4 + 2}));
  EXPECT_EQ(s1.plan.token_ids, (std::vector<std::int32_t>{14, 99}));
  EXPECT_EQ(s1.plan.positions, (std::vector<std::int64_t>{7, 7}));  // 6 + rope_offset 1
  EXPECT_EQ(s1.plan.ctx_len, (std::vector<std::int64_t>{8, 7}));
  EXPECT_EQ(s1.plan.write_slot, (std::vector<std::int64_t>{7 * 4 + 3, 9 * 4 + 2}));
  // Logits of each sequence's last token only; hidden of every row.
  EXPECT_TRUE(s0.logit_rows.empty());
  EXPECT_EQ(s1.logit_rows, (std::vector<std::int64_t>{0, 1}));
  EXPECT_EQ(s0.hidden_rows, (std::vector<std::int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(s1.hidden_rows, (std::vector<std::int64_t>{0, 1}));
  EXPECT_EQ(plan->logit_rows, 2);
  EXPECT_EQ(plan->hidden_rows, 6);
  // What the sink is called with: sequence 0 in two pieces, each with its own start position.
  ASSERT_EQ(s0.sequences.size(), 1U);
  EXPECT_EQ(s0.sequences[0].sequence, 0U);
  EXPECT_EQ(s0.sequences[0].rows, 4);
  EXPECT_EQ(s0.sequences[0].start_pos, 3);
  ASSERT_EQ(s1.sequences.size(), 2U);
  EXPECT_EQ(s1.sequences[0].sequence, 0U);
  EXPECT_EQ(s1.sequences[0].first_row, 0);
  EXPECT_EQ(s1.sequences[0].start_pos, 7);
  EXPECT_EQ(s1.sequences[1].sequence, 1U);
  EXPECT_EQ(s1.sequences[1].first_row, 1);
  EXPECT_EQ(s1.sequences[1].start_pos, 6);
}

// Random batches: every row appears once, in batch order; a row attends exactly to its
// sequence's positions [0, its own], whose new ones all come from rows at or before it (so an
// earlier step or the same step wrote them before the layer's attention reads them); output
// rows are as asked.
TEST(ForwardPlan, RandomBatchesAreCausalAndComplete) {
  const pd::ModelConfig c = tiny();
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t block_size = 1 + static_cast<std::int64_t>(rng() % 8);
    const auto cache = view(c, 512, block_size);
    const int seqs = 1 + static_cast<int>(rng() % 6);
    std::vector<std::vector<std::int32_t>> tokens(static_cast<std::size_t>(seqs));
    std::vector<std::vector<std::int32_t>> tables(static_cast<std::size_t>(seqs));
    std::vector<SequenceChunk> batch(static_cast<std::size_t>(seqs));
    std::int32_t next_block = 0;
    for (int s = 0; s < seqs; ++s) {
      auto& b = batch[static_cast<std::size_t>(s)];
      const int n = 1 + static_cast<int>(rng() % 40);
      for (int i = 0; i < n; ++i)
        tokens[static_cast<std::size_t>(s)].push_back(static_cast<std::int32_t>(rng() % 2048));
      b.tokens = tokens[static_cast<std::size_t>(s)];
      b.start_pos = static_cast<std::int64_t>(rng() % 30);
      const std::int64_t blocks = (b.start_pos + n + block_size - 1) / block_size;
      for (std::int64_t k = 0; k < blocks; ++k) tables[static_cast<std::size_t>(s)].push_back(next_block++);
      b.block_table = tables[static_cast<std::size_t>(s)];
    }
    const std::int64_t step_rows = 1 + static_cast<std::int64_t>(rng() % 64);
    const OutputRows logits = trial % 3 == 0 ? OutputRows::All : (trial % 3 == 1 ? OutputRows::Last : OutputRows::None);
    auto plan = planForward(c, cache, batch, 0, false, logits, OutputRows::None, step_rows);
    ASSERT_TRUE(plan.ok()) << plan.error().toString();
    std::int64_t row = 0;
    std::int64_t logit_rows = 0;
    std::map<std::int64_t, std::int64_t> slot_row;  // slot -> global row that wrote it
    for (const auto& step : plan->steps) {
      ASSERT_EQ(step.first_row, row);
      ASSERT_LE(step.plan.tokens, step_rows);
      std::int64_t covered = 0;
      for (const auto& sp : step.sequences) {
        const SequenceChunk& s = batch[sp.sequence];
        for (std::int64_t r = 0; r < sp.rows; ++r) {
          const std::int64_t t = sp.first_row + r;
          const std::int64_t pos = sp.start_pos + r;
          const std::int64_t index = pos - s.start_pos;
          ASSERT_GE(index, 0);
          ASSERT_EQ(step.plan.token_ids[static_cast<std::size_t>(t)], s.tokens[static_cast<std::size_t>(index)]);
          ASSERT_EQ(step.plan.ctx_len[static_cast<std::size_t>(t)], pos + 1);
          const std::int64_t slot =
              static_cast<std::int64_t>(s.block_table[static_cast<std::size_t>(pos / block_size)]) * block_size +
              pos % block_size;
          ASSERT_EQ(step.plan.write_slot[static_cast<std::size_t>(t)], slot);
          slot_row[slot] = row + t;
          // Every new position this row attends to was written by this row or an earlier one.
          for (std::int64_t p = s.start_pos; p <= pos; ++p) {
            const std::int64_t ps =
                static_cast<std::int64_t>(s.block_table[static_cast<std::size_t>(p / block_size)]) * block_size +
                p % block_size;
            ASSERT_TRUE(slot_row.contains(ps));
            ASSERT_LE(slot_row[ps], row + t);
          }
          ++covered;
        }
      }
      ASSERT_EQ(covered, step.plan.tokens);
      logit_rows += static_cast<std::int64_t>(step.logit_rows.size());
      row += step.plan.tokens;
    }
    std::int64_t want_rows = 0;
    for (const auto& s : batch) want_rows += static_cast<std::int64_t>(s.tokens.size());
    ASSERT_EQ(row, want_rows);
    ASSERT_EQ(plan->rows, want_rows);
    const std::int64_t want_logits =
        logits == OutputRows::All ? want_rows : (logits == OutputRows::Last ? static_cast<std::int64_t>(seqs) : 0);
    ASSERT_EQ(logit_rows, want_logits);
    ASSERT_EQ(plan->logit_rows, want_logits);
  }
}

void expectInvalid(const pd::ModelConfig& c, const pd::model::LatentCacheView& cache,
                   const std::vector<SequenceChunk>& batch, bool mtp, const std::string& fragment,
                   std::int64_t step_rows = 64) {
  const std::int64_t layer = mtp ? c.num_hidden_layers : c.num_hidden_layers - 1;
  auto plan = planForward(c, cache, batch, layer, mtp, OutputRows::Last, OutputRows::None, step_rows);
  ASSERT_FALSE(plan.ok()) << "accepted: " << fragment;
  EXPECT_EQ(plan.error().code, pd::ErrorCode::InvalidArgument);
  EXPECT_NE(plan.error().message.find(fragment), std::string::npos) << plan.error().toString();
}

TEST(ForwardPlan, RejectsWhatTheCpuEngineRejects) {
  const pd::ModelConfig c = tiny();
  const auto cache = view(c, 8, 4);
  const std::vector<std::int32_t> toks{1, 2};
  const std::vector<std::int32_t> bad_tok{1, 2048};
  const std::vector<std::int32_t> empty;
  const std::vector<std::int32_t> one{0};
  const std::vector<std::int32_t> far{0, 8};
  const auto chunk = [](std::span<const std::int32_t> t, std::int64_t start, std::span<const std::int32_t> table) {
    SequenceChunk s;
    s.tokens = t;
    s.start_pos = start;
    s.block_table = table;
    return s;
  };
  expectInvalid(c, cache, {}, false, "empty batch");
  expectInvalid(c, cache, {chunk(empty, 0, one)}, false, "no new tokens");
  expectInvalid(c, cache, {chunk(toks, -1, one)}, false, "negative position");
  expectInvalid(c, cache, {chunk(bad_tok, 0, one)}, false, "token id 2048");
  expectInvalid(c, cache, {chunk(toks, 3, one)}, false, "cannot hold 5 positions");
  expectInvalid(c, cache, {chunk(toks, 3, far)}, false, "block id 8");
  std::vector<std::int32_t> long_table(64, 0);
  for (std::size_t i = 0; i < long_table.size(); ++i) long_table[i] = static_cast<std::int32_t>(i % 8);
  SequenceChunk beyond = chunk(toks, c.max_position_embeddings - 2, long_table);
  beyond.rope_offset = 1;
  expectInvalid(c, view(c, 8, 64), {beyond}, false, "beyond max_position_embeddings");
  expectInvalid(c, cache, {chunk(toks, 0, one)}, true, "MTP needs 2 x");
  auto narrow = cache;
  narrow.latent_dim += 1;
  expectInvalid(c, narrow, {chunk(toks, 0, one)}, false, "latent_dim");
  auto few = cache;
  few.layers.resize(static_cast<std::size_t>(c.num_hidden_layers));
  expectInvalid(c, few, {chunk(toks, 0, one)}, true, "layer");
  auto f16 = cache;
  f16.dtype = pd::DType::F16;
  expectInvalid(c, f16, {chunk(toks, 0, one)}, false, "F32, BF16 or F8_E4M3");
  expectInvalid(c, cache, {chunk(toks, 0, one)}, false, "rows per step", 0);
  expectInvalid(c, cache, {chunk(toks, 0, one)}, false, "rows per step", 65);
  // Accepted once fixed: the MTP chunk with its hidden rows.
  std::vector<float> hidden(static_cast<std::size_t>(2 * c.hidden_size), 0.5F);
  SequenceChunk m = chunk(toks, 0, one);
  m.prev_hidden = hidden;
  const std::vector<SequenceChunk> ok{m};
  EXPECT_TRUE(planForward(c, cache, ok, c.num_hidden_layers, true, OutputRows::All, OutputRows::All).ok());
}

TEST(ForwardPlan, CacheRunsMergeNeighbouringBlocks) {
  const std::vector<std::int32_t> table{4, 5, 9, 2, 3};
  EXPECT_TRUE(cacheRuns(table, 4, 0, 0).empty());
  const auto runs = cacheRuns(table, 4, 1, 18);  // positions 1..17
  ASSERT_EQ(runs.size(), 3U);
  EXPECT_EQ(runs[0].position, 1);  // blocks 4 and 5 are neighbours: one run of 7
  EXPECT_EQ(runs[0].slot, 4 * 4 + 1);
  EXPECT_EQ(runs[0].count, 7);
  EXPECT_EQ(runs[1].position, 8);
  EXPECT_EQ(runs[1].slot, 9 * 4);
  EXPECT_EQ(runs[1].count, 4);
  EXPECT_EQ(runs[2].position, 12);  // blocks 2 and 3: one run of 6 (positions 12..17)
  EXPECT_EQ(runs[2].slot, 2 * 4);
  EXPECT_EQ(runs[2].count, 6);
  // Every position once, at its slot, for random tables.
  std::mt19937 rng(3);
  for (int trial = 0; trial < 100; ++trial) {
    const std::int64_t bs = 1 + static_cast<std::int64_t>(rng() % 6);
    std::vector<std::int32_t> t(10);
    for (auto& id : t) id = static_cast<std::int32_t>(rng() % 6);
    const std::int64_t begin = static_cast<std::int64_t>(rng() % (10 * bs));
    const std::int64_t end = begin + static_cast<std::int64_t>(rng() % (10 * bs - begin + 1));
    std::int64_t p = begin;
    for (const CacheRun& r : cacheRuns(t, bs, begin, end)) {
      ASSERT_EQ(r.position, p);
      for (std::int64_t i = 0; i < r.count; ++i, ++p) {
        ASSERT_EQ(r.slot + i, static_cast<std::int64_t>(t[static_cast<std::size_t>(p / bs)]) * bs + p % bs);
      }
    }
    ASSERT_EQ(p, end);
  }
}

}  // namespace
