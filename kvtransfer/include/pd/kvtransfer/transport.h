#pragma once
/// The KV data-plane seam (docs/kv-transfer.md). A decode worker registers its KV pool,
/// exports a KvTarget for its descriptors and expects one record per request; a prefill worker
/// begins a transfer from a descriptor, puts each layer's latent KV as it is computed, and
/// finishes with a completion record that the transport sends only after every put is remotely
/// complete. Implementations: UCX (ucx_transport.h), the staging decorator for pools in memory the
/// network cannot register (staging_transport.h) and a loopback fake (tests/fakes/).
///
/// Guarantees every implementation keeps:
///  - every beginTransfer that returns ok is answered by exactly one TransferDoneFn call, and
///    every expect that returns ok by exactly one ArrivalFn call — success, failure, cancel, or
///    the deadline, whichever comes first; nothing waits forever;
///  - after a TransferDoneFn call, the transport no longer reads the request's source memory;
///  - a deadline fires on a timer, whether or not any traffic arrives.
///
/// Thread rules: every method is thread-safe and may be called from a callback. Callbacks run on
/// the transport's progress thread (one per implementation instance): they must not block —
/// enqueue work for the engine thread and return. No callback runs after the Transport is
/// destroyed; destroying it answers what is still pending with Cancelled.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "pd/common/result.h"
#include "pd/kvtransfer/layout.h"
#include "pd/kvtransfer/metrics.h"
#include "pd/kvtransfer/wire.h"

namespace pd::kvtransfer {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;
using RegionId = std::uint32_t;

struct TransportCapabilities {
  std::string name;                   ///< "ucx(tcp,sm)", "loopback"
  bool detects_peer_failure = false;  ///< a dead peer is reported before the deadline
  bool crosses_processes = false;
  /// registerRegion() accepts GPU memory (UCX: its context lists the CUDA memory type), so a
  /// device KV pool can be written directly; otherwise it needs the staging path
  /// (staging_transport.h).
  bool registers_device_memory = false;
};

/// Where the layers of one registered region sit, for exportTarget().
struct RegionLayout {
  RegionId region = 0;
  std::uint64_t offset = 0;  ///< of layer first_layer, block 0, from the region's start
  std::uint32_t first_layer = 0;
  std::uint32_t num_layers = 0;
  std::uint64_t layer_stride = 0;
  std::uint64_t block_stride = 0;
};

/// Tokens of one layer to write: `slice` of the request, read from `local_region` starting at
/// `local_offset`, tokens contiguous at CompatInfo::tokenBytes() each.
struct LayerPut {
  LayerSlice slice;
  RegionId local_region = 0;
  std::uint64_t local_offset = 0;
};

/// The outcome of a send: ok once the completion record is delivered; Timeout, PeerFailed,
/// Cancelled (abort or shutdown) otherwise. The sending side knows a transfer only by its wire
/// id (KvDescriptor::transfer_id).
using TransferDoneFn = std::function<void(const TransferId& transfer_id, Status status)>;
/// The outcome of a receive: the completion record, or the sender's failure record as an Error
/// with its code, or Timeout / Unsupported (compatibility) / Cancelled. The receiving side knows
/// a request by the caller's own `request_id`, a handle local to the process (it never crosses
/// the network); grant() binds it to the wire id.
using ArrivalFn = std::function<void(std::uint64_t request_id, Result<CompletionRecord> record)>;

class Transport {
 public:
  Transport() = default;
  virtual ~Transport() = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;
  Transport(Transport&&) = delete;
  Transport& operator=(Transport&&) = delete;

  [[nodiscard]] virtual TransportCapabilities capabilities() const = 0;
  /// What descriptors and records must match; fixed at construction.
  [[nodiscard]] virtual const CompatInfo& compat() const = 0;

  // ---- memory -------------------------------------------------------------------------------
  /// Registers `memory` for puts (as source or destination). The memory must outlive the
  /// registration. Blocks until registered.
  [[nodiscard]] virtual Result<RegionId> registerRegion(std::span<std::byte> memory) = 0;
  /// InvalidArgument while a transfer in flight reads from the region; NotFound for an unknown id.
  [[nodiscard]] virtual Status deregisterRegion(RegionId region) = 0;
  /// This transport as a descriptor target: its address and a remote key for each layout.
  [[nodiscard]] virtual Result<KvTarget> exportTarget(std::uint32_t tp_rank, std::span<const RegionLayout> layouts) = 0;

  // ---- sending side (prefill) ---------------------------------------------------------------
  /// Validates `descriptor` (layout.h) and its compatibility with compat() (Unsupported names
  /// the differing field), refuses peers that are suspect (PeerFailed), connects to every target
  /// (endpoints are cached per peer), and starts the transfer's deadline: the earlier of
  /// `deadline` and now + descriptor.timeout_ms. `on_done` is called exactly once. The transfer
  /// is known by descriptor.transfer_id from then on: InvalidArgument when it is zero (not
  /// granted) or already in flight here.
  [[nodiscard]] virtual Status beginTransfer(const KvDescriptor& descriptor, Deadline deadline,
                                             TransferDoneFn on_done) = 0;
  /// Posts puts of layer slices to every target. Non-blocking: the source memory must stay
  /// untouched until on_done. NotFound for an unknown or finished transfer; InvalidArgument for a
  /// slice outside the descriptor or the local region.
  [[nodiscard]] virtual Status put(const TransferId& transfer_id, std::span<const LayerPut> puts) = 0;
  /// Sends `record` (of the transfer record.transfer_id) to every target once all puts are
  /// remotely complete; on_done follows. The transport fills record.compat_hash.
  [[nodiscard]] virtual Status finish(CompletionRecord record) = 0;
  /// Gives up on a transfer: sends a failure record (best effort) and answers on_done with
  /// Cancelled once no put of it is outstanding. NotFound when the transfer is not in flight.
  [[nodiscard]] virtual Status abort(const TransferId& transfer_id, ErrorCode code, std::string reason) = 0;

  // ---- receiving side (decode) --------------------------------------------------------------
  /// Waits for the record of `request_id` (the caller's local handle) until `deadline`; grant()
  /// then binds it to the descriptor's wire id. InvalidArgument when the request is already
  /// expected.
  [[nodiscard]] virtual Status expect(std::uint64_t request_id, Deadline deadline, ArrivalFn on_arrival) = 0;
  /// Stops waiting; on_arrival is answered with Cancelled. False when nothing was pending.
  virtual bool cancelExpect(std::uint64_t request_id) = 0;
  /// Binds the expected `request_id` to a wire id and confines it to what `descriptor` grants
  /// (docs/kv-transfer.md, "Transfer ids" and "Write confinement"). Returns the descriptor with
  /// a fresh TransferId::random() (or the id it already carries: with TP, the first rank's
  /// transport draws it, the others' keep it): hand out the returned descriptor. Data messages
  /// and records are looked up by that id only; those for an id no live grant holds are dropped
  /// and counted (TransportStats::records_rejected, bytes_dropped), so an expectation that is not
  /// granted receives nothing. KV data outside the bytes of the listed blocks (those covering
  /// num_tokens, in this transport's target of the descriptor) and a completion record for
  /// another token count fail the receive (Corrupt). One-sided RMA puts cannot be checked by the
  /// receiver. Call after expect(), before the descriptor goes out; the binding holds for the
  /// request's re-armed expectations and ends with its last one. NotFound when the request is not
  /// expected; InvalidArgument when it is already granted under another id, when the id is
  /// already bound to another request, when the descriptor is invalid, or (UCX) when it lists no
  /// target at this transport's address.
  [[nodiscard]] virtual Result<KvDescriptor> grant(std::uint64_t request_id, KvDescriptor descriptor) = 0;

  [[nodiscard]] virtual TransportStats stats() const = 0;
};

}  // namespace pd::kvtransfer
