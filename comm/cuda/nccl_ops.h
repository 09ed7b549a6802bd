#pragma once
// The C-level boundary between pdserve's C++20 code (nccl_communicator.cpp) and the NCCL / CUDA
// runtime headers (included only by nccl_ops.cpp). Functions return an empty string on
// success, else the NCCL or CUDA error text. Handles are opaque; one NcclRank per rank.

#include <cstddef>
#include <string>

namespace pd::comm::nccl {

constexpr std::size_t kUniqueIdBytes = 128;  // sizeof(ncclUniqueId)

struct NcclRank;

int deviceCount();
std::string makeUniqueId(unsigned char* id_out);  // kUniqueIdBytes
/// Creates the rank's communicator, stream and a staging buffer of `staging_bytes`.
std::string initRank(const unsigned char* id, int nranks, int rank, int device, std::size_t staging_bytes,
                     NcclRank** out);
void destroyRank(NcclRank* r);
/// In place over host memory, staged through the device buffer (pieces of staging size).
std::string allReduceSumHost(NcclRank* r, float* data, std::size_t count);
std::string allGatherHost(NcclRank* r, const void* send, void* recv, std::size_t bytes_per_rank);
std::string broadcastHost(NcclRank* r, void* data, std::size_t bytes, int root);
std::string barrier(NcclRank* r);

}  // namespace pd::comm::nccl
