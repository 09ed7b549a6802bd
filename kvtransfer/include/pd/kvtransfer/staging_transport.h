#pragma once
/// The staging KV path (docs/kv-transfer.md, "Staging path"): a Transport decorator for KV pools
/// in memory the network transport cannot register (GPU memory under a UCX without CUDA support).
/// It moves every byte through host staging buffers registered with the inner transport and
/// copied to and from the pool by a DeviceCopier; the caller sees the same Transport contract.
///
///  - Sending: registerRegion() records "device" memory without registering it with the inner
///    transport. A transfer is admitted to the staging buffer with a range as large as its whole
///    KV (num_layers * num_tokens * token bytes; a transport may read a put's source until it
///    answers the transfer, so staging space cannot be recycled per put); transfers that do not fit
///    yet wait in arrival order with their puts queued (only the puts' coordinates: the bytes stay
///    in the device memory), so memory is bounded and two half-staged transfers can never wait on
///    each other. Each put is copied device -> staging and then put by the inner transport from
///    there; finish() goes to the inner transport once every copy and put of the transfer went
///    out; on_done follows the inner answer once no copy of the transfer runs.
///  - Receiving: exportTarget() exports the staging block pool in place of the device pool's
///    layout; grant() takes staging blocks for the request's tokens, maps them to the descriptor's
///    pool block ids and hands out a descriptor whose target for this transport names the staging
///    blocks (KvTarget::block_ids; the descriptor's block_ids stay the pool's). On the completion record the staged
///    tokens are copied into the pool blocks before on_arrival is called. A receive that fails without being re-armed
///    (from its callback, for a prefill retry) quarantines its staging blocks for
///    StagingTransportOptions::quarantine: a sender that has not stopped may still write them.
///
/// Guarantees kept from transport.h: one TransferDoneFn per begun transfer and one ArrivalFn per
/// expectation; no read of a source after on_done; no write into the pool after on_arrival (a
/// cancelExpect() during the copy answers Cancelled once the copy is over); deadlines are the inner
/// transport's. Decode tensor parallelism: each rank's staging transport grants its own staging
/// blocks and names them in its own target (KvTarget::block_ids) while the descriptor's block_ids
/// stay the pool's, the same on every rank; the TP relay collects every rank's list into the
/// descriptor that goes out (model::TpLeaderEngine::grantKv).
///
/// Thread rules: every method is thread-safe and may be called from a callback. Callbacks run on
/// the inner transport's progress thread or on the copier's completion thread and must not block.
/// Destroying it lets running copies end, cancels queued ones, then destroys the inner transport
/// (which answers what is pending with Cancelled); no callback runs after the destructor returns.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>

#include "pd/common/result.h"
#include "pd/kvtransfer/device_copier.h"
#include "pd/kvtransfer/transport.h"

namespace pd::kvtransfer {

struct StagingTransportOptions {
  /// Bytes of the sending side's staging buffer; a transfer larger than this is refused
  /// (ResourceExhausted). 0: this transport does not send.
  std::uint64_t send_bytes = 0;
  /// Staging blocks of the receiving side (each block_size tokens of every layer). 0: this
  /// transport does not receive.
  std::uint32_t receive_blocks = 0;
  /// How long the staging blocks of a failed receive stay out of use. Zero when the inner transport
  /// drops late bytes itself (data path am); the transfer budget plus the receive grace with rma.
  std::chrono::milliseconds quarantine{0};
  /// The clock of quarantines (tests pass a fake one); steady_clock when empty.
  std::function<Clock::time_point()> now;
};

/// What the staging buffers hold now.
struct StagingStats {
  std::uint64_t send_capacity_bytes = 0;
  std::uint64_t send_reserved_bytes = 0;  ///< held by admitted transfers
  std::uint64_t transfers_waiting = 0;    ///< begun, waiting for staging space
  std::uint64_t bytes_staged_out = 0;     ///< copied device -> staging (sending side)
  std::uint32_t receive_blocks = 0;
  std::uint32_t receive_blocks_free = 0;
  std::uint32_t receive_blocks_quarantined = 0;
  std::uint64_t bytes_staged_in = 0;  ///< copied staging -> device (receiving side)
};

class StagingTransport : public Transport {
 public:
  [[nodiscard]] virtual StagingStats stagingStats() const = 0;
};

/// Wraps `inner` (UCX in real use). Registers its staging memory (from `copier`'s allocateHost)
/// with `inner`. InvalidArgument for a compat the staging layout cannot hold (no layers); the inner transport's errors
/// otherwise.
[[nodiscard]] Result<std::unique_ptr<StagingTransport>> createStagingTransport(std::unique_ptr<Transport> inner,
                                                                               std::unique_ptr<DeviceCopier> copier,
                                                                               StagingTransportOptions options);

/// `kvtransfer.path`: how KV reaches the pool.
enum class KvTransferPathSetting { Auto, Direct, Staging };
/// What a worker runs.
enum class KvTransferPath { Direct, Staging };

/// "auto" | "direct" | "staging"; InvalidArgument otherwise.
[[nodiscard]] Result<KvTransferPathSetting> parseKvTransferPath(std::string_view text);
/// "direct", "staging".
[[nodiscard]] std::string_view kvTransferPathName(KvTransferPath path);
/// Direct and Staging are what they say. Auto: direct for a pool in host memory, and for a pool
/// in device memory when the network transport registers device memory
/// (TransportCapabilities::registers_device_memory); staging otherwise.
[[nodiscard]] KvTransferPath resolveKvTransferPath(KvTransferPathSetting setting, bool pool_in_device_memory,
                                                   bool transport_registers_device_memory);

}  // namespace pd::kvtransfer
