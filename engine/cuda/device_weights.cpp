// DeviceWeights (device_weights.h): the fit check, then the chunked upload through pinned staging.
#include "device_weights.h"

#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <utility>

#include "device_ops.h"
#include "pd/common/log.h"
#include "weight_upload_plan.h"

namespace pd::gpu {
namespace {

constexpr std::uint64_t kMinStagingBytes = std::uint64_t{64} << 10;  // per half

double gigabytes(std::uint64_t bytes) {
  return static_cast<double>(bytes) / 1e9;
}

}  // namespace

DeviceWeights::DeviceWeights(ModelDevice device, DeviceMemoryPlan plan, cuda::DeviceBuffer<std::byte> arena,
                             std::vector<Tensor> tensors)
    : device_(device), plan_(plan), arena_(std::move(arena)), tensors_(std::move(tensors)) {
  for (std::size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace(tensors_[i].name, i);
}

DeviceWeights::~DeviceWeights() {
  if (arena_.data() == nullptr) return;
  const Status status = PD_CUDA_STATUS(cudaSetDevice(device_.index));
  if (!status.ok()) cuda::detail::logReleaseFailure(status);
}

const DeviceWeights::Tensor* DeviceWeights::find(std::string_view name) const {
  const auto it = by_name_.find(std::string(name));
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

Result<std::vector<std::byte>> DeviceWeights::readBack(const Tensor& tensor) const {
  PD_CUDA_TRY(cudaSetDevice(device_.index));
  std::vector<std::byte> host(tensor.bytes);
  if (tensor.bytes > 0) PD_CUDA_TRY(cudaMemcpy(host.data(), tensor.data, tensor.bytes, cudaMemcpyDeviceToHost));
  return host;
}

Result<DeviceWeights> DeviceWeights::upload(const Checkpoint& checkpoint, const ModelConfig& config,
                                            const Options& options) {
  std::vector<HostTensor> tensors;
  for (const TensorView* view : checkpoint.tensors()) {
    HostTensor t;
    t.name = view->name;
    t.dtype = view->dtype;
    t.shape = view->shape;
    t.data = view->data;
    tensors.push_back(std::move(t));
  }
  return upload(tensors, config, options);
}

Result<DeviceWeights> DeviceWeights::upload(const std::vector<HostTensor>& views, const ModelConfig& config,
                                            const Options& options) {
  const std::string name = modelDeviceName(options.device);
  if (options.device.kind != ModelDevice::Kind::Cuda) {
    return makeError(ErrorCode::InvalidArgument, "DeviceWeights: the device must be cuda[:N]");
  }
  if (options.staging_bytes < 2 * kMinStagingBytes) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("DeviceWeights: staging_bytes = {} is below {}",
                                                             options.staging_bytes, 2 * kMinStagingBytes));
  }
  const int count = deviceCount();
  if (count == 0) {
    return makeError(ErrorCode::Unsupported, fmt::format("{}: no CUDA device is visible to this process", name));
  }
  if (options.device.index >= count) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("{}: only {} CUDA device(s) are visible", name, count));
  }

  // Host plan: layout and chunks, then the fit check, all before the first allocation.
  std::vector<std::uint64_t> sizes;
  sizes.reserve(views.size());
  for (const HostTensor& view : views) sizes.push_back(view.data.size());
  PD_ASSIGN_OR_RETURN(const DeviceTensorLayout layout, layoutDeviceTensors(sizes));
  const std::uint64_t half = options.staging_bytes / 2;
  PD_ASSIGN_OR_RETURN(const std::vector<UploadChunk> chunks, planUploadChunks(sizes, half));
  PD_ASSIGN_OR_RETURN(DeviceMemoryPlan plan, planDeviceMemory(config, options.serving));
  plan.weights = layout.total;  // what this checkpoint really takes, padding included
  PD_CUDA_TRY(cudaSetDevice(options.device.index));
  PD_ASSIGN_OR_RETURN(const DeviceMemoryInfo memory, deviceMemoryInfo());
  PD_TRY(checkDeviceFit(plan, memory.free, options.reserve_bytes, name));

  log::info("engine", "{}: uploading {} tensors, {:.2f} GB, through {} MiB of pinned staging in {} chunks", name,
            views.size(), gigabytes(layout.total), options.staging_bytes >> 20, chunks.size());
  const auto start = std::chrono::steady_clock::now();
  // Declared in acquisition order; the arena outlives the upload, the rest dies after the final
  // synchronize below.
  PD_ASSIGN_OR_RETURN(auto arena, cuda::DeviceBuffer<std::byte>::create(layout.total));
  PD_ASSIGN_OR_RETURN(const cuda::Stream stream, cuda::Stream::create());
  PD_ASSIGN_OR_RETURN(auto staging, cuda::PinnedHostBuffer<std::byte>::create(2 * half));
  PD_ASSIGN_OR_RETURN(const cuda::Event slot0_free, cuda::Event::create());
  PD_ASSIGN_OR_RETURN(const cuda::Event slot1_free, cuda::Event::create());
  const cuda::Event* slot_free[2] = {&slot0_free, &slot1_free};

  std::uint64_t uploaded = 0;
  int next_decile = 1;
  const auto copy_all = [&]() -> Status {
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      const std::size_t slot = c % 2;
      std::byte* slot_base = staging.data() + slot * half;
      if (c >= 2) PD_TRY(slot_free[slot]->synchronize());  // the copies out of this half have run
      for (const UploadPiece& piece : chunks[c].pieces) {
        std::memcpy(slot_base + piece.staging_offset, views[piece.tensor].data.data() + piece.source_offset,
                    piece.bytes);
      }
      for (const UploadPiece& piece : chunks[c].pieces) {
        std::byte* target = arena.data() + layout.offsets[piece.tensor] + piece.source_offset;
        PD_CUDA_TRY(cudaMemcpyAsync(target, slot_base + piece.staging_offset, piece.bytes, cudaMemcpyHostToDevice,
                                    stream.get()));
      }
      PD_TRY(slot_free[slot]->record(stream));
      uploaded += chunks[c].bytes;
      while (next_decile <= 10 && uploaded * 10 >= static_cast<std::uint64_t>(next_decile) * layout.total) {
        if (next_decile < 10) {
          log::info("engine", "{}: uploaded {:.2f} of {:.2f} GB ({}%)", name, gigabytes(uploaded),
                    gigabytes(layout.total), next_decile * 10);
        }
        ++next_decile;
      }
    }
    return okStatus();
  };
  // On a failure too, no copy may still read the staging buffer when it is freed.
  const Status copied = copy_all();
  const Status synced = stream.synchronize();
  PD_TRY(copied);
  PD_TRY(synced);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log::info("engine", "{}: weights resident: {:.2f} GB in {:.2f} s ({:.2f} GB/s)", name, gigabytes(uploaded), seconds,
            seconds > 0 ? gigabytes(uploaded) / seconds : 0.0);

  std::vector<Tensor> tensors;
  tensors.reserve(views.size());
  for (std::size_t i = 0; i < views.size(); ++i) {
    tensors.push_back(Tensor{views[i].name, views[i].dtype, views[i].shape, arena.data() + layout.offsets[i], sizes[i],
                             views[i].block_rows, views[i].block_cols});
  }
  return DeviceWeights(options.device, plan, std::move(arena), std::move(tensors));
}

}  // namespace pd::gpu
