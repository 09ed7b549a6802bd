#pragma once
/// KV transfer settings (section `kvtransfer:`). Thread rules: filled once in main, then read-only.
/// docs/kv-transfer.md explains every timeout.

#include <cstdint>
#include <memory>
#include <string>

#include "pd/common/config.h"
#include "pd/common/result.h"
#include "pd/kvtransfer/staging_transport.h"
#include "pd/kvtransfer/transport.h"

namespace pd::kvtransfer {

struct KvTransferConfig {
  /// UCX transports. Must include tcp: shared-memory-only transports refuse peer error handling.
  std::string ucx_tls = "tcp,sm";
  /// Budget of one request's KV transfer; travels in the descriptor (KvDescriptor::timeout_ms).
  std::int64_t transfer_timeout_ms = 30000;
  /// A new endpoint must complete its first round trip within this.
  std::int64_t connect_timeout_ms = 5000;
  /// The receiving side waits this much longer than the transfer budget before releasing blocks,
  /// so that a sender that started late has stopped writing by then.
  std::int64_t receive_grace_ms = 2000;
  /// A peer that missed a deadline is refused for this long.
  std::int64_t peer_suspect_ms = 10000;
  /// After activity the progress thread polls this long before sleeping.
  std::int64_t progress_spin_us = 200;
  /// How senders move KV bytes: auto | rma | am (ucx_transport.h, KvDataPath).
  std::string data_path = "auto";
  /// The interface UCX's tcp transport listens on, as an address of this host (127.0.0.1: the
  /// loopback device only); empty: every interface (UcxTransportOptions::host).
  std::string host;
  /// How KV reaches a pool: auto | direct | staging (staging_transport.h, KvTransferPathSetting).
  std::string path = "auto";
  /// Staging path, sending side: bytes of the staging buffer in MiB (bounds the KV of the
  /// transfers staged at once; one prompt's KV must fit).
  std::int64_t staging_send_mb = 256;
  /// Staging path, receiving side: staging blocks (block_size tokens of every layer each).
  std::int64_t staging_receive_blocks = 64;
};

struct UcxTransportOptions;  // ucx_transport.h, which includes this header

/// Which side of the data plane a worker's transport serves.
enum class KvTransportUse { Send, Receive };

/// A worker's KV transport and the path it runs.
struct KvTransport {
  std::unique_ptr<Transport> transport;
  KvTransferPath path = KvTransferPath::Direct;
};

/// The worker's transport: UCX from `ucx`, wrapped in the staging path (host copier for a pool in
/// host memory, CUDA copier for one in device memory) when cfg.path resolves to staging for a pool
/// there (resolveKvTransferPath with the UCX context's device-memory support). Logs the path.
/// Errors of UCX or of the staging transport.
/// `device`: the pool's GPU when pool_in_device_memory (-1: the calling thread's current one).
[[nodiscard]] Result<KvTransport> createKvTransport(const KvTransferConfig& cfg, const UcxTransportOptions& ucx,
                                                    KvTransportUse use, bool pool_in_device_memory, int device = -1);

void registerOptions(config::OptionSet& set, KvTransferConfig& cfg);

/// What the option table alone cannot check: a known data_path and path, and tcp among ucx_tls
/// (peer failure detection). InvalidArgument naming the option.
[[nodiscard]] Status validate(const KvTransferConfig& cfg);

}  // namespace pd::kvtransfer
