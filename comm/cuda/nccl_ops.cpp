// NCCL / CUDA runtime side of the NCCL communicator (nccl_ops.h): host data is staged through a
// device buffer that grows to the largest collective seen.
#include "nccl_ops.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>

namespace pd::comm::nccl {

static_assert(sizeof(ncclUniqueId) == kUniqueIdBytes);

struct NcclRank {
  int device = 0;
  int nranks = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  void* buffer = nullptr;
  std::size_t buffer_bytes = 0;
};

namespace {

std::string cudaText(cudaError_t e, const char* what) {
  return std::string(what) + ": " + cudaGetErrorString(e);
}
std::string ncclText(ncclResult_t e, const char* what) {
  return std::string(what) + ": " + ncclGetErrorString(e);
}

std::string ensureBuffer(NcclRank* r, std::size_t bytes) {
  if (bytes <= r->buffer_bytes) return {};
  if (r->buffer != nullptr) cudaFree(r->buffer);
  r->buffer = nullptr;
  r->buffer_bytes = 0;
  if (cudaError_t e = cudaMalloc(&r->buffer, bytes); e != cudaSuccess) return cudaText(e, "cudaMalloc");
  r->buffer_bytes = bytes;
  return {};
}

std::string finish(NcclRank* r) {
  if (cudaError_t e = cudaStreamSynchronize(r->stream); e != cudaSuccess) return cudaText(e, "cudaStreamSynchronize");
  return {};
}

}  // namespace

int deviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

std::string makeUniqueId(unsigned char* id_out) {
  ncclUniqueId id;
  if (ncclResult_t e = ncclGetUniqueId(&id); e != ncclSuccess) return ncclText(e, "ncclGetUniqueId");
  std::memcpy(id_out, &id, sizeof(id));
  return {};
}

std::string initRank(const unsigned char* id_bytes, int nranks, int rank, int device, std::size_t staging_bytes,
                     NcclRank** out) {
  auto* r = new NcclRank;
  r->device = device;
  r->nranks = nranks;
  std::string err;
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    err = cudaText(e, "cudaSetDevice");
  } else if (cudaError_t e2 = cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking); e2 != cudaSuccess) {
    err = cudaText(e2, "cudaStreamCreate");
  } else {
    ncclUniqueId id;
    std::memcpy(&id, id_bytes, sizeof(id));
    if (ncclResult_t e3 = ncclCommInitRank(&r->comm, nranks, id, rank); e3 != ncclSuccess) {
      r->comm = nullptr;
      err = ncclText(e3, "ncclCommInitRank");
    } else {
      err = ensureBuffer(r, staging_bytes);
    }
  }
  if (!err.empty()) {
    destroyRank(r);
    return err;
  }
  *out = r;
  return {};
}

void destroyRank(NcclRank* r) {
  if (r == nullptr) return;
  cudaSetDevice(r->device);
  if (r->comm != nullptr) ncclCommDestroy(r->comm);
  if (r->buffer != nullptr) cudaFree(r->buffer);
  if (r->stream != nullptr) cudaStreamDestroy(r->stream);
  delete r;
}

std::string allReduceSumHost(NcclRank* r, float* data, std::size_t count) {
  const std::size_t bytes = count * sizeof(float);
  if (std::string err = ensureBuffer(r, bytes); !err.empty()) return err;
  if (cudaError_t e = cudaMemcpyAsync(r->buffer, data, bytes, cudaMemcpyHostToDevice, r->stream); e != cudaSuccess) {
    return cudaText(e, "cudaMemcpyAsync");
  }
  if (ncclResult_t e = ncclAllReduce(r->buffer, r->buffer, count, ncclFloat32, ncclSum, r->comm, r->stream);
      e != ncclSuccess) {
    return ncclText(e, "ncclAllReduce");
  }
  if (cudaError_t e = cudaMemcpyAsync(data, r->buffer, bytes, cudaMemcpyDeviceToHost, r->stream); e != cudaSuccess) {
    return cudaText(e, "cudaMemcpyAsync");
  }
  return finish(r);
}

std::string allGatherHost(NcclRank* r, const void* send, void* recv, std::size_t bytes_per_rank) {
  const std::size_t total = bytes_per_rank * static_cast<std::size_t>(r->nranks);
  if (std::string err = ensureBuffer(r, total + bytes_per_rank); !err.empty()) return err;
  char* dev_recv = static_cast<char*>(r->buffer);
  char* dev_send = dev_recv + total;
  if (cudaError_t e = cudaMemcpyAsync(dev_send, send, bytes_per_rank, cudaMemcpyHostToDevice, r->stream);
      e != cudaSuccess) {
    return cudaText(e, "cudaMemcpyAsync");
  }
  if (ncclResult_t e = ncclAllGather(dev_send, dev_recv, bytes_per_rank, ncclUint8, r->comm, r->stream);
      e != ncclSuccess) {
    return ncclText(e, "ncclAllGather");
  }
  if (cudaError_t e = cudaMemcpyAsync(recv, dev_recv, total, cudaMemcpyDeviceToHost, r->stream); e != cudaSuccess) {
    return cudaText(e, "cudaMemcpyAsync");
  }
  return finish(r);
}

std::string broadcastHost(NcclRank* r, void* data, std::size_t bytes, int root) {
  if (std::string err = ensureBuffer(r, bytes); !err.empty()) return err;
  if (cudaError_t e = cudaMemcpyAsync(r->buffer, data, bytes, cudaMemcpyHostToDevice, r->stream); e != cudaSuccess) {
    return cudaText(e, "cudaMemcpyAsync");
  }
  if (ncclResult_t e = ncclBroadcast(r->buffer, r->buffer, bytes, ncclUint8, root, r->comm, r->stream);
      e != ncclSuccess) {
    return ncclText(e, "ncclBroadcast");
  }
  if (cudaError_t e = cudaMemcpyAsync(data, r->buffer, bytes, cudaMemcpyDeviceToHost, r->stream); e != cudaSuccess) {
    return cudaText(e, "cudaMemcpyAsync");
  }
  return finish(r);
}

std::string barrier(NcclRank* r) {
  float one = 1.0F;
  return allReduceSumHost(r, &one, 1);
}

}  // namespace pd::comm::nccl
