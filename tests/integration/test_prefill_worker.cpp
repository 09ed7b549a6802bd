// The prefill worker process (`pdserve prefill`) end to end: this test plays the decode
// worker (a decode KvPool on its own UCX transport, or prefill_decode_peer in a child process)
// and the router (PrefillSubmit / cancel over real HTTP).
//  - the pool filled by the worker holds the golden KV of tiny-bf16 / tiny-fp8 (main layers and
//    the MTP layer) and the first token is the golden greedy token;
//  - prompts of different lengths submitted together, in chunks smaller than a block, give the
//    golden KV of the prompt's prefixes (the golden is one unchunked run);
//  - faults: cancel mid-prefill, the router closing the submission, the decode peer killed
//    (SIGKILL) or silent (SIGSTOP) mid-stream: each answer comes within its deadline with the
//    right error, and the worker holds nothing afterwards (status, metrics);
//  - the process: SIGTERM drains and exits 0; --check-config.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <boost/json.hpp>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "integration/prefill_worker_util.h"
#include "pd/engine/model_factory.h"
#include "pd/engine/sampling.h"
#include "support/cli_runner.h"
#include "support/test_files.h"
#include "unit/prefill/prefill_golden.h"

namespace pd::prefill::testsupport {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double msSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// Waits until the worker holds nothing: no queued or running request, every local block free,
// no KV transfer in flight and no staging region registered.
void expectNothingHeld(const WorkerProcess& w) {
  std::optional<worker_api::WorkerStatus> s;
  for (const auto until = Clock::now() + kvt::testutil::kHangGuard; Clock::now() < until;) {
    s = w.status();
    if (s && s->running_requests == 0 && s->queued_requests == 0 && s->free_blocks == s->total_blocks) break;
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->queued_requests, 0);
  EXPECT_EQ(s->queued_tokens, 0);
  EXPECT_EQ(s->running_requests, 0);
  EXPECT_EQ(s->free_blocks, s->total_blocks);
  EXPECT_EQ(w.metric("pdserve_kv_in_flight").value_or(0), 0);
  EXPECT_EQ(w.metric("pdserve_kv_registered_regions").value_or(0), 0);
  EXPECT_EQ(w.metric("pdserve_prefill_queue_requests").value_or(-1), 0);
  EXPECT_EQ(w.metric("pdserve_prefill_running_requests").value_or(-1), 0);
}

Error errorOf(const http::ClientResponse& r) {
  return worker_api::parseErrorJson(r.status, r.body);
}

// Golden rows [0, n) of a [layers, N, width] cache tensor's layer `l`.
std::vector<float> goldenRows(const std::vector<float>& t, std::int64_t l, std::int64_t total, std::int64_t n,
                              std::int64_t width) {
  const auto begin = t.begin() + l * total * width;
  return {begin, begin + n * width};
}

// Columns [begin, end) of [n, dim] rows.
std::vector<float> columns(const std::vector<float>& rows, std::int64_t dim, std::int64_t begin, std::int64_t end) {
  std::vector<float> out;
  for (std::size_t r = 0; r * static_cast<std::size_t>(dim) < rows.size(); ++r) {
    const auto row = rows.begin() + static_cast<std::ptrdiff_t>(r * static_cast<std::size_t>(dim));
    out.insert(out.end(), row + begin, row + end);
  }
  return out;
}

// Checks the pool rows of a prompt that is the golden prompt's first n tokens: every main layer's
// c_kv / k_pe equals the golden rows [0, n); the MTP layer's rows [0, mtp_rows) equal the golden
// nozero MTP rows (the last row of a shorter prefix takes another token than the golden's).
void expectGoldenPrefix(const std::string& tag, const DecodeSide& side, const kvt::KvDescriptor& d,
                        const Golden& golden, std::int64_t n, std::int64_t mtp_rows) {
  const ModelConfig& cfg = side.config();
  const std::int64_t r = cfg.kv_lora_rank;
  const std::int64_t dim = cfg.latentDim();
  const std::int64_t total = static_cast<std::int64_t>(golden.ids("p0.tokens").size());
  const std::vector<float> kv = golden.f32("p0.kv_cache");
  const std::vector<float> pe = golden.f32("p0.pe_cache");
  for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const std::vector<float> rows = side.rows(d, l, n);
    expectClose(fmt::format("{} layer {} c_kv", tag, l), columns(rows, dim, 0, r), goldenRows(kv, l, total, n, r));
    expectClose(fmt::format("{} layer {} k_pe", tag, l), columns(rows, dim, r, dim),
                goldenRows(pe, l, total, n, dim - r));
  }
  if (mtp_rows == 0) return;
  const std::vector<float> mtp = side.rows(d, cfg.num_hidden_layers, mtp_rows);
  expectClose(tag + " mtp c_kv (nozero)", columns(mtp, dim, 0, r),
              goldenRows(golden.f32("p0.mtp_kv_cache_nozero"), 0, 0, mtp_rows, r));
  expectClose(tag + " mtp k_pe (nozero)", columns(mtp, dim, r, dim),
              goldenRows(golden.f32("p0.mtp_pe_cache_nozero"), 0, 0, mtp_rows, dim - r));
}

// ---- golden, across processes -------------------------------------------------------------------

class PrefillWorkerGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(PrefillWorkerGolden, DecodePoolHoldsTheGoldenKvAndFirstToken) {
  const fs::path model = goldenDir() / GetParam();
  const Golden golden(model / "golden.safetensors");
  const std::vector<std::int32_t> prompt = golden.ids("p0.tokens");
  const std::vector<std::int32_t> greedy = golden.ids("p0.greedy");
  const auto n = static_cast<std::uint32_t>(prompt.size());
  auto side = DecodeSide::create(model, 16, 8, DType::F32);  // F32: the golden tolerance applies unrounded
  ASSERT_TRUE(side.ok()) << side.error().toString();
  WorkerProcess w({"--model.path", model.string(), "--prefill.threads", "2"});
  ASSERT_TRUE(w.ok());

  const kvt::KvDescriptor d = (*side)->expect(11, n, kvt::testutil::shuffledBlocks(16, 5, 11), 20s);
  auto r = w.send("POST", worker_api::kPrefillPath, submitJson("cmpl-golden", prompt, d, 20000, true));
  ASSERT_TRUE(r.ok()) << r.error().toString();
  ASSERT_EQ(r->status, 200) << r->body;
  auto outcome = worker_api::parsePrefillOutcome(r->body);
  ASSERT_TRUE(outcome.ok()) << outcome.error().toString();
  EXPECT_EQ(outcome->first_token, greedy[0]);
  EXPECT_EQ(outcome->prompt_tokens, n);
  EXPECT_GT(outcome->compute_ms, 0.0);
  EXPECT_GE(outcome->queue_ms, 0.0);
  EXPECT_GE(outcome->transfer_ms, 0.0);

  // The record was delivered before the answer: it is there now.
  const auto arrived = (*side)->outcomes().waitArrival(11, kvt::testutil::kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  ASSERT_TRUE(arrived->ok()) << arrived->error().toString();
  EXPECT_EQ(arrived->value().first_token, greedy[0]);
  EXPECT_EQ(arrived->value().num_tokens, n);
  ASSERT_TRUE(arrived->value().first_logprob.has_value());
  EXPECT_EQ(arrived->value().first_logprob->token, greedy[0]);
  const std::vector<float> hf = golden.f32("p0.hidden_final");
  const auto hidden = static_cast<std::ptrdiff_t>((*side)->config().hidden_size);
  expectClose(GetParam() + " hidden_state (last row)", arrived->value().hidden_state,
              std::vector<float>(hf.end() - hidden, hf.end()));
  expectGoldenPrefix(GetParam(), **side, d, golden, n, n);
  expectNothingHeld(w);
  EXPECT_EQ(w.metric("pdserve_prefill_prompt_tokens_total").value_or(0), n);
  EXPECT_EQ(w.metric(R"(pdserve_prefill_requests_total{outcome="ok"})").value_or(0), 1);
  EXPECT_EQ(w.metric("pdserve_prefill_compute_seconds_count").value_or(0), 1);
  EXPECT_EQ(w.metric("pdserve_prefill_transfer_seconds_count").value_or(0), 1);
  EXPECT_GT(w.metric("pdserve_prefill_forward_seconds_total").value_or(0), 0.0);
  EXPECT_GT(w.metric("pdserve_prefill_tokens_per_second").value_or(0), 0.0);
  const auto kv_bytes = static_cast<double>(std::uint64_t{n} * d.compat.num_layers * d.compat.tokenBytes());
  EXPECT_EQ(w.metric("pdserve_prefill_kv_bytes_total").value_or(0), kv_bytes);
  EXPECT_EQ(w.metric("pdserve_kv_put_bytes_total").value_or(0), kv_bytes);
}

INSTANTIATE_TEST_SUITE_P(Models, PrefillWorkerGolden, ::testing::Values("tiny-bf16", "tiny-fp8"));

// ---- chunked and batched through the server ------------------------------------------------------

// Prompts of 40, 9, 25 and 1 tokens (prefixes of the golden prompt) submitted at once, in chunks
// smaller than a local block and a token budget that puts several prompts in one forward: each
// pool holds the golden (unchunked, alone) KV of its prefix, and each first token is the golden
// argmax at its last position.
TEST(PrefillWorkerChunked, ChunkedBatchedPromptsMatchTheUnchunkedGolden) {
  const fs::path model = goldenDir() / "tiny-bf16";
  const Golden golden(model / "golden.safetensors");
  const std::vector<std::int32_t> prompt = golden.ids("p0.tokens");
  const std::vector<float> logits = golden.f32("p0.logits_all");
  auto side = DecodeSide::create(model, 64, 8, DType::F32);
  ASSERT_TRUE(side.ok()) << side.error().toString();
  const std::vector<std::int64_t> lengths{40, 9, 25, 1};
  const std::vector<std::uint32_t> blocks = kvt::testutil::shuffledBlocks(64, 64, 3);
  for (const std::int64_t chunk : {3, 7}) {
    SCOPED_TRACE(fmt::format("chunk_size {}", chunk));
    WorkerProcess w({"--model.path", model.string(), "--prefill.threads", "1", "--prefill.chunk_size",
                     std::to_string(chunk), "--prefill.token_budget", "16", "--prefill.cache_block_size", "4"});
    ASSERT_TRUE(w.ok());
    std::vector<kvt::KvDescriptor> descs;
    std::size_t next_block = 0;
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      const auto n = static_cast<std::uint32_t>(lengths[i]);
      const std::size_t need = (n + 7) / 8;
      const std::uint64_t id = 100 * static_cast<std::uint64_t>(chunk) + i;
      descs.push_back((*side)->expect(id, n,
                                      {blocks.begin() + static_cast<std::ptrdiff_t>(next_block),
                                       blocks.begin() + static_cast<std::ptrdiff_t>(next_block + need)},
                                      20s));
      next_block += need;
    }
    std::vector<Result<http::ClientResponse>> answers(lengths.size(), makeError(ErrorCode::Internal, "not sent"));
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      threads.emplace_back([&, i] {
        const std::vector<std::int32_t> tokens(prompt.begin(), prompt.begin() + lengths[i]);
        answers[i] = w.send("POST", worker_api::kPrefillPath,
                            submitJson(fmt::format("cmpl-{}-{}", chunk, i), tokens, descs[i], 20000));
      });
    }
    for (auto& t : threads) t.join();
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      const std::int64_t n = lengths[i];
      ASSERT_TRUE(answers[i].ok()) << answers[i].error().toString();
      ASSERT_EQ(answers[i]->status, 200) << answers[i]->body;
      auto outcome = worker_api::parsePrefillOutcome(answers[i]->body);
      ASSERT_TRUE(outcome.ok());
      // The golden argmax at position n-1 (checked only where it is not a near tie).
      const auto row = logits.begin() + (n - 1) * 2048;
      std::vector<float> sorted(row, row + 2048);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
      if (sorted[0] - sorted[1] > 1e-3F) {
        EXPECT_EQ(outcome->first_token, model::argmax(std::span(&*row, 2048))) << n;
      }
      expectGoldenPrefix(fmt::format("chunk {} prompt {}", chunk, n), **side, descs[i], golden, n, n - 1);
      const auto arrived =
          (*side)->outcomes().waitArrival(100 * static_cast<std::uint64_t>(chunk) + i, kvt::testutil::kHangGuard);
      ASSERT_TRUE(arrived.has_value() && arrived->ok());
    }
    expectNothingHeld(w);
  }
}

// ---- decode-side prefix reuse -------------------------------------------------------------------

// A descriptor whose first blocks are present (the decode worker's prefix cache holds them from an
// earlier prompt; docs/kv-memory.md "Prefix reuse on the decode side") gets only the blocks after
// them (the worker's put bytes), and the pool then holds exactly what a cold transfer of the whole
// prompt writes, bit for bit, in every layer, the MTP layer included.
TEST(PrefillWorkerPresentBlocks, OnlyTheBlocksAfterThePresentOnesCrossAndThePoolEqualsAColdPrefill) {
  const fs::path model = goldenDir() / "tiny-bf16";
  const Golden golden(model / "golden.safetensors");
  const std::vector<std::int32_t> prompt = golden.ids("p0.tokens");
  const auto n = static_cast<std::uint32_t>(prompt.size());
  ASSERT_GT(n, 24U);
  auto side = DecodeSide::create(model, 32, 8, DType::F32);
  ASSERT_TRUE(side.ok()) << side.error().toString();
  // Chunks of one block: a prompt's full blocks are computed as a longer prompt computes them.
  WorkerProcess w({"--model.path", model.string(), "--prefill.threads", "1", "--prefill.chunk_size", "8",
                   "--prefill.cache_block_size", "8", "--prefill.prefix_cache_blocks", "0"});
  ASSERT_TRUE(w.ok());
  const std::vector<std::uint32_t> blocks = kvt::testutil::shuffledBlocks(32, 32, 19);
  const auto slice = [&](std::size_t from, std::size_t to) {
    return std::vector<std::uint32_t>(blocks.begin() + static_cast<std::ptrdiff_t>(from),
                                      blocks.begin() + static_cast<std::ptrdiff_t>(to));
  };
  const std::uint32_t need = (n + 7) / 8;
  const auto run = [&](std::uint64_t id, std::uint32_t tokens, const kvt::KvDescriptor& d) {
    const std::vector<std::int32_t> t(prompt.begin(), prompt.begin() + tokens);
    auto r = w.send("POST", worker_api::kPrefillPath, submitJson(fmt::format("cmpl-present-{}", id), t, d, 20000));
    ASSERT_TRUE(r.ok()) << r.error().toString();
    ASSERT_EQ(r->status, 200) << r->body;
    const auto arrived = (*side)->outcomes().waitArrival(id, kvt::testutil::kHangGuard);
    ASSERT_TRUE(arrived.has_value() && arrived->ok());
  };
  // Cold: the whole prompt.
  const kvt::KvDescriptor cold = (*side)->expect(1, n, slice(0, need), 20s);
  ASSERT_NO_FATAL_FAILURE(run(1, n, cold));
  // Turn 1: the prompt's first 20 tokens (2 full blocks and a partial one).
  const kvt::KvDescriptor turn1 = (*side)->expect(2, 20, slice(need, need + 3), 20s);
  ASSERT_NO_FATAL_FAILURE(run(2, 20, turn1));
  // Turn 2: the whole prompt on turn 1's 2 full blocks (present) and fresh ones.
  std::vector<std::uint32_t> warm_blocks = slice(need, need + 2);
  for (const std::uint32_t b : slice(need + 3, need + 3 + need - 2)) warm_blocks.push_back(b);
  const double before = w.metric("pdserve_kv_put_bytes_total").value_or(-1);
  const kvt::KvDescriptor turn2 = (*side)->expect(3, n, warm_blocks, 20s, 16);
  ASSERT_EQ(turn2.present_tokens, 16U);
  ASSERT_NO_FATAL_FAILURE(run(3, n, turn2));
  const double sent = w.metric("pdserve_kv_put_bytes_total").value_or(-1) - before;
  EXPECT_EQ(sent, static_cast<double>(std::uint64_t{n - 16} * cold.compat.num_layers * cold.compat.tokenBytes()));
  for (std::uint32_t l = 0; l < cold.compat.num_layers; ++l) {
    EXPECT_EQ((*side)->rows(turn2, l, n), (*side)->rows(cold, l, n)) << "layer " << l;
  }
  expectNothingHeld(w);
}

// ---- bad input --------------------------------------------------------------------------------

TEST(PrefillWorkerInput, RefusesBadSubmissionsWithTheContractsErrors) {
  const fs::path model = goldenDir() / "tiny-bf16";
  auto side = DecodeSide::create(model, 16, 8, DType::F32);
  ASSERT_TRUE(side.ok()) << side.error().toString();
  WorkerProcess w({"--model.path", model.string(), "--prefill.threads", "1"});
  ASSERT_TRUE(w.ok());
  const auto expectError = [&](const std::string& body, int status, ErrorCode code, const std::string& needle) {
    auto r = w.send("POST", worker_api::kPrefillPath, body);
    ASSERT_TRUE(r.ok()) << r.error().toString();
    EXPECT_EQ(r->status, status) << r->body;
    const Error e = errorOf(*r);
    EXPECT_EQ(e.code, code) << e.toString();
    EXPECT_NE(e.message.find(needle), std::string::npos) << e.message;
  };
  expectError("{not json", 400, ErrorCode::InvalidArgument, "");
  kvt::KvDescriptor d = (*side)->expect(5, 3, {0}, 5s);
  expectError(submitJson("cmpl-a", {1, 2}, d, 5000), 400, ErrorCode::InvalidArgument, "3 tokens");
  kvt::KvDescriptor other = d;
  other.compat.model_hash ^= 1;
  expectError(submitJson("cmpl-b", {1, 2, 3}, other, 5000), 400, ErrorCode::Unsupported, "model_hash");
  worker_api::PrefillSubmit garbled;
  garbled.request_id = "cmpl-c";
  garbled.token_ids = {1, 2, 3};
  garbled.kv_descriptor = "not a descriptor";
  expectError(worker_api::toJson(garbled), 400, ErrorCode::InvalidArgument, "kv_descriptor");
  expectError(submitJson("cmpl-d", {1, 99999, 3}, d, 5000), 400, ErrorCode::InvalidArgument, "vocabulary");
  auto found = w.send("POST", worker_api::kPrefillCancelPath, R"({"request_id":"cmpl-none"})");
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(found->status, 200);
  EXPECT_EQ(found->body, R"({"found":false})");
  // A refused submission may have begun its transfer: the decode side hears of it.
  const auto arrived = (*side)->outcomes().waitArrival(5, kvt::testutil::kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  EXPECT_FALSE(arrived->ok());
  expectNothingHeld(w);
  auto health = w.send("GET", "/health");
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(health->body, "ok");
  auto ready = w.send("GET", "/ready");
  ASSERT_TRUE(ready.ok());
  EXPECT_EQ(ready->status, 200);
  const auto st = w.status();
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->role, "prefill");
  EXPECT_TRUE(st->ready);
  EXPECT_EQ(st->model_hash, modelHashHex(modelHash(model).value()));
}

// ---- faults --------------------------------------------------------------------------------------

// A model whose prefill of kLongPrompt tokens takes seconds on one thread (the tiny architecture
// with a long context), made once for the suite.
constexpr std::int64_t kLongPrompt = 3000;

class PrefillWorkerFaults : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new pd::test::TempDir();
    ModelConfig cfg = presetConfig("tiny").value();
    cfg.max_position_embeddings = 8192;
    MakeModelOptions o;
    o.seed = 7;
    auto made = makeModel(cfg, dir_->path() / "slow", o);
    ASSERT_TRUE(made.ok()) << made.error().toString();
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static fs::path model() { return dir_->path() / "slow"; }
  static std::vector<std::int32_t> longPrompt() {
    std::mt19937 rng(5);
    std::vector<std::int32_t> t(kLongPrompt);
    for (auto& x : t) x = static_cast<std::int32_t>(2 + rng() % 2000);
    return t;
  }
  static std::vector<std::string> workerFlags(std::vector<std::string> more = {}) {
    std::vector<std::string> f{"--model.path",           model().string(),
                               "--prefill.threads",      "1",
                               "--prefill.chunk_size",   "256",
                               "--prefill.cache_blocks", "128"};
    f.insert(f.end(), more.begin(), more.end());
    return f;
  }
  // Waits until the worker is streaming KV (bytes posted); the bound only ends a hung test.
  static bool waitStreaming(const WorkerProcess& w) {
    for (const auto until = Clock::now() + kvt::testutil::kHangGuard; Clock::now() < until;) {
      if (w.metric("pdserve_kv_put_bytes_total").value_or(0) > 0) return true;
      std::this_thread::sleep_for(20ms);
    }
    return false;
  }

  static pd::test::TempDir* dir_;
};
pd::test::TempDir* PrefillWorkerFaults::dir_ = nullptr;

TEST_F(PrefillWorkerFaults, CancelMidPrefillAnswersCancelledAndFreesBothSides) {
  auto side = DecodeSide::create(model(), 256, 16, DType::F32);
  ASSERT_TRUE(side.ok()) << side.error().toString();
  WorkerProcess w(workerFlags());
  ASSERT_TRUE(w.ok());
  const auto n = static_cast<std::uint32_t>(kLongPrompt);
  const kvt::KvDescriptor d = (*side)->expect(21, n, kvt::testutil::shuffledBlocks(256, (n + 15) / 16, 21), 30s);
  std::optional<Result<http::ClientResponse>> answer;
  std::thread submit(
      [&] { answer = w.send("POST", worker_api::kPrefillPath, submitJson("cmpl-cancel", longPrompt(), d, 30000)); });
  ASSERT_TRUE(waitStreaming(w));
  const auto st = w.status();
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->running_requests, 1);
  const auto t0 = Clock::now();
  auto cancel = w.send("POST", worker_api::kPrefillCancelPath, R"({"request_id":"cmpl-cancel"})");
  submit.join();
  const double ms = msSince(t0);
  ASSERT_TRUE(cancel.ok());
  EXPECT_EQ(cancel->body, R"({"found":true})");
  ASSERT_TRUE(answer.has_value() && answer->ok());
  EXPECT_EQ((*answer)->status, 409) << (*answer)->body;
  EXPECT_EQ(errorOf(**answer).code, ErrorCode::Cancelled);
  EXPECT_LT(ms, 2000) << "cancel stops compute at the next layer";
  // The decode side got the failure record, not a timeout.
  const auto arrived = (*side)->outcomes().waitArrival(21, kvt::testutil::kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  ASSERT_FALSE(arrived->ok());
  EXPECT_EQ(arrived->error().code, ErrorCode::Cancelled) << arrived->error().toString();
  expectNothingHeld(w);
  EXPECT_EQ(w.metric(R"(pdserve_prefill_requests_total{outcome="Cancelled"})").value_or(0), 1);
}

// Decode workers number their requests independently, but the wire names a transfer by its 128-bit
// random id: two workers' request 7 are two transfers here, and both land. A second submit of a
// transfer id in flight here (a replayed descriptor) is refused and leaves the first alone.
TEST_F(PrefillWorkerFaults, TransfersAreKeyedByTheirRandomIdNotTheDecodeWorkersNumber) {
  auto a = DecodeSide::create(model(), 256, 16, DType::F32);
  auto b = DecodeSide::create(model(), 256, 16, DType::F32);
  ASSERT_TRUE(a.ok() && b.ok());
  WorkerProcess w(workerFlags());
  ASSERT_TRUE(w.ok());
  const auto n = static_cast<std::uint32_t>(kLongPrompt);
  const kvt::KvDescriptor da = (*a)->expect(7, n, kvt::testutil::shuffledBlocks(256, (n + 15) / 16, 7), 30s);
  const kvt::KvDescriptor db = (*b)->expect(7, 3, {0}, 30s);
  EXPECT_NE(da.transfer_id, db.transfer_id);
  std::optional<Result<http::ClientResponse>> answer;
  std::thread submit(
      [&] { answer = w.send("POST", worker_api::kPrefillPath, submitJson("cmpl-a", longPrompt(), da, 30000)); });
  ASSERT_TRUE(waitStreaming(w));
  auto replay = w.send("POST", worker_api::kPrefillPath, submitJson("cmpl-replay", longPrompt(), da, 30000));
  ASSERT_TRUE(replay.ok());
  EXPECT_EQ(replay->status, 400) << replay->body;
  EXPECT_EQ(errorOf(*replay).code, ErrorCode::InvalidArgument);
  EXPECT_NE(errorOf(*replay).message.find("already in flight"), std::string::npos) << replay->body;
  auto second = w.send("POST", worker_api::kPrefillPath, submitJson("cmpl-b", {1, 2, 3}, db, 30000));
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->status, 200) << second->body;
  const auto landed = (*b)->outcomes().waitArrival(7, kvt::testutil::kHangGuard);
  ASSERT_TRUE(landed.has_value());
  EXPECT_TRUE(landed->ok()) << landed->error().toString();
  ASSERT_TRUE(w.send("POST", worker_api::kPrefillCancelPath, R"({"request_id":"cmpl-a"})").ok());
  submit.join();
  ASSERT_TRUE(answer.has_value() && answer->ok());
  EXPECT_EQ((*answer)->status, 409);
  const auto cancelled = (*a)->outcomes().waitArrival(7, kvt::testutil::kHangGuard);
  ASSERT_TRUE(cancelled.has_value());
  EXPECT_FALSE(cancelled->ok()) << "the replay did not end request A's transfer early, the cancel did";
  expectNothingHeld(w);
}

TEST_F(PrefillWorkerFaults, RouterClosingTheSubmissionCancelsIt) {
  auto side = DecodeSide::create(model(), 256, 16, DType::F32);
  ASSERT_TRUE(side.ok()) << side.error().toString();
  WorkerProcess w(workerFlags());
  ASSERT_TRUE(w.ok());
  const auto n = static_cast<std::uint32_t>(kLongPrompt);
  const kvt::KvDescriptor d = (*side)->expect(22, n, kvt::testutil::shuffledBlocks(256, (n + 15) / 16, 22), 30s);
  // The client gives up once the prefill is streaming and closes the connection (ordered by the
  // worker's own progress, not by a timeout racing the prefill's speed).
  http::Client client(w.host(), w.port());
  std::optional<Result<http::ClientResponse>> r;
  std::thread submit([&] {
    http::ClientRequest req;
    req.method = "POST";
    req.target = std::string(worker_api::kPrefillPath);
    req.body = submitJson("cmpl-gone", longPrompt(), d, 30000);
    req.headers.push_back({"Content-Type", "application/json"});
    r = client.send(req, 30s);
  });
  ASSERT_TRUE(waitStreaming(w));
  client.cancel();
  submit.join();
  ASSERT_TRUE(r.has_value());
  ASSERT_FALSE(r->ok());
  EXPECT_EQ(r->error().code, ErrorCode::Cancelled) << r->error().toString();
  const auto arrived = (*side)->outcomes().waitArrival(22, kvt::testutil::kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  ASSERT_FALSE(arrived->ok());
  EXPECT_EQ(arrived->error().code, ErrorCode::Cancelled) << arrived->error().toString();
  expectNothingHeld(w);
}

TEST_F(PrefillWorkerFaults, DecodePeerKilledMidStreamAnswersPeerFailedFast) {
  WorkerProcess w(workerFlags());
  ASSERT_TRUE(w.ok());
  kvt::testutil::ChildProcess peer({PD_PREFILL_DECODE_PEER_BIN, "--model", model().string(), "--tokens",
                                    std::to_string(kLongPrompt), "--blocks", "256", "--block-size", "16",
                                    "--timeout-ms", "30000", "--id", "31"});
  const auto hex = peer.readLine("DESCRIPTOR ", 20s);
  ASSERT_TRUE(hex.has_value());
  const auto bytes = kvt::testutil::fromHex(*hex);
  ASSERT_TRUE(bytes.has_value());
  const auto d = kvt::decodeKvDescriptor(*bytes);
  ASSERT_TRUE(d.ok());
  std::optional<Result<http::ClientResponse>> answer;
  std::thread submit(
      [&] { answer = w.send("POST", worker_api::kPrefillPath, submitJson("cmpl-killed", longPrompt(), *d, 30000)); });
  ASSERT_TRUE(waitStreaming(w));
  peer.signal(SIGKILL);
  const auto t0 = Clock::now();
  submit.join();
  const double ms = msSince(t0);
  ASSERT_TRUE(answer.has_value() && answer->ok());
  EXPECT_EQ((*answer)->status, 502) << (*answer)->body;
  EXPECT_EQ(errorOf(**answer).code, ErrorCode::PeerFailed) << (*answer)->body;
  EXPECT_LT(ms, 5000) << "a killed peer is detected long before the 30 s deadline";
  expectNothingHeld(w);
}

TEST_F(PrefillWorkerFaults, SilentDecodePeerAnswersTimeoutAtTheDeadline) {
  WorkerProcess w(workerFlags());
  ASSERT_TRUE(w.ok());
  kvt::testutil::ChildProcess peer({PD_PREFILL_DECODE_PEER_BIN, "--model", model().string(), "--tokens",
                                    std::to_string(kLongPrompt), "--blocks", "256", "--block-size", "16",
                                    "--timeout-ms", "30000", "--id", "32"});
  const auto hex = peer.readLine("DESCRIPTOR ", 20s);
  ASSERT_TRUE(hex.has_value());
  const auto d = kvt::decodeKvDescriptor(*kvt::testutil::fromHex(*hex));
  ASSERT_TRUE(d.ok());
  constexpr std::int64_t kTimeoutMs = 3000;
  std::optional<Result<http::ClientResponse>> answer;
  const auto t0 = Clock::now();
  std::thread submit([&] {
    answer = w.send("POST", worker_api::kPrefillPath, submitJson("cmpl-silent", longPrompt(), *d, kTimeoutMs));
  });
  ASSERT_TRUE(waitStreaming(w));
  peer.signal(SIGSTOP);
  submit.join();
  const double ms = msSince(t0);
  ASSERT_TRUE(answer.has_value() && answer->ok());
  EXPECT_EQ((*answer)->status, 504) << (*answer)->body;
  EXPECT_EQ(errorOf(**answer).code, ErrorCode::Timeout) << (*answer)->body;
  EXPECT_GE(ms, kTimeoutMs - 100);
  EXPECT_LT(ms, kTimeoutMs + 2000);
  expectNothingHeld(w);
}

// ---- the process ---------------------------------------------------------------------------------

TEST_F(PrefillWorkerFaults, SigtermDrainsInFlightWorkThenExitsZero) {
  auto side = DecodeSide::create(model(), 256, 16, DType::F32);
  ASSERT_TRUE(side.ok()) << side.error().toString();
  WorkerProcess w(workerFlags({"--prefill.drain_timeout_ms", "30000"}));
  ASSERT_TRUE(w.ok());
  const auto n = static_cast<std::uint32_t>(kLongPrompt);
  const kvt::KvDescriptor d = (*side)->expect(41, n, kvt::testutil::shuffledBlocks(256, (n + 15) / 16, 41), 30s);
  std::optional<Result<http::ClientResponse>> answer;
  std::thread submit(
      [&] { answer = w.send("POST", worker_api::kPrefillPath, submitJson("cmpl-drain", longPrompt(), d, 30000)); });
  ASSERT_TRUE(waitStreaming(w));
  ASSERT_TRUE(w.process().signal(SIGTERM));
  // Draining: not ready, new work refused, the in-flight prefill finishes.
  std::optional<int> ready;
  for (const auto until = Clock::now() + kvt::testutil::kHangGuard; ready != 503 && Clock::now() < until;) {
    auto r = w.send("GET", "/ready");
    ready = r.ok() ? std::optional<int>(r->status) : std::nullopt;
    if (ready != 503) std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(ready, 503);
  const kvt::KvDescriptor late = (*side)->expect(42, 3, {255}, 5s);
  auto refused = w.send("POST", worker_api::kPrefillPath, submitJson("cmpl-late", {1, 2, 3}, late, 5000));
  ASSERT_TRUE(refused.ok());
  EXPECT_EQ(refused->status, 503);
  EXPECT_EQ(errorOf(*refused).code, ErrorCode::Overloaded);
  EXPECT_TRUE((*side)->transport().cancelExpect(42));
  submit.join();
  ASSERT_TRUE(answer.has_value() && answer->ok());
  EXPECT_EQ((*answer)->status, 200) << (*answer)->body;
  const auto arrived = (*side)->outcomes().waitArrival(41, kvt::testutil::kHangGuard);
  ASSERT_TRUE(arrived.has_value() && arrived->ok());
  EXPECT_EQ(w.process().wait(10s), 0);
}

TEST_F(PrefillWorkerFaults, DrainTimeoutAbortsWhatIsLeftAndExitsZero) {
  auto side = DecodeSide::create(model(), 256, 16, DType::F32);
  ASSERT_TRUE(side.ok()) << side.error().toString();
  WorkerProcess w(workerFlags({"--prefill.drain_timeout_ms", "200"}));
  ASSERT_TRUE(w.ok());
  const auto n = static_cast<std::uint32_t>(kLongPrompt);
  const kvt::KvDescriptor d = (*side)->expect(43, n, kvt::testutil::shuffledBlocks(256, (n + 15) / 16, 43), 30s);
  std::optional<Result<http::ClientResponse>> answer;
  std::thread submit(
      [&] { answer = w.send("POST", worker_api::kPrefillPath, submitJson("cmpl-abort", longPrompt(), d, 30000)); });
  ASSERT_TRUE(waitStreaming(w));
  const auto t0 = Clock::now();
  ASSERT_TRUE(w.process().signal(SIGTERM));
  submit.join();
  ASSERT_TRUE(answer.has_value() && answer->ok());
  EXPECT_EQ((*answer)->status, 409) << (*answer)->body;
  EXPECT_EQ(errorOf(**answer).code, ErrorCode::Cancelled);
  const auto arrived = (*side)->outcomes().waitArrival(43, kvt::testutil::kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  ASSERT_FALSE(arrived->ok());
  EXPECT_EQ(arrived->error().code, ErrorCode::Cancelled) << arrived->error().toString();
  EXPECT_EQ(w.process().wait(10s), 0);
  EXPECT_LT(msSince(t0), 5000);
}

TEST(PrefillWorkerProcess, IdleSigtermExitsZeroAtOnce) {
  WorkerProcess w({"--model.path", (goldenDir() / "tiny-bf16").string(), "--prefill.threads", "1"});
  ASSERT_TRUE(w.ok());
  const auto t0 = Clock::now();
  ASSERT_TRUE(w.process().signal(SIGTERM));
  EXPECT_EQ(w.process().wait(10s), 0);
  EXPECT_LT(msSince(t0), 3000);
  EXPECT_FALSE(w.stdoutLines().next(100ms).has_value()) << "one PDSERVE_READY line only";
}

using pd::test::CommandResult;
using pd::test::pdserve;

TEST(PrefillWorkerProcess, CheckConfigValidatesWithoutLoadingTheModel) {
  pd::test::TempDir tmp;
  const fs::path missing = tmp.path() / "no-model-here";
  CommandResult ok = pdserve({"prefill", "--check-config", "--model.path", missing.string()});
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_EQ(ok.out, "");
  EXPECT_EQ(ok.err, "");
  CommandResult bad = pdserve({"prefill", "--check-config", "--prefill.chunk_size", "0"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("chunk_size"), std::string::npos) << bad.err;
  EXPECT_EQ(bad.out, "");
  CommandResult tls = pdserve({"prefill", "--check-config", "--kvtransfer.ucx_tls", "sm"});
  EXPECT_EQ(tls.exit_code, 2);
  EXPECT_NE(tls.err.find("ucx_tls"), std::string::npos) << tls.err;
  CommandResult unknown = pdserve({"prefill", "--check-config", "--prefill.no_such_option", "1"});
  EXPECT_EQ(unknown.exit_code, 2);
  const fs::path yaml = tmp.path() / "cfg.yaml";
  std::ofstream(yaml) << "prefill:\n  chunk_size: 64\ndecode:\n  blok_size: 8\n";
  CommandResult typo = pdserve({"prefill", "--check-config", "--config", yaml.string()});
  EXPECT_EQ(typo.exit_code, 2) << "a typo in another role's section is caught too";
  EXPECT_NE(typo.err.find("blok_size"), std::string::npos) << typo.err;
}

// `pdserve bench prefill --json` runs the three modes and prints one JSON object whose fields the
// benchmark table is built from (the numbers themselves are not asserted: this machine is noisy).
TEST(PrefillWorkerProcess, BenchPrefillPrintsTheTtftBreakdown) {
  CommandResult run = pdserve({"bench", "prefill", "--model", (goldenDir() / "tiny-bf16").string(), "--lengths",
                               "16,48", "--runs", "1", "--threads", "1", "--json", "--log.level", "warn"});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  boost::system::error_code ec;
  const boost::json::value v = boost::json::parse(run.out, ec);
  ASSERT_FALSE(ec) << run.out;
  const boost::json::object& o = v.as_object();
  EXPECT_EQ(o.at("headline_tokens").as_int64(), 48) << "the length nearest 2048";
  EXPECT_TRUE(std::isfinite(o.at("streaming_overhead").as_double()));
  EXPECT_TRUE(std::isfinite(o.at("send_after_overhead").as_double()));
  const boost::json::array& cases = o.at("cases").as_array();
  ASSERT_EQ(cases.size(), 2U);
  for (const auto& c : cases) {
    for (const char* key : {"compute_ttft_s", "streaming_ttft_s", "send_after_ttft_s"}) {
      EXPECT_GT(c.at(key).as_double(), 0.0) << key;
    }
  }
}

}  // namespace
}  // namespace pd::prefill::testsupport
