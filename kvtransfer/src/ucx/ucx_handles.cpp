#include "ucx/ucx_handles.h"

#include <fmt/format.h>

#include <algorithm>

#include "pd/common/log.h"

namespace pd::kvtransfer::ucx {
namespace {

struct ConfigDeleter {
  void operator()(ucp_config_t* config) const noexcept { ucp_config_release(config); }
};
using ConfigPtr = std::unique_ptr<ucp_config_t, ConfigDeleter>;

struct RkeyBufferDeleter {
  void operator()(void* buffer) const noexcept { ucp_rkey_buffer_release(buffer); }
};

struct WorkerAddressDeleter {
  ucp_worker_h worker = nullptr;
  void operator()(ucp_address_t* address) const noexcept { ucp_worker_release_address(worker, address); }
};

/// UCX parses packed addresses and remote keys without a length: callers check their structure
/// (ucx_blob_check.h), and a zero-padded copy keeps any fixed-size read of a transport's field
/// inside memory we own.
constexpr std::size_t kUcxBlobPadding = 256;
std::vector<std::uint8_t> zeroPadded(std::span<const std::uint8_t> bytes) {
  std::vector<std::uint8_t> out(bytes.size() + kUcxBlobPadding, 0);
  std::copy(bytes.begin(), bytes.end(), out.begin());
  return out;
}

}  // namespace

ErrorCode codeOf(ucs_status_t status) {
  switch (status) {
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_SOME_CONNECTS_FAILED:
      return ErrorCode::PeerFailed;
    case UCS_ERR_CANCELED:
      return ErrorCode::Cancelled;
    case UCS_ERR_TIMED_OUT:
      return ErrorCode::Timeout;
    case UCS_ERR_UNSUPPORTED:
      return ErrorCode::Unsupported;
    case UCS_ERR_INVALID_PARAM:
      return ErrorCode::InvalidArgument;
    default:
      return ErrorCode::Internal;
  }
}

Error ucsError(std::string_view what, ucs_status_t status) {
  return makeError(codeOf(status), fmt::format("{}: {}", what, ucs_status_string(status)));
}

Result<Context> Context::create(const std::string& tls,
                                const std::vector<std::pair<std::string, std::string>>& settings) {
  ucp_config_t* raw_config = nullptr;
  if (const auto st = ucp_config_read(nullptr, nullptr, &raw_config); st != UCS_OK) {
    return ucsError("ucp_config_read", st);
  }
  const ConfigPtr config(raw_config);
  if (const auto st = ucp_config_modify(config.get(), "TLS", tls.c_str()); st != UCS_OK) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("UCX refuses TLS '{}': {}", tls, ucs_status_string(st)));
  }
  for (const auto& [name, value] : settings) {
    // Transport settings carry their transport prefix, as in the environment (TCP_TX_SEG_SIZE);
    // UCX applies modified ones to every transport's table under the bare name.
    const std::string key = name.starts_with("TCP_") ? name.substr(4) : name;
    if (const auto st = ucp_config_modify(config.get(), key.c_str(), value.c_str()); st != UCS_OK) {
      return ucsError(fmt::format("UCX setting {}={}", name, value), st);
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  ucp_context_h context = nullptr;
  if (const auto st = ucp_init(&params, config.get(), &context); st != UCS_OK) {
    return ucsError(fmt::format("ucp_init (UCX_TLS={})", tls), st);
  }
  return Context(context);
}

bool Context::registersCudaMemory() const {
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context_.get(), &attr) != UCS_OK) return false;
  return (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

Result<Worker> Worker::create(const Context& context) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  if (const auto st = ucp_worker_create(context.get(), &params, &worker); st != UCS_OK) {
    return ucsError("ucp_worker_create", st);
  }
  return Worker(worker);
}

Result<std::vector<std::uint8_t>> Worker::address() const {
  ucp_address_t* raw = nullptr;
  std::size_t length = 0;
  if (const auto st = ucp_worker_get_address(worker_.get(), &raw, &length); st != UCS_OK) {
    return ucsError("ucp_worker_get_address", st);
  }
  const std::unique_ptr<ucp_address_t, WorkerAddressDeleter> address(raw, WorkerAddressDeleter{worker_.get()});
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(address.get());
  return std::vector<std::uint8_t>(bytes, bytes + length);
}

Result<int> Worker::eventFd() const {
  int fd = -1;
  if (const auto st = ucp_worker_get_efd(worker_.get(), &fd); st != UCS_OK) return ucsError("ucp_worker_get_efd", st);
  return fd;
}

Result<Endpoint> Endpoint::create(const Worker& worker, std::span<const std::uint8_t> address,
                                  ucp_err_handler_cb_t on_error, void* arg) {
  const std::vector<std::uint8_t> padded = zeroPadded(address);
  ucp_ep_params_t params{};
  params.field_mask =
      UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(padded.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = on_error;
  params.err_handler.arg = arg;
  ucp_ep_h ep = nullptr;
  if (const auto st = ucp_ep_create(worker.get(), &params, &ep); st != UCS_OK) {
    return ucsError("ucp_ep_create", st);
  }
  return Endpoint(ep);
}

Request Endpoint::close(bool force) {
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  params.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep_.release(), &params);
  if (UCS_PTR_IS_ERR(request)) {
    log::debug("kv", "endpoint close: {}", ucs_status_string(UCS_PTR_STATUS(request)));
    return {};
  }
  return request == nullptr ? Request{} : Request(request);
}

void Endpoint::Deleter::operator()(ucp_ep_h ep) const noexcept {
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  params.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &params);
  if (UCS_PTR_IS_PTR(request)) ucp_request_free(request);
}

Result<MemHandle> MemHandle::map(const Context& context, void* address, std::size_t length) {
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = address;
  params.length = length;
  ucp_mem_h memh = nullptr;
  if (const auto st = ucp_mem_map(context.get(), &params, &memh); st != UCS_OK) {
    return ucsError(fmt::format("ucp_mem_map of {} bytes", length), st);
  }
  return MemHandle(context.get(), memh);
}

void MemHandle::Deleter::operator()(ucp_mem_h memh) const noexcept {
  if (const auto st = ucp_mem_unmap(context, memh); st != UCS_OK) {
    log::warn("kv", "ucp_mem_unmap: {}", ucs_status_string(st));
  }
}

Result<std::vector<std::uint8_t>> MemHandle::packRemoteKey() const {
  void* raw = nullptr;
  std::size_t length = 0;
  if (const auto st = ucp_rkey_pack(memh_.get_deleter().context, memh_.get(), &raw, &length); st != UCS_OK) {
    return ucsError("ucp_rkey_pack", st);
  }
  const std::unique_ptr<void, RkeyBufferDeleter> buffer(raw);
  const auto* bytes = static_cast<const std::uint8_t*>(buffer.get());
  return std::vector<std::uint8_t>(bytes, bytes + length);
}

Result<RemoteKey> RemoteKey::unpack(const Endpoint& endpoint, std::span<const std::uint8_t> packed) {
  ucp_rkey_h rkey = nullptr;
  const std::vector<std::uint8_t> padded = zeroPadded(packed);
  if (const auto st = ucp_ep_rkey_unpack(endpoint.get(), padded.data(), &rkey); st != UCS_OK) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("remote key from the descriptor does not unpack: {}", ucs_status_string(st)));
  }
  return RemoteKey(rkey);
}

}  // namespace pd::kvtransfer::ucx
