#include "pd/kvtransfer/kvtransfer_config.h"

#include <fmt/format.h>

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
           "interface");
}

Status validate(const KvTransferConfig& cfg) {
  PD_TRY(parseKvDataPath(cfg.data_path));
  if (cfg.ucx_tls.find("tcp") == std::string::npos) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("kvtransfer.ucx_tls '{}' must include tcp (peer failure detection)", cfg.ucx_tls));
  }
  return okStatus();
}

}  // namespace pd::kvtransfer
