#include "pd/kvtransfer/kvtransfer_config.h"

#include <fmt/format.h>

#include "pd/common/log.h"
#include "pd/kvtransfer/ucx_transport.h"

namespace pd::kvtransfer {

void registerOptions(config::OptionSet& set, KvTransferConfig& cfg) {
  set.add("ucx_tls", &cfg.ucx_tls, "UCX_TLS for the KV data plane (must include tcp for peer-failure detection)")
      .add("transfer_timeout_ms", &cfg.transfer_timeout_ms, "deadline of one request's KV transfer", 10, 86400000)
      .add("connect_timeout_ms", &cfg.connect_timeout_ms, "deadline to connect to a peer", 10, 600000)
      .add("receive_grace_ms", &cfg.receive_grace_ms,
           "extra wait on the receiving side past the transfer deadline before blocks are released", 0, 600000)
      .add("peer_suspect_ms", &cfg.peer_suspect_ms, "how long a peer that missed a deadline is refused", 0, 86400000)
      .add("progress_spin_us", &cfg.progress_spin_us, "progress-thread polling after activity before sleeping", 0,
           1000000)
      .add("data_path", &cfg.data_path,
           "how KV bytes move: rma (one-sided puts), am (checked active messages), auto (am on tcp/shared memory)",
           {"auto", "rma", "am"})
      .add("host", &cfg.host,
           "address of the interface UCX's tcp transport listens on (127.0.0.1: loopback only); empty: every "
           "interface")
      .add("path", &cfg.path,
           "how KV reaches a pool: direct (the network writes it), staging (through host buffers copied to and "
           "from the pool), auto (direct unless the pool is in GPU memory UCX cannot register)",
           {"auto", "direct", "staging"})
      .add("staging_send_mb", &cfg.staging_send_mb,
           "staging path: MiB of host staging for outgoing KV (one prompt's KV must fit)", 1, 1 << 20)
      .add("staging_receive_blocks", &cfg.staging_receive_blocks,
           "staging path: host staging blocks for incoming KV (block_size tokens of every layer each)", 1, 1 << 24);
}

Status validate(const KvTransferConfig& cfg) {
  PD_TRY(parseKvDataPath(cfg.data_path));
  PD_TRY(parseKvTransferPath(cfg.path));
  if (cfg.ucx_tls.find("tcp") == std::string::npos) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("kvtransfer.ucx_tls '{}' must include tcp (peer failure detection)", cfg.ucx_tls));
  }
  return okStatus();
}

Result<KvTransport> createKvTransport(const KvTransferConfig& cfg, const UcxTransportOptions& ucx, KvTransportUse use,
                                      bool pool_in_device_memory, int device) {
  PD_ASSIGN_OR_RETURN(const KvTransferPathSetting setting, parseKvTransferPath(cfg.path));
  PD_ASSIGN_OR_RETURN(std::unique_ptr<Transport> inner, createUcxTransport(ucx));
  const TransportCapabilities caps = inner->capabilities();
  const KvTransferPath path = resolveKvTransferPath(setting, pool_in_device_memory, caps.registers_device_memory);
  const char* const memory = pool_in_device_memory ? "GPU" : "host";
  if (path == KvTransferPath::Direct && pool_in_device_memory && !caps.registers_device_memory) {
    // UCX would take the GPU addresses for host memory.
    return makeError(ErrorCode::Unsupported,
                     fmt::format("kvtransfer.path direct: the KV pool is in GPU memory and this UCX ({}) cannot "
                                 "register GPU memory; use kvtransfer.path staging or auto",
                                 caps.name));
  }
  if (path == KvTransferPath::Direct) {
    log::info("kvtransfer", "{}: KV transfer path direct (kvtransfer.path {}, pool in {} memory, {})", ucx.name,
              cfg.path, memory, caps.name);
    return KvTransport{std::move(inner), path};
  }
  std::unique_ptr<DeviceCopier> copier;
  if (pool_in_device_memory) {
    PD_ASSIGN_OR_RETURN(copier, createCudaCopier(device));
  } else {
    copier = createHostCopier();
  }
  StagingTransportOptions staging;
  if (use == KvTransportUse::Send) {
    staging.send_bytes = static_cast<std::uint64_t>(cfg.staging_send_mb) << 20;
  } else {
    staging.receive_blocks = static_cast<std::uint32_t>(cfg.staging_receive_blocks);
    // With rma a late sender's puts land unchecked: keep a failed receive's staging blocks until it
    // must have stopped. With am the inner transport drops bytes of a receive that ended.
    if (resolveKvDataPath(ucx.data_path, ucx.ucx_tls) == KvDataPath::Rma) {
      staging.quarantine = std::chrono::milliseconds(cfg.transfer_timeout_ms + cfg.receive_grace_ms);
    }
  }
  PD_ASSIGN_OR_RETURN(std::unique_ptr<StagingTransport> t,
                      createStagingTransport(std::move(inner), std::move(copier), std::move(staging)));
  log::info("kvtransfer", "{}: KV transfer path staging (kvtransfer.path {}, pool in {} memory, UCX {} GPU memory): {}",
            ucx.name, cfg.path, memory, caps.registers_device_memory ? "registers" : "cannot register",
            t->capabilities().name);
  return KvTransport{std::move(t), path};
}

}  // namespace pd::kvtransfer
