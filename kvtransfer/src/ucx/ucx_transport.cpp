// UcxTransport: Transport over one UCX worker, progressed by one thread it owns. This file: the
// transport's construction and destruction, registered memory, and the public option helpers.
// The class and the split of its other concerns: ucx_transport_impl.h.

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "pd/common/log.h"
#include "ucx/ucx_transport_impl.h"

namespace pd::kvtransfer {
namespace detail {

/// Every entry of `tls` a host transport, where UCX 1.13 only emulates RMA.
bool hostTransportsOnly(std::string_view tls) {
  constexpr std::string_view kHost[] = {"tcp", "sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self", "mm"};
  while (!tls.empty()) {
    const auto comma = tls.find(',');
    std::string_view entry = tls.substr(0, comma);
    if (!entry.empty() && entry.front() == '^') return false;  // an exclusion list means "all but"
    if (std::find(std::begin(kHost), std::end(kHost), entry) == std::end(kHost)) return false;
    tls = comma == std::string_view::npos ? std::string_view() : tls.substr(comma + 1);
  }
  return true;
}

crypto::Digest recordTag(const InternalAuth& auth, std::uint64_t data_bytes, std::span<const std::uint8_t> record) {
  std::vector<std::byte> message;
  message.reserve(8 + record.size());
  const auto append_u64 = [&message](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) message.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
  };
  append_u64(data_bytes);
  const auto bytes = std::as_bytes(record);
  message.insert(message.end(), bytes.begin(), bytes.end());
  return auth.tag("kv-record", message);
}

namespace {

/// UCX_NET_DEVICES limiting UCX's network devices to the interface of options.host (see
/// UcxTransportOptions::host); nothing when the host is a wildcard or no limit is safe.
Result<std::vector<std::pair<std::string, std::string>>> interfaceSettings(const UcxTransportOptions& options) {
  const std::string& host = options.host;
  if (host.empty() || host == "0.0.0.0" || host == "::") return std::vector<std::pair<std::string, std::string>>{};
  in_addr v4{};
  in6_addr v6{};
  const bool is_v4 = ::inet_pton(AF_INET, host.c_str(), &v4) == 1;
  const bool is_v6 = !is_v4 && ::inet_pton(AF_INET6, host.c_str(), &v6) == 1;
  if (!is_v4 && !is_v6) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("kvtransfer host '{}' is not a numeric IPv4 or IPv6 address", host));
  }
  ifaddrs* raw = nullptr;
  if (::getifaddrs(&raw) != 0) return makeError(ErrorCode::Io, fmt::format("getifaddrs: {}", std::strerror(errno)));
  const std::unique_ptr<ifaddrs, decltype(&::freeifaddrs)> list(raw, &::freeifaddrs);
  for (const ifaddrs* a = list.get(); a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr) continue;
    bool match = false;
    if (is_v4 && a->ifa_addr->sa_family == AF_INET) {
      match = std::memcmp(&reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, &v4, sizeof(v4)) == 0;
    } else if (is_v6 && a->ifa_addr->sa_family == AF_INET6) {
      match = std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a->ifa_addr)->sin6_addr, &v6, sizeof(v6)) == 0;
    }
    if (!match) continue;
    if ((a->ifa_flags & IFF_LOOPBACK) == 0 && !hostTransportsOnly(options.ucx_tls)) {
      log::warn("kv",
                "{}: UCX_TLS={} may use RDMA devices, which a device list naming {} would drop; UCX's tcp "
                "transport listens on every interface",
                options.name, options.ucx_tls, a->ifa_name);
      return std::vector<std::pair<std::string, std::string>>{};
    }
    return std::vector<std::pair<std::string, std::string>>{{"NET_DEVICES", a->ifa_name}};
  }
  return makeError(ErrorCode::InvalidArgument, fmt::format("kvtransfer host {} is no address of this host", host));
}

/// The blob checks calibrated on this process's own worker address and on the remote key of a
/// small scratch registration (host memory, like every KV region).
Result<ucx::UcxBlobCheck> ownBlobCheck(const ucx::Context& context, std::span<const std::uint8_t> address) {
  std::array<std::byte, 64> scratch{};
  PD_ASSIGN_OR_RETURN(const auto mem, ucx::MemHandle::map(context, scratch.data(), scratch.size()));
  PD_ASSIGN_OR_RETURN(const auto rkey, mem.packRemoteKey());
  return ucx::UcxBlobCheck::create(address, rkey);
}

}  // namespace

Result<std::unique_ptr<Transport>> UcxTransport::create(const UcxTransportOptions& options) {
  if (options.ucx_tls.find("tcp") == std::string::npos) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("kvtransfer ucx_tls '{}' must include tcp: shared-memory-only transports refuse "
                                 "peer error handling, so a dead peer could never be reported",
                                 options.ucx_tls));
  }
  auto settings = ucxSettings(options);
  PD_ASSIGN_OR_RETURN(auto devices, interfaceSettings(options));
  settings.insert(settings.end(), devices.begin(), devices.end());
  PD_ASSIGN_OR_RETURN(auto context, ucx::Context::create(options.ucx_tls, settings));
  PD_ASSIGN_OR_RETURN(auto worker, ucx::Worker::create(context));
  PD_ASSIGN_OR_RETURN(auto address, worker.address());
  PD_ASSIGN_OR_RETURN(auto blob_check, ownBlobCheck(context, address));
  PD_ASSIGN_OR_RETURN(const int worker_fd, worker.eventFd());
  Fd epoll_fd(::epoll_create1(EPOLL_CLOEXEC));
  Fd event_fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (epoll_fd.get() < 0 || event_fd.get() < 0) {
    return makeError(ErrorCode::Io, fmt::format("epoll/eventfd: {}", std::strerror(errno)));
  }
  for (const int fd : {worker_fd, event_fd.get()}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (::epoll_ctl(epoll_fd.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      return makeError(ErrorCode::Io, fmt::format("epoll_ctl: {}", std::strerror(errno)));
    }
  }
  std::unique_ptr<UcxTransport> transport(new UcxTransport(options, std::move(context), std::move(worker),
                                                           std::move(address), std::move(blob_check),
                                                           std::move(epoll_fd), std::move(event_fd)));
  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                  UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  am.id = kRecordAmId;
  am.cb = &UcxTransport::onRecord;
  am.arg = transport.get();
  am.flags = UCP_AM_FLAG_WHOLE_MSG;
  if (const auto st = ucp_worker_set_am_recv_handler(transport->worker_.get(), &am); st != UCS_OK) {
    return ucx::ucsError("ucp_worker_set_am_recv_handler", st);
  }
  am.id = kDataAmId;
  am.cb = &UcxTransport::onData;
  am.flags = UCP_AM_FLAG_WHOLE_MSG;  // then messages may be delivered out of order: records wait for their bytes
  if (const auto st = ucp_worker_set_am_recv_handler(transport->worker_.get(), &am); st != UCS_OK) {
    return ucx::ucsError("ucp_worker_set_am_recv_handler", st);
  }
  auto* raw = transport.get();
  raw->thread_ = std::jthread([raw] { raw->run(); });
  raw->thread_id_.store(raw->thread_.get_id());
  log::info("kv", "{}: UCX transport up (UCX_TLS={}, data path {}, compat {:016x})", options.name, options.ucx_tls,
            kvDataPathName(raw->data_path_), raw->compat_hash_);
  return std::unique_ptr<Transport>(std::move(transport));
}

UcxTransport::UcxTransport(const UcxTransportOptions& options, ucx::Context context, ucx::Worker worker,
                           std::vector<std::uint8_t> address, ucx::UcxBlobCheck blob_check, Fd epoll_fd, Fd event_fd)
    : options_(options),
      data_path_(resolveKvDataPath(options.data_path, options.ucx_tls)),
      compat_hash_(compatHash(options.compat)),
      metrics_(options.metrics),
      context_(std::move(context)),
      worker_(std::move(worker)),
      address_(std::move(address)),
      blob_check_(std::move(blob_check)),
      epoll_fd_(std::move(epoll_fd)),
      event_fd_(std::move(event_fd)) {}

UcxTransport::~UcxTransport() {
  stop_requested_.store(true);
  wake();
  if (thread_.joinable()) thread_.join();
  // The thread has released every endpoint, transfer and expectation; what remains (regions,
  // unfinished requests) is released below in reverse declaration order.
  if (!regions_.empty()) log::warn("kv", "{}: {} regions still registered at shutdown", options_.name, regions_.size());
}

Result<RegionId> UcxTransport::registerRegion(std::span<std::byte> memory) {
  return runOnProgressThread([&]() -> Result<RegionId> {
    if (stopping_) return cancelledStatus().error();
    if (memory.empty()) return makeError(ErrorCode::InvalidArgument, "cannot register an empty region");
    PD_ASSIGN_OR_RETURN(auto mem, ucx::MemHandle::map(context_, memory.data(), memory.size()));
    PD_ASSIGN_OR_RETURN(auto rkey, mem.packRemoteKey());
    const RegionId id = next_region_++;
    regions_.emplace(
        id, std::make_unique<Region>(Region{std::move(mem), memory.data(), memory.size(), std::move(rkey), 0}));
    metrics_.regionRegistered();
    return id;
  });
}

Status UcxTransport::deregisterRegion(RegionId region) {
  return runOnProgressThread([&]() -> Status {
    const auto it = regions_.find(region);
    if (it == regions_.end()) return makeError(ErrorCode::NotFound, fmt::format("no registered region {}", region));
    if (it->second->users > 0) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("region {} is read by {} transfers in flight", region, it->second->users));
    }
    regions_.erase(it);
    metrics_.regionDeregistered();
    return okStatus();
  });
}

Result<KvTarget> UcxTransport::exportTarget(std::uint32_t tp_rank, std::span<const RegionLayout> layouts) {
  return runOnProgressThread([&]() -> Result<KvTarget> {
    KvTarget target;
    target.tp_rank = tp_rank;
    target.worker_address = address_;
    for (const auto& layout : layouts) {
      const auto it = regions_.find(layout.region);
      if (it == regions_.end())
        return makeError(ErrorCode::NotFound, fmt::format("no registered region {}", layout.region));
      const Region& r = *it->second;
      if (layout.offset >= r.length) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("offset {} is past region {}'s {} bytes", layout.offset, layout.region, r.length));
      }
      target.regions.push_back(KvRegion{reinterpret_cast<std::uint64_t>(r.base) + layout.offset,
                                        r.length - layout.offset, layout.first_layer, layout.num_layers,
                                        layout.layer_stride, layout.block_stride, r.packed_rkey});
    }
    return target;
  });
}

}  // namespace detail

using detail::hostTransportsOnly;
using detail::kTcpSegment;

Result<KvDataPath> parseKvDataPath(std::string_view text) {
  if (text == "auto") return KvDataPath::Auto;
  if (text == "rma") return KvDataPath::Rma;
  if (text == "am") return KvDataPath::ActiveMessage;
  return makeError(ErrorCode::InvalidArgument,
                   fmt::format("kvtransfer data_path '{}': expected auto, rma or am", text));
}

std::vector<std::pair<std::string, std::string>> ucxSettings(const UcxTransportOptions& options) {
  // Workarounds for UCX 1.13 error paths that abort the process instead of failing the endpoint:
  //  - count an endpoint as connected only once the peer's wireup reply went out; otherwise the
  //    reply of a one-way connection stays pending and the peer's death trips a spurious
  //    assertion (ucp_request_send_state_ff, removed upstream in openucx/ucx#8175);
  //  - on host transports, send with copies instead of tcp zero-copy, whose completion is
  //    counted twice when the peer fails (uct_iface.h "comp->count > 0" assertion), in tcp
  //    segments large enough for one KV data message each.
  std::vector<std::pair<std::string, std::string>> settings = {{"RESOLVE_REMOTE_EP_ID", "on"}};
  if (hostTransportsOnly(options.ucx_tls)) {
    settings.emplace_back("ZCOPY_THRESH", "inf");
    settings.emplace_back("TCP_TX_SEG_SIZE", kTcpSegment);
    settings.emplace_back("TCP_RX_SEG_SIZE", kTcpSegment);
  }
  return settings;
}

std::string_view kvDataPathName(KvDataPath path) {
  switch (path) {
    case KvDataPath::Auto:
      return "auto";
    case KvDataPath::Rma:
      return "rma";
    case KvDataPath::ActiveMessage:
      return "am";
  }
  return "auto";
}

KvDataPath resolveKvDataPath(KvDataPath requested, std::string_view ucx_tls) {
  if (requested != KvDataPath::Auto) return requested;
  return hostTransportsOnly(ucx_tls) ? KvDataPath::ActiveMessage : KvDataPath::Rma;
}

void inheritLoopbackHost(UcxTransportOptions& options, std::string_view worker_host) {
  if (!options.host.empty()) return;
  const bool loopback = worker_host == "localhost" || worker_host == "::1" || worker_host.substr(0, 4) == "127.";
  if (loopback) options.host = worker_host == "localhost" ? "127.0.0.1" : std::string(worker_host);
}

UcxTransportOptions ucxOptionsFromConfig(const KvTransferConfig& config, const CompatInfo& compat) {
  UcxTransportOptions options;
  options.ucx_tls = config.ucx_tls;
  options.compat = compat;
  options.connect_timeout = std::chrono::milliseconds(config.connect_timeout_ms);
  options.peer_suspect_time = std::chrono::milliseconds(config.peer_suspect_ms);
  options.spin_time = std::chrono::microseconds(config.progress_spin_us);
  const auto path = parseKvDataPath(config.data_path);
  PD_CHECK_MSG(path.ok(), "kvtransfer.data_path was validated by its option's choices");
  options.data_path = path.value();
  options.host = config.host;
  return options;
}

Result<std::unique_ptr<Transport>> createUcxTransport(const UcxTransportOptions& options) {
  return detail::UcxTransport::create(options);
}

}  // namespace pd::kvtransfer
