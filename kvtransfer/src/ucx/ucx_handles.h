#pragma once
// Move-only RAII owners of UCX handles. Each is acquired by a static create()/map()/unpack()
// that returns a Result, and released in its destructor (which logs, never throws). Owners that
// depend on another (Worker on Context, Endpoint on Worker, RemoteKey on Endpoint) must be
// destroyed first: declare them after what they depend on.
//
// Thread rules: a Context may be shared; everything else belongs to the thread that progresses
// its worker (UcxTransport's progress thread), or to one thread before that thread starts.

#include <ucp/api/ucp.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pd/common/result.h"

namespace pd::kvtransfer::ucx {

/// "<what>: <UCX status string>" with the ErrorCode a caller can act on (see codeOf).
[[nodiscard]] Error ucsError(std::string_view what, ucs_status_t status);
/// Peer-side failures (unreachable, reset, endpoint timeout) -> PeerFailed; canceled ->
/// Cancelled; timed out -> Timeout; unsupported -> Unsupported; anything else -> Internal.
[[nodiscard]] ErrorCode codeOf(ucs_status_t status);

class Context {
 public:
  /// ucp_config_read, then UCX_TLS and `settings` (UCX variable names without the UCX_ prefix,
  /// e.g. TCP_TX_SEG_SIZE) override the environment, then ucp_init with RMA, AM and WAKEUP.
  [[nodiscard]] static Result<Context> create(const std::string& tls,
                                              const std::vector<std::pair<std::string, std::string>>& settings);
  [[nodiscard]] ucp_context_h get() const { return context_.get(); }
  /// Whether this context can register CUDA device memory (ucp_context_query's memory types):
  /// a UCX built with CUDA support whose transports include cuda ones.
  [[nodiscard]] bool registersCudaMemory() const;

 private:
  struct Deleter {
    void operator()(ucp_context_h context) const noexcept { ucp_cleanup(context); }
  };
  explicit Context(ucp_context_h context) : context_(context) {}
  std::unique_ptr<ucp_context, Deleter> context_;
};

class Worker {
 public:
  /// A single-threaded worker: only its progress thread may touch it.
  [[nodiscard]] static Result<Worker> create(const Context& context);
  [[nodiscard]] ucp_worker_h get() const { return worker_.get(); }
  /// The packed worker address that peers connect to.
  [[nodiscard]] Result<std::vector<std::uint8_t>> address() const;
  /// The fd that becomes readable after ucp_worker_arm() when events arrive.
  [[nodiscard]] Result<int> eventFd() const;

 private:
  struct Deleter {
    void operator()(ucp_worker_h worker) const noexcept { ucp_worker_destroy(worker); }
  };
  explicit Worker(ucp_worker_h worker) : worker_(worker) {}
  std::unique_ptr<ucp_worker, Deleter> worker_;
};

/// An outstanding non-blocking request. Destroying it releases it to UCX with
/// ucp_request_free: the operation may still complete, but its callback no longer runs.
class Request {
 public:
  Request() = default;
  /// Takes the result of a *_nbx call that returned a request pointer.
  explicit Request(void* request) : request_(request) {}
  [[nodiscard]] void* get() const { return request_.get(); }
  [[nodiscard]] bool empty() const { return request_ == nullptr; }
  /// UCS_INPROGRESS while pending, else the completion status.
  [[nodiscard]] ucs_status_t status() const { return ucp_request_check_status(request_.get()); }

 private:
  struct Deleter {
    void operator()(void* request) const noexcept { ucp_request_free(request); }
  };
  std::unique_ptr<void, Deleter> request_;
};

class Endpoint {
 public:
  /// An empty (closed) endpoint, like a moved-from one.
  Endpoint() = default;
  /// Connects to a packed worker address with peer error handling; `on_error(arg, ep, status)`
  /// runs on the worker's progress thread when the peer fails. UCX parses `address` without
  /// bounds: bytes from the network must pass UcxBlobCheck::checkWorkerAddress first.
  [[nodiscard]] static Result<Endpoint> create(const Worker& worker, std::span<const std::uint8_t> address,
                                               ucp_err_handler_cb_t on_error, void* arg);
  [[nodiscard]] ucp_ep_h get() const { return ep_.get(); }
  [[nodiscard]] bool open() const { return ep_ != nullptr; }
  /// Closes the endpoint (force: without waiting for the peer; outstanding requests complete
  /// with UCS_ERR_CANCELED, possibly inside this call). Returns the close request, empty when
  /// the close completed at once. The Endpoint is empty afterwards.
  [[nodiscard]] Request close(bool force);

 private:
  struct Deleter {
    void operator()(ucp_ep_h ep) const noexcept;  // force close
  };
  explicit Endpoint(ucp_ep_h ep) : ep_(ep) {}
  std::unique_ptr<ucp_ep, Deleter> ep_;
};

/// Registered memory (ucp_mem_map of caller-owned memory).
class MemHandle {
 public:
  [[nodiscard]] static Result<MemHandle> map(const Context& context, void* address, std::size_t length);
  [[nodiscard]] ucp_mem_h get() const { return memh_.get(); }
  /// The remote key that lets a peer write into this memory.
  [[nodiscard]] Result<std::vector<std::uint8_t>> packRemoteKey() const;

 private:
  struct Deleter {
    ucp_context_h context = nullptr;
    void operator()(ucp_mem_h memh) const noexcept;
  };
  MemHandle(ucp_context_h context, ucp_mem_h memh) : memh_(memh, Deleter{context}) {}
  std::unique_ptr<ucp_mem, Deleter> memh_;
};

/// A peer's packed remote key unpacked for one endpoint.
class RemoteKey {
 public:
  /// `packed` from the network must pass UcxBlobCheck::checkRemoteKey first (UCX reads it
  /// without bounds). InvalidArgument when UCX refuses it.
  [[nodiscard]] static Result<RemoteKey> unpack(const Endpoint& endpoint, std::span<const std::uint8_t> packed);
  [[nodiscard]] ucp_rkey_h get() const { return rkey_.get(); }

 private:
  struct Deleter {
    void operator()(ucp_rkey_h rkey) const noexcept { ucp_rkey_destroy(rkey); }
  };
  explicit RemoteKey(ucp_rkey_h rkey) : rkey_(rkey) {}
  std::unique_ptr<ucp_rkey, Deleter> rkey_;
};

}  // namespace pd::kvtransfer::ucx
