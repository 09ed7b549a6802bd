// The capacity planner (tools/plan): it must reproduce the published DeepSeek deployment numbers
// (docs/planner.md has the table), move the right way when an input moves, size the latent KV
// exactly, and fit its constants back from measurements.
#include <gtest/gtest.h>

#include <cmath>

#include "planner.h"

namespace {

using namespace pd::plan;

const ModelShape& v3() {
  static const ModelShape shape = [] {
    auto s = presetShape("deepseek-v3");
    EXPECT_TRUE(s.ok()) << s.error().toString();
    return s.value();
  }();
  return shape;
}

HardwareProfile hardware(const char* name) {
  auto h = builtinHardware(name);
  EXPECT_TRUE(h.ok());
  return h.value();
}

/// The published experiment: DeepSeek-V3 decode at TP16 over two 8-GPU H20 nodes, one user.
PlanInput h20Tp16(double net_latency_s) {
  PlanInput in;
  in.model = v3();
  in.hardware = hardware("h20");
  in.hardware.net_latency = net_latency_s;
  in.decode.tp = 16;
  in.decode.nodes = 2;
  in.prefill.tp = 8;
  in.workload.concurrency = 1;
  return in;
}

double decodeTokensPerUser(const PlanInput& in) {
  auto p = predict(in);
  EXPECT_TRUE(p.ok()) << p.error().toString();
  return p.ok() ? p->decode.tokens_per_s_per_user : 0.0;
}

TEST(PlannerPublished, DeepSeekV3ActivatesAbout37BParameters) {
  EXPECT_NEAR(v3().activatedParams() / 1e9, 37.0, 37.0 * 0.03);
  EXPECT_TRUE(v3().fp8_weights);
  // Total parameters: 671 B main + 14 B MTP, as released.
  EXPECT_NEAR(v3().total_params / 1e9, 685.0, 685.0 * 0.01);
}

TEST(PlannerPublished, SingleStreamCeilingIs53TokensPerSecondAt1979GBs) {
  // 37 B parameters in FP8 read at 1979 GB/s: 1979 / 37 = 53.5 tokens/s.
  ModelShape flat = v3();
  flat.main_fixed_bytes = 37e9;
  flat.expert_bytes = 0;
  flat.main_fixed_params = 37e9;
  flat.expert_params = 0;
  PlanInput in;
  in.model = flat;
  in.hardware = hardware("h800");
  in.hardware.hbm_bandwidth = 1979e9;
  auto p = predict(in);
  ASSERT_TRUE(p.ok()) << p.error().toString();
  EXPECT_NEAR(p->single_stream_ceiling_tokens_per_s, 53.5, 0.1);

  // The real layout (BF16 lm_head, FP8 scales, KV reads of a 1k context) stays within 3 %.
  in.model = v3();
  p = predict(in);
  ASSERT_TRUE(p.ok());
  EXPECT_NEAR(p->single_stream_ceiling_tokens_per_s, 53.5, 53.5 * 0.03);
  EXPECT_NEAR(p->decode.tokens_per_s_per_user, 53.5, 53.5 * 0.03);
  EXPECT_FALSE(p->decode.step.compute_bound);
  EXPECT_DOUBLE_EQ(p->decode.step.collectives, 0.0);              // one GPU
  EXPECT_NEAR(p->decode.step.experts_read_per_layer, 8.0, 1e-9);  // batch 1 reads its top-8
}

TEST(PlannerPublished, Tp16OverTwoH20NodesFallsWithNetworkLatency) {
  const double fast = decodeTokensPerUser(h20Tp16(0.193e-3));
  const double slow = decodeTokensPerUser(h20Tp16(2.193e-3));
  EXPECT_NEAR(fast, 18.943, 18.943 * 0.15);
  EXPECT_NEAR(slow, 4.85, 4.85 * 0.15);
  // Collectives dominate: 2 per layer + embedding + logits, all crossing the network.
  auto p = predict(h20Tp16(2.193e-3));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->decode.step.collectives_per_step, 2 * 61 + 2);
  EXPECT_GT(p->decode.step.collectives, 0.9 * p->decode.step.total);
}

TEST(PlannerPublished, FittedNetworkConstantsAreTheLeastSquaresFitOfThePublishedPoints) {
  PlanInput in = h20Tp16(0.193e-3);
  const std::vector<CalibrationPoint> published = {{1, 18.943, -1, 0.193e-3}, {1, 4.85, -1, 2.193e-3}};
  auto fit = calibrate(in, published);
  ASSERT_TRUE(fit.ok()) << fit.error().toString();
  EXPECT_NEAR(fit->hardware.net_collective_overhead, kFittedNetCollectiveOverhead, kFittedNetCollectiveOverhead * 0.01);
  EXPECT_NEAR(fit->hardware.net_latency_hops, kFittedNetLatencyHops, kFittedNetLatencyHops * 0.01);
  EXPECT_LT(fit->rms_relative_error, 1e-6);  // two constants, two points
  ASSERT_EQ(fit->predicted_tokens_per_s_total.size(), 2U);
  EXPECT_NEAR(fit->predicted_tokens_per_s_total[0], 18.943, 1e-3);
  EXPECT_NEAR(fit->predicted_tokens_per_s_total[1], 4.85, 1e-3);
}

TEST(PlannerPublished, MtpAt85To90PercentAcceptanceGivesAbout1Point8x) {
  EXPECT_DOUBLE_EQ(mtpTokensPerStep(0, 0.9), 1.0);
  EXPECT_DOUBLE_EQ(mtpTokensPerStep(1, 0.85), 1.85);
  EXPECT_NEAR(mtpTokensPerStep(2, 0.9), 1.0 + 0.9 + 0.81, 1e-12);
  for (const double a : {0.85, 0.9}) {
    PlanInput in = h20Tp16(0.193e-3);
    const double base = decodeTokensPerUser(in);
    in.workload.mtp_k = 1;
    in.workload.mtp_acceptance = a;
    const double with_mtp = decodeTokensPerUser(in);
    EXPECT_NEAR(with_mtp / base, 1.8, 0.1) << "acceptance " << a;
  }
}

TEST(PlannerPhysics, MtpGainsLessOnOneGpuAtBatch1BecauseVerifyingReadsMoreExperts) {
  PlanInput in;
  in.model = v3();
  in.hardware = hardware("h200");
  const double base = decodeTokensPerUser(in);
  in.workload.mtp_k = 1;
  in.workload.mtp_acceptance = 0.9;
  auto p = predict(in);
  ASSERT_TRUE(p.ok());
  EXPECT_GT(p->decode.step.experts_read_per_layer, 15.0);  // two tokens: ~15.75 of 256
  EXPECT_GT(p->decode.step.mtp_draft, 0.0);
  const double gain = p->decode.tokens_per_s_per_user / base;
  EXPECT_GT(gain, 1.0);
  EXPECT_LT(gain, 1.5);
}

TEST(PlannerPhysics, DistinctExpertsGrowFromTopKToAllExperts) {
  EXPECT_DOUBLE_EQ(expectedDistinctExperts(256, 8, 1), 8.0);
  EXPECT_NEAR(expectedDistinctExperts(256, 8, 2), 256 * (1 - std::pow(1 - 8.0 / 256, 2)), 1e-9);
  double prev = 0;
  for (double t = 1; t <= 256; t *= 2) {
    const double e = expectedDistinctExperts(256, 8, t);
    EXPECT_GT(e, prev);
    EXPECT_LE(e, 256.0);
    prev = e;
  }
  EXPECT_GT(expectedDistinctExperts(256, 8, 4096), 255.9);
  EXPECT_LE(expectedDistinctExperts(256, 8, 4096), 256.0);
}

TEST(PlannerPhysics, MoreBandwidthIsFaster) {
  PlanInput in;
  in.model = v3();
  in.hardware = hardware("h200");
  in.decode.tp = 8;
  in.workload.concurrency = 16;
  double prev = 0;
  for (const double bw : {1e12, 2e12, 4e12, 8e12}) {
    in.hardware.hbm_bandwidth = bw;
    const double t = decodeTokensPerUser(in);
    EXPECT_GT(t, prev) << bw;
    prev = t;
  }
}

TEST(PlannerPhysics, HigherNetworkLatencyIsSlowerAcrossNodesOnly) {
  double prev = 1e30;
  for (const double lat : {0.0, 0.2e-3, 0.7e-3, 1.2e-3, 2.2e-3}) {
    const double t = decodeTokensPerUser(h20Tp16(lat));
    EXPECT_LT(t, prev) << lat;
    prev = t;
  }
  // Inside one node the network latency does not enter the decode step.
  PlanInput one = h20Tp16(0.2e-3);
  one.decode.tp = 8;
  one.decode.nodes = 1;
  const double a = decodeTokensPerUser(one);
  one.hardware.net_latency = 2e-3;
  EXPECT_DOUBLE_EQ(decodeTokensPerUser(one), a);
}

TEST(PlannerPhysics, MoreConcurrencyGivesMoreTotalAndLessPerUser) {
  PlanInput in;
  in.model = v3();
  in.hardware = hardware("h200");
  in.decode.tp = 8;
  double prev_total = 0;
  double prev_user = 1e30;
  for (std::int64_t c = 1; c <= 512; c *= 2) {
    in.workload.concurrency = c;
    auto p = predict(in);
    ASSERT_TRUE(p.ok());
    EXPECT_GT(p->decode.tokens_per_s_total, prev_total) << c;
    EXPECT_LT(p->decode.tokens_per_s_per_user, prev_user) << c;
    prev_total = p->decode.tokens_per_s_total;
    prev_user = p->decode.tokens_per_s_per_user;
  }
}

TEST(PlannerPhysics, LargeBatchesTurnComputeBoundOnH20) {
  PlanInput in;
  in.model = v3();
  in.hardware = hardware("h20");
  in.decode.tp = 8;
  in.workload.concurrency = 1;
  auto small = predict(in);
  in.workload.concurrency = 1024;
  in.workload.input_len = 256;
  in.workload.output_len = 64;
  auto large = predict(in);
  ASSERT_TRUE(small.ok() && large.ok());
  EXPECT_FALSE(small->decode.step.compute_bound);
  EXPECT_TRUE(large->decode.step.compute_bound);
}

TEST(PlannerKv, BytesPerTokenAreLatentDimTimesLayersTimesDtype) {
  const ModelShape& m = v3();
  EXPECT_DOUBLE_EQ(m.kvBytesPerTokenMain(), (512.0 + 64.0) * 61 * 2);  // 70272: about 70 KB
  EXPECT_DOUBLE_EQ(m.kvBytesPerTokenWithMtp(), (512.0 + 64.0) * 62 * 2);
  ModelShape fp8kv = m;
  fp8kv.kv_dtype_bytes = 1;
  EXPECT_DOUBLE_EQ(fp8kv.kvBytesPerTokenMain(), (512.0 + 64.0) * 61);
  auto tiny = presetShape("tiny");
  ASSERT_TRUE(tiny.ok());
  EXPECT_DOUBLE_EQ(tiny->kvBytesPerTokenMain(), (64.0 + 16.0) * 3 * 2);

  PlanInput in;
  in.model = m;
  in.hardware = hardware("h200");
  in.workload.input_len = 1000;
  in.workload.output_len = 24;
  auto p = predict(in);
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->kv_bytes_per_token, 70272.0);
  EXPECT_DOUBLE_EQ(p->kv_bytes_per_request, 1024.0 * 70272.0);
  EXPECT_DOUBLE_EQ(p->kv_transfer_bytes_per_request, 1000.0 * 70272.0);
  in.workload.mtp_k = 1;  // the decode pool also holds the MTP layer's KV
  p = predict(in);
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(p->kv_bytes_per_token, 576.0 * 62 * 2);
}

TEST(PlannerTtft, SplitsIntoQueueingPrefillAndTransfer) {
  PlanInput in;
  in.model = v3();
  in.hardware = hardware("h800");
  in.prefill.tp = 8;
  in.decode.tp = 8;
  in.workload.input_len = 4096;
  auto alone = predict(in);
  ASSERT_TRUE(alone.ok());
  EXPECT_DOUBLE_EQ(alone->ttft.queueing, 0.0);  // one user never waits behind itself
  EXPECT_GT(alone->ttft.prefill_compute, 0.0);
  EXPECT_GT(alone->ttft.kv_transfer, 0.0);
  EXPECT_NEAR(alone->ttft.total, alone->ttft.prefill_compute + alone->ttft.kv_transfer, 1e-12);

  // Streaming hides most of the transfer behind prefill compute.
  in.kv_streaming = false;
  auto unstreamed = predict(in);
  ASSERT_TRUE(unstreamed.ok());
  EXPECT_NEAR(unstreamed->ttft.kv_transfer, 4096 * 70272.0 / in.hardware.net_bandwidth + in.hardware.net_latency, 1e-9);
  EXPECT_LT(alone->ttft.kv_transfer, unstreamed->ttft.kv_transfer);

  // Many users queue at one prefill replica; more replicas queue less.
  in.kv_streaming = true;
  in.workload.concurrency = 256;
  auto crowded = predict(in);
  ASSERT_TRUE(crowded.ok());
  EXPECT_GT(crowded->ttft.queueing, 0.0);
  in.prefill.dp = 4;
  auto spread = predict(in);
  ASSERT_TRUE(spread.ok());
  EXPECT_LT(spread->ttft.queueing, crowded->ttft.queueing);

  // An open loop beyond the prefill pool's capacity saturates.
  in.prefill.dp = 1;
  in.workload.request_rate = 2.0 / alone->ttft.prefill_compute;
  auto open = predict(in);
  ASSERT_TRUE(open.ok());
  EXPECT_TRUE(open->ttft.saturated);
  EXPECT_FALSE(std::isfinite(open->ttft.queueing));
}

TEST(PlannerPools, CheapestPoolsMeetBothSlos) {
  PlanInput in;
  in.model = v3();
  in.hardware = hardware("h200");
  in.prefill.tp = 8;
  in.decode.tp = 8;
  in.workload.input_len = 2048;
  in.workload.output_len = 512;
  in.workload.concurrency = 256;
  in.slo.ttft = 2.0;
  in.slo.tpot = 0.05;
  auto p = predict(in);
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(p->pools.feasible) << p->pools.reason;
  EXPECT_LE(p->pools.tpot, in.slo.tpot);
  EXPECT_LE(p->pools.ttft, in.slo.ttft);
  EXPECT_EQ(p->pools.decode_gpus, p->pools.decode_replicas * 8);
  EXPECT_NEAR(p->pools.ratio, static_cast<double>(p->pools.prefill_gpus) / p->pools.decode_gpus, 1e-12);
  // One replica fewer of either pool breaks an SLO (or memory).
  if (p->pools.prefill_replicas > 1) {
    EXPECT_GT(predictTtft(in, p->pools.prefill_replicas - 1, p->pools.tpot).total, in.slo.ttft);
  }

  // Twice the users never need fewer GPUs.
  in.workload.concurrency = 512;
  auto twice = predict(in);
  ASSERT_TRUE(twice.ok());
  ASSERT_TRUE(twice->pools.feasible);
  EXPECT_GE(twice->pools.prefill_gpus + twice->pools.decode_gpus, p->pools.prefill_gpus + p->pools.decode_gpus);

  // A TPOT no single user can reach is reported, not hidden.
  in.slo.tpot = 0.001;
  auto impossible = predict(in);
  ASSERT_TRUE(impossible.ok());
  EXPECT_FALSE(impossible->pools.feasible);
  EXPECT_NE(impossible->pools.reason.find("TPOT"), std::string::npos);
}

TEST(PlannerPools, OpenLoopRateSizesThePrefillPool) {
  PlanInput in;
  in.model = v3();
  in.hardware = hardware("h200");
  in.prefill.tp = 8;
  in.decode.tp = 8;
  in.workload.input_len = 4096;
  in.workload.concurrency = 64;
  const double service = prefillTime(in, 4096);
  in.workload.request_rate = 3.0 / service;  // three replicas' worth of prompts
  auto p = predict(in);
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(p->pools.feasible) << p->pools.reason;
  EXPECT_GE(p->pools.prefill_replicas, 4);  // utilization must stay below 1
  EXPECT_LE(p->pools.ttft, in.slo.ttft);
  EXPECT_GT(predictTtft(in, p->pools.prefill_replicas - 1, p->pools.tpot).total, in.slo.ttft);
}

TEST(PlannerMemory, DeepSeekV3DoesNotFitOneH20NodeButFitsTwo) {
  PlanInput in;
  in.model = v3();
  in.hardware = hardware("h20");  // 8 x 96 GB = 768 GB; FP8 weights are ~690 GB
  in.decode.tp = 8;
  in.workload.concurrency = 64;
  in.workload.input_len = 4096;
  auto p = predict(in);
  ASSERT_TRUE(p.ok());
  EXPECT_NEAR(p->memory.weight_bytes_per_gpu * 8 / 1e9, 690, 20);
  EXPECT_FALSE(p->memory.fits);
  in.decode.tp = 16;
  p = predict(in);
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->memory.fits);
  EXPECT_GE(p->memory.max_batch_per_replica, 64);
}

TEST(PlannerValidate, RejectsInconsistentInputsWithClearMessages) {
  PlanInput in = h20Tp16(0.2e-3);
  auto expectError = [](const PlanInput& bad, const std::string& needle) {
    auto p = predict(bad);
    ASSERT_FALSE(p.ok()) << needle;
    EXPECT_EQ(p.error().code, pd::ErrorCode::InvalidArgument);
    EXPECT_NE(p.error().message.find(needle), std::string::npos) << p.error().message;
  };
  PlanInput bad = in;
  bad.decode.ep = 3;
  expectError(bad, "ep 3 must divide tp 16");
  bad = in;
  bad.decode.nodes = 1;
  expectError(bad, "needs 16 GPUs per node");
  bad = in;
  bad.decode.nodes = 3;
  expectError(bad, "not a multiple of nodes 3");
  bad = in;
  bad.workload.mtp_acceptance = 1.5;
  expectError(bad, "mtp acceptance");
  bad = in;
  bad.hardware.hbm_bandwidth = 0;
  expectError(bad, "hbm bandwidth");
  bad = in;
  bad.workload.concurrency = 0;
  expectError(bad, "concurrency");
  bad = in;
  bad.model.mtp_layers = 0;
  bad.workload.mtp_k = 1;
  expectError(bad, "needs an MTP layer");
  EXPECT_FALSE(presetShape("deepseek-v4").ok());
  EXPECT_FALSE(builtinHardware("b200").ok());
}

TEST(PlannerCalibrate, RecoversEfficienciesFromMeasurementsItGenerated) {
  PlanInput truth;
  auto bench = presetShape("bench");
  ASSERT_TRUE(bench.ok());
  truth.model = bench.value();
  truth.hardware = hardware("h200");
  truth.hardware.name = "cpu";
  truth.hardware.hbm_bandwidth = 40e9;
  // Batch 1 memory-bound, batch 64 compute-bound: both constants are visible in the data.
  truth.hardware.bf16_flops = 200e9;
  truth.hardware.fp8_flops = 200e9;
  truth.hardware.memory_efficiency = 0.55;
  truth.hardware.compute_efficiency = 0.3;
  std::vector<CalibrationPoint> points;
  for (const std::int64_t c : {1, 4, 16, 64}) {
    PlanInput at = truth;
    const StepBreakdown s = decodeStep(at, static_cast<double>(c), 256);
    points.push_back({c, static_cast<double>(c) / s.total, 256, -1});
  }
  PlanInput start = truth;
  start.hardware.memory_efficiency = 1.0;
  start.hardware.compute_efficiency = 0.6;
  auto fit = calibrate(start, points);
  ASSERT_TRUE(fit.ok()) << fit.error().toString();
  EXPECT_NEAR(fit->hardware.memory_efficiency, 0.55, 0.55 * 0.02);
  EXPECT_NEAR(fit->hardware.compute_efficiency, 0.3, 0.3 * 0.02);
  EXPECT_LT(fit->rms_relative_error, 0.01);

  EXPECT_FALSE(calibrate(start, {}).ok());
  EXPECT_FALSE(calibrate(start, {{1, -3.0, -1, -1}}).ok());
  // Several latencies on one node cannot fit network constants.
  EXPECT_FALSE(calibrate(start, {{1, 10.0, -1, 0.1e-3}, {1, 5.0, -1, 1e-3}}).ok());
}

}  // namespace
