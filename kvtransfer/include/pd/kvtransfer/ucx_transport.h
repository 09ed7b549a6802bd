#pragma once
/// The UCX implementation of Transport: one UCX context and worker, progressed by one thread
/// the transport owns, which also runs every deadline timer. KV bytes go straight into the
/// peer's registered KV regions, either as one-sided RMA (ucp_put_nbx) or, where UCX would only
/// emulate RMA in software anyway (tcp, shared memory), as active messages that the receiver
/// bounds-checks and copies (KvDataPath); records are active messages. Endpoints use peer error
/// handling, so UCX_TLS must include tcp (shared-memory-only transports refuse it); a killed peer
/// is reported in milliseconds, a silent one by the deadline.
///
/// Thread rules: see transport.h. createUcxTransport may be called from any thread.

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pd/common/result.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/kvtransfer/transport.h"

namespace pd {
class InternalAuth;
}  // namespace pd

namespace pd::kvtransfer {

/// How a sender moves KV bytes (docs/kv-transfer.md, "Data paths"). Receivers accept both.
enum class KvDataPath {
  /// ActiveMessage when every UCX_TLS entry is a host transport (tcp, shared memory, self),
  /// where UCX 1.13 emulates RMA with active messages plus per-put acknowledgements; Rma otherwise.
  Auto,
  /// ucp_put_nbx into the peer's memory: zero-copy and receiver-CPU-free on RDMA transports.
  Rma,
  /// ucp_am_send_nbx of each block run; the receiver checks that the request is still expected
  /// and the bytes lie in a registered region, then copies. Late data of an expired request is
  /// dropped, and a sender that dies mid-transfer cannot take the receiver down with it (over
  /// tcp, UCX 1.13 aborts a receiver whose put acknowledgement fails).
  ActiveMessage,
};

/// "auto", "rma", "am".
[[nodiscard]] Result<KvDataPath> parseKvDataPath(std::string_view text);
[[nodiscard]] std::string_view kvDataPathName(KvDataPath path);
/// What Auto means for `ucx_tls`; Rma and ActiveMessage stay as they are.
[[nodiscard]] KvDataPath resolveKvDataPath(KvDataPath requested, std::string_view ucx_tls);

struct UcxTransportOptions {
  /// UCX_TLS for this transport's context; must name tcp.
  std::string ucx_tls = "tcp,sm";
  CompatInfo compat;
  /// A new endpoint that has not completed a round trip in this time fails its transfers.
  std::chrono::milliseconds connect_timeout{5000};
  /// How long a peer that missed a deadline is refused by beginTransfer.
  std::chrono::milliseconds peer_suspect_time{10000};
  /// After activity, how long the progress thread polls before sleeping on the worker's fd.
  std::chrono::microseconds spin_time{200};
  /// Name in logs and in the progress thread's name.
  std::string name = "kv";
  /// Where to publish metrics (may be null); must outlive the transport.
  metrics::Registry* metrics = nullptr;
  KvDataPath data_path = KvDataPath::Auto;
  /// The address of the network interface UCX's tcp transport may listen and connect on. A
  /// loopback address (127.0.0.1, ::1) limits UCX to the loopback device; another address of this
  /// host limits it to that address's device when every UCX_TLS entry is a host transport (on
  /// RDMA hosts the device list would also drop the RDMA ports, so it stays open and a warning
  /// says so). Empty, 0.0.0.0 or :: : every interface. InvalidArgument when no interface has it.
  std::string host;
  /// The cluster secret (internal_auth.h; may be null). When set, every completion and failure
  /// record this transport sends carries HMAC-SHA-256 under the secret over the delivered byte
  /// count and the record's bytes (its 128-bit transfer id and contents); and every record it
  /// receives must carry a valid one: a record under a live transfer id but with a missing or
  /// wrong tag fails that receive (Unauthenticated) and is counted
  /// (TransportStats::records_unauthenticated). Null: records are sent untagged and received
  /// without a tag check. Either way the receiver takes KV data and records only under the ids of
  /// its live grants (Transport::grant); anything else is dropped and counted.
  std::shared_ptr<const InternalAuth> auth;
};

/// The UCX settings (names without the UCX_ prefix) a transport with `options` applies on top of
/// the environment: workarounds for UCX 1.13 error paths and tcp segment sizes
/// (docs/kv-transfer.md, "UCX 1.13"). Benchmarks give ucx_perftest the same.
[[nodiscard]] std::vector<std::pair<std::string, std::string>> ucxSettings(const UcxTransportOptions& options);

/// Options from the `kvtransfer:` config section (validated there: data_path is one of its choices).
[[nodiscard]] UcxTransportOptions ucxOptionsFromConfig(const KvTransferConfig& config, const CompatInfo& compat);

/// With kvtransfer.host unset, a worker whose HTTP server is bound to a loopback address
/// (127.0.0.0/8, ::1, localhost) keeps UCX on loopback too instead of every interface.
void inheritLoopbackHost(UcxTransportOptions& options, std::string_view worker_host);

/// Creates the context and worker and starts the progress thread. InvalidArgument when ucx_tls
/// lacks tcp; Unsupported / Internal when UCX refuses.
[[nodiscard]] Result<std::unique_ptr<Transport>> createUcxTransport(const UcxTransportOptions& options);

}  // namespace pd::kvtransfer
