#include "pd/cuda/cuda_handles.h"

#include "pd/common/log.h"

namespace pd::cuda {

int deviceCount() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaSuccess) return count;
  (void)cudaGetLastError();
  // No driver or no device is the common case (a CPU machine: cudaErrorInsufficientDriver with a
  // driver version of 0). Anything else (a driver older than this CUDA runtime needs, a bad
  // CUDA_VISIBLE_DEVICES) must not look like it.
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  (void)cudaGetLastError();
  if (status != cudaErrorNoDevice && driver != 0) {
    log::warn("cuda",
              "no usable CUDA device: cudaGetDeviceCount failed: {} ({}); driver supports CUDA {}.{}, runtime is {}.{}",
              cudaGetErrorString(status), cudaGetErrorName(status), driver / 1000, driver % 1000 / 10,
              CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
  }
  return 0;
}

namespace detail {

void logReleaseFailure(const Status& status) noexcept {
  try {
    if (!status.ok()) log::warn("cuda", "{}", status.error().toString());
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw, and logging is all it does
  }
}

void DeviceFree::operator()(void* ptr) const noexcept {
  logReleaseFailure(PD_CUDA_STATUS(cudaFree(ptr)));
}

void PinnedFree::operator()(void* ptr) const noexcept {
  logReleaseFailure(PD_CUDA_STATUS(cudaFreeHost(ptr)));
}

Result<std::size_t> byteCount(std::size_t count, std::size_t element_bytes) {
  if (element_bytes != 0 && count > std::numeric_limits<std::size_t>::max() / element_bytes) {
    return makeError(ErrorCode::InvalidArgument, "cuda buffer: element count overflows the byte size");
  }
  return count * element_bytes;
}

}  // namespace detail

Result<Stream> Stream::create() {
  cudaStream_t stream = nullptr;
  PD_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return Stream(stream);
}

Status Stream::synchronize() const {
  return PD_CUDA_STATUS(cudaStreamSynchronize(stream_.get()));
}

void Stream::Deleter::operator()(cudaStream_t stream) const noexcept {
  detail::logReleaseFailure(PD_CUDA_STATUS(cudaStreamDestroy(stream)));
}

Result<Event> Event::create() {
  cudaEvent_t event = nullptr;
  PD_CUDA_TRY(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return Event(event);
}

Status Event::record(const Stream& stream) const {
  return PD_CUDA_STATUS(cudaEventRecord(event_.get(), stream.get()));
}

Status Event::waitOn(const Stream& stream) const {
  return PD_CUDA_STATUS(cudaStreamWaitEvent(stream.get(), event_.get(), 0));
}

Status Event::synchronize() const {
  return PD_CUDA_STATUS(cudaEventSynchronize(event_.get()));
}

void Event::Deleter::operator()(cudaEvent_t event) const noexcept {
  detail::logReleaseFailure(PD_CUDA_STATUS(cudaEventDestroy(event)));
}

namespace {
struct GraphDeleter {
  void operator()(cudaGraph_t graph) const noexcept {
    detail::logReleaseFailure(PD_CUDA_STATUS(cudaGraphDestroy(graph)));
  }
};
using OwnedGraph = std::unique_ptr<CUgraph_st, GraphDeleter>;
}  // namespace

Result<Graph> Graph::capture(const Stream& stream, const std::function<Status()>& body) {
  PD_CUDA_TRY(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  const Status queued = body();
  cudaGraph_t raw = nullptr;
  const Status ended = PD_CUDA_STATUS(cudaStreamEndCapture(stream.get(), &raw));
  const OwnedGraph graph(raw);  // owned whatever happens next
  PD_TRY(queued);
  PD_TRY(ended);
  if (!graph) return makeError(ErrorCode::Internal, "cuda graph: the capture produced no graph");
  cudaGraphExec_t exec = nullptr;
  PD_CUDA_TRY(cudaGraphInstantiate(&exec, graph.get(), 0));
  return Graph(exec);
}

Status Graph::launch(const Stream& stream) const {
  return PD_CUDA_STATUS(cudaGraphLaunch(exec_.get(), stream.get()));
}

void Graph::Deleter::operator()(cudaGraphExec_t exec) const noexcept {
  detail::logReleaseFailure(PD_CUDA_STATUS(cudaGraphExecDestroy(exec)));
}

}  // namespace pd::cuda
