// NCCL on the device: the one NCCL group a one-GPU machine can form (one rank; NCCL refuses two
// ranks on one device), bootstrapped over a loopback group as the workers do (rank 0 makes the
// unique id). Its host collectives (staged through the device) and its device collectives
// (device_collectives.h: ncclAllReduce / ncclAllGather on device buffers, eagerly and recorded in a
// CUDA graph, as the decode step's graphs record them). Where no device is visible the program says
// so and exits 77 (ctest: skipped); with a device, an NCCL communicator that cannot be made fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "gpu/gpu_test_main.h"
#include "pd/comm/communicator.h"
#include "pd/comm/device_collectives.h"
#include "pd/comm/nccl_communicator.h"
#include "pd/cuda/cuda_handles.h"
#include "unit/comm/communicator_test_support.h"

namespace {

using pd::comm::createLoopbackGroup;
using pd::comm::createNcclCommunicator;

TEST(NcclDevice, OneRankHostCollectives) {
  ASSERT_TRUE(pd::comm::builtWithNccl()) << "this CUDA build has no NCCL";
  auto group = createLoopbackGroup(1);
  auto nccl = createNcclCommunicator(*group[0], 0);
  ASSERT_TRUE(nccl.ok()) << nccl.error().toString();
  EXPECT_EQ((*nccl)->kind(), "nccl");
  EXPECT_EQ(pd::comm::test::exercise(**nccl, 5000), "");
}

TEST(NcclDevice, OneRankDeviceCollectivesEagerAndInAGraph) {
  auto group = createLoopbackGroup(1);
  auto nccl = createNcclCommunicator(*group[0], 0);
  ASSERT_TRUE(nccl.ok()) << nccl.error().toString();
  pd::comm::DeviceCollectives* dc = (*nccl)->deviceCollectives();
  ASSERT_NE(dc, nullptr);
  EXPECT_TRUE(dc->capturable());
  auto stream = pd::cuda::Stream::create();
  ASSERT_TRUE(stream.ok()) << stream.error().toString();
  constexpr std::size_t kCount = 4096;
  std::vector<float> host(kCount);
  for (std::size_t i = 0; i < kCount; ++i) host[i] = static_cast<float>(i % 97) - 48.5F;
  auto data = pd::cuda::DeviceBuffer<float>::create(kCount);
  auto gathered = pd::cuda::DeviceBuffer<float>::create(kCount);
  ASSERT_TRUE(data.ok() && gathered.ok());
  ASSERT_TRUE(data->copyFromHost(host, *stream).ok());
  // Eager first (NCCL's first collective sets up its resources outside any capture).
  ASSERT_TRUE(dc->allReduceSum(data->data(), kCount, stream->get()).ok());
  ASSERT_TRUE(dc->allGather(data->data(), gathered->data(), kCount, stream->get()).ok());
  ASSERT_TRUE(dc->awaitStream(stream->get()).ok());
  std::vector<float> back(kCount, 0.0F);
  ASSERT_TRUE(gathered->copyToHost(back, *stream).ok());
  ASSERT_TRUE(stream->synchronize().ok());
  EXPECT_EQ(back, host) << "one rank: the sum and the gather are the input";
  // Recorded in a graph and replayed twice.
  auto graph = pd::cuda::Graph::capture(*stream, [&]() -> pd::Status {
    PD_TRY(dc->allReduceSum(data->data(), kCount, stream->get()));
    return dc->allGather(data->data(), gathered->data(), kCount, stream->get());
  });
  ASSERT_TRUE(graph.ok()) << graph.error().toString();
  for (int replay = 0; replay < 2; ++replay) {
    ASSERT_TRUE(graph->launch(*stream).ok());
    ASSERT_TRUE(dc->awaitStream(stream->get()).ok());
  }
  std::fill(back.begin(), back.end(), 0.0F);
  ASSERT_TRUE(gathered->copyToHost(back, *stream).ok());
  ASSERT_TRUE(stream->synchronize().ok());
  EXPECT_EQ(back, host);
}

}  // namespace

int main(int argc, char** argv) {
  return pd::testutil::runGpuTests(argc, argv, "the NCCL device tests");
}
