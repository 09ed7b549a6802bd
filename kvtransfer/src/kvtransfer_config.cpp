#include "pd/kvtransfer/kvtransfer_config.h"

namespace pd::kvtransfer {

void registerOptions(config::OptionSet& set, KvTransferConfig& cfg) {
  set.add("ucx_tls", &cfg.ucx_tls, "UCX_TLS for the KV data plane (must include tcp for peer-failure detection)")
      .add("transfer_timeout_ms", &cfg.transfer_timeout_ms, "deadline of one request's KV transfer", 10, 86400000)
      .add("connect_timeout_ms", &cfg.connect_timeout_ms, "deadline to connect to a peer", 10, 600000);
}

}  // namespace pd::kvtransfer
