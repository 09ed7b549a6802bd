#pragma once
/// A Transport fake for unit tests of the layers above kvtransfer (prefill, decode): transports
/// attached to one LoopbackFabric reach each other by address inside one process. Puts are
/// memcpy into the target's registered memory (checked against its regions, like a remote key
/// would be); records are encoded and decoded through the real wire format.
///
/// Differences from the UCX transport, on purpose:
///  - no threads: callbacks run on the thread that caused them (finish, abort, cancelExpect,
///    expireDeadlines, setPeerDown), after the fabric's lock is released;
///  - no timer: deadlines fire when the test calls expireDeadlines(now), so tests control time;
///  - faults on demand: setPeerDown (a killed peer, reported at once) and setSilent (a stopped
///    peer: puts and records vanish, only deadlines end the transfer);
///  - grant() binds the wire id and confines nothing else (the peer is in-process); the binding
///    outlives a failure record (the request may re-arm for a retry) and ends with a success,
///    a cancel, a deadline or the transport. Records for an unbound id are dropped and counted.
///
/// Thread rules: thread-safe (one mutex per fabric).

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "pd/kvtransfer/layout.h"
#include "pd/kvtransfer/transport.h"
#include "pd/kvtransfer/wire.h"

namespace pd::kvtransfer::fakes {

class LoopbackTransport;

/// The shared "network". Keep it alive as long as any transport attached to it.
class LoopbackFabric {
 public:
  /// A peer that is down fails transfers to it at once with PeerFailed.
  void setPeerDown(const std::vector<std::uint8_t>& address, bool down);
  /// A silent peer swallows puts and records; transfers to it end only by deadline.
  void setSilent(const std::vector<std::uint8_t>& address, bool silent) {
    std::lock_guard lock(mutex_);
    if (silent) {
      silent_.insert(address);
    } else {
      silent_.erase(address);
    }
  }

 private:
  friend class LoopbackTransport;
  std::mutex mutex_;
  std::uint64_t next_serial_ = 1;
  std::map<std::vector<std::uint8_t>, LoopbackTransport*> transports_;
  std::set<std::vector<std::uint8_t>> down_;
  std::set<std::vector<std::uint8_t>> silent_;
};

class LoopbackTransport final : public Transport {
 public:
  LoopbackTransport(std::shared_ptr<LoopbackFabric> fabric, CompatInfo compat)
      : fabric_(std::move(fabric)), compat_(compat), compat_hash_(compatHash(compat)) {
    std::lock_guard lock(fabric_->mutex_);
    serial_ = fabric_->next_serial_++;
    const std::string name = fmt::format("loopback/{}", serial_);
    address_.assign(name.begin(), name.end());
    fabric_->transports_[address_] = this;
  }

  ~LoopbackTransport() override {
    std::vector<std::function<void()>> calls;
    {
      std::lock_guard lock(fabric_->mutex_);
      fabric_->transports_.erase(address_);
      for (auto& [id, t] : transfers_) calls.push_back(doneCall(id, std::move(t), cancelled()));
      for (auto& [id, e] : expectations_) calls.push_back(arrivalCall(id, std::move(e), cancelled()));
      transfers_.clear();
      expectations_.clear();
      bound_.clear();
      bindings_.clear();
    }
    for (auto& call : calls) call();
  }

  LoopbackTransport(const LoopbackTransport&) = delete;
  LoopbackTransport& operator=(const LoopbackTransport&) = delete;
  LoopbackTransport(LoopbackTransport&&) = delete;
  LoopbackTransport& operator=(LoopbackTransport&&) = delete;

  [[nodiscard]] const std::vector<std::uint8_t>& address() const { return address_; }

  [[nodiscard]] TransportCapabilities capabilities() const override { return {"loopback", true, false}; }
  [[nodiscard]] const CompatInfo& compat() const override { return compat_; }

  Result<RegionId> registerRegion(std::span<std::byte> memory) override {
    if (memory.empty()) return makeError(ErrorCode::InvalidArgument, "cannot register an empty region");
    std::lock_guard lock(fabric_->mutex_);
    const RegionId id = next_region_++;
    regions_[id] = Region{memory, 0};
    metrics_.regionRegistered();
    return id;
  }

  Status deregisterRegion(RegionId region) override {
    std::lock_guard lock(fabric_->mutex_);
    const auto it = regions_.find(region);
    if (it == regions_.end()) return makeError(ErrorCode::NotFound, fmt::format("no registered region {}", region));
    if (it->second.users > 0) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("region {} is read by transfers in flight", region));
    }
    regions_.erase(it);
    metrics_.regionDeregistered();
    return okStatus();
  }

  Result<KvTarget> exportTarget(std::uint32_t tp_rank, std::span<const RegionLayout> layouts) override {
    std::lock_guard lock(fabric_->mutex_);
    KvTarget target{tp_rank, address_, {}};
    for (const auto& l : layouts) {
      const auto it = regions_.find(l.region);
      if (it == regions_.end()) return makeError(ErrorCode::NotFound, fmt::format("no registered region {}", l.region));
      const auto memory = it->second.memory;
      if (l.offset >= memory.size()) return makeError(ErrorCode::InvalidArgument, "offset past the region");
      std::vector<std::uint8_t> rkey(sizeof(RegionId));
      std::memcpy(rkey.data(), &l.region, sizeof(RegionId));
      target.regions.push_back(KvRegion{reinterpret_cast<std::uint64_t>(memory.data()) + l.offset,
                                        memory.size() - l.offset, l.first_layer, l.num_layers, l.layer_stride,
                                        l.block_stride, std::move(rkey)});
    }
    return target;
  }

  Status beginTransfer(const KvDescriptor& descriptor, Deadline deadline, TransferDoneFn on_done) override {
    PD_TRY(checkCompatible(compat_, descriptor.compat));
    PD_TRY(validateDescriptor(descriptor));
    if (descriptor.transfer_id.empty()) return makeError(ErrorCode::InvalidArgument, "KV descriptor: no transfer id");
    std::lock_guard lock(fabric_->mutex_);
    if (transfers_.contains(descriptor.transfer_id)) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("transfer {} is already in flight", descriptor.transfer_id));
    }
    for (const auto& target : descriptor.targets) {
      if (!fabric_->transports_.contains(target.worker_address) || fabric_->down_.contains(target.worker_address)) {
        return makeError(ErrorCode::PeerFailed, "loopback peer is not reachable");
      }
    }
    Transfer t;
    t.descriptor = descriptor;
    t.started = Clock::now();
    t.deadline = std::min(deadline, t.started + std::chrono::milliseconds(descriptor.timeout_ms));
    t.on_done = std::move(on_done);
    transfers_.emplace(descriptor.transfer_id, std::move(t));
    metrics_.transferStarted();
    return okStatus();
  }

  Status put(const TransferId& request_id, std::span<const LayerPut> puts) override {
    std::vector<std::function<void()>> calls;
    Status status = okStatus();
    {
      std::lock_guard lock(fabric_->mutex_);
      const auto it = transfers_.find(request_id);
      if (it == transfers_.end())
        return makeError(ErrorCode::NotFound, fmt::format("request {} not in flight", request_id));
      Transfer& t = it->second;
      if (t.finished) return makeError(ErrorCode::InvalidArgument, "put after finish");
      status = putLocked(t, puts);
      if (!status.ok() && status.error().code == ErrorCode::PeerFailed) {
        calls.push_back(doneCall(request_id, std::move(t), status.error()));
        transfers_.erase(it);
      }
    }
    for (auto& call : calls) call();
    return status;
  }

  Status finish(CompletionRecord record) override {
    record.compat_hash = compat_hash_;
    return close(record.transfer_id, encode(record), okStatus());
  }

  Status abort(const TransferId& request_id, ErrorCode code, std::string reason) override {
    const FailureRecord failure{request_id, compat_hash_, code, reason};
    return close(request_id, encode(failure),
                 makeError(ErrorCode::Cancelled, fmt::format("request {} aborted: {}", request_id, reason)));
  }

  Status expect(std::uint64_t request_id, Deadline deadline, ArrivalFn on_arrival) override {
    std::lock_guard lock(fabric_->mutex_);
    if (expectations_.contains(request_id)) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("request {} is already expected", request_id));
    }
    expectations_.emplace(request_id, Expectation{deadline, Clock::now(), std::move(on_arrival)});
    metrics_.receiveExpected();
    return okStatus();
  }

  bool cancelExpect(std::uint64_t request_id) override {
    std::function<void()> call;
    {
      std::lock_guard lock(fabric_->mutex_);
      auto node = expectations_.extract(request_id);
      if (node.empty()) return false;
      unbindLocked(request_id);
      call = arrivalCall(request_id, std::move(node.mapped()), cancelled());
    }
    call();
    return true;
  }

  Result<KvDescriptor> grant(std::uint64_t request_id, KvDescriptor descriptor) override {
    std::lock_guard lock(fabric_->mutex_);
    if (!expectations_.contains(request_id)) {
      return makeError(ErrorCode::NotFound, fmt::format("request {} is not expected", request_id));
    }
    const TransferId id = descriptor.transfer_id.empty() ? TransferId::random() : descriptor.transfer_id;
    if (const auto b = bindings_.find(request_id); b != bindings_.end() && b->second != id) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("request {} is already granted", request_id));
    }
    if (const auto b = bound_.find(id); b != bound_.end() && b->second != request_id) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("transfer {} is bound to another request", id));
    }
    bound_[id] = request_id;
    bindings_[request_id] = id;
    descriptor.transfer_id = id;
    return descriptor;
  }
  [[nodiscard]] TransportStats stats() const override { return metrics_.snapshot(); }

  /// Fails every transfer and receive whose deadline is at or before `now` with Timeout.
  void expireDeadlines(Deadline now) {
    std::vector<std::function<void()>> calls;
    {
      std::lock_guard lock(fabric_->mutex_);
      for (auto it = transfers_.begin(); it != transfers_.end();) {
        if (it->second.deadline > now) {
          ++it;
          continue;
        }
        calls.push_back(doneCall(it->first, std::move(it->second), timeout(it->first)));
        it = transfers_.erase(it);
      }
      for (auto it = expectations_.begin(); it != expectations_.end();) {
        if (it->second.deadline > now) {
          ++it;
          continue;
        }
        unbindLocked(it->first);
        calls.push_back(arrivalCall(it->first, std::move(it->second), timeout(it->first)));
        it = expectations_.erase(it);
      }
    }
    for (auto& call : calls) call();
  }

 private:
  friend class LoopbackFabric;

  struct Region {
    std::span<std::byte> memory;
    int users = 0;
  };
  struct Transfer {
    KvDescriptor descriptor;
    Clock::time_point started;
    Deadline deadline;
    TransferDoneFn on_done;
    std::set<RegionId> regions;
    bool finished = false;  // waiting for a silent peer
  };
  struct Expectation {
    Deadline deadline;
    Clock::time_point started;
    ArrivalFn on_arrival;
  };

  static Error cancelled() { return makeError(ErrorCode::Cancelled, "loopback transport closed"); }
  template <class Id>
  static Error timeout(const Id& id) {
    return makeError(ErrorCode::Timeout, fmt::format("KV transfer of request {}: deadline expired", id));
  }
  void unbindLocked(std::uint64_t request_id) {
    if (const auto b = bindings_.find(request_id); b != bindings_.end()) {
      bound_.erase(b->second);
      bindings_.erase(b);
    }
  }

  // Called with the fabric lock held; returns the user callback to run after unlocking.
  std::function<void()> doneCall(const TransferId& id, Transfer t, Status status) {
    for (const RegionId r : t.regions) {
      if (const auto it = regions_.find(r); it != regions_.end()) --it->second.users;
    }
    if (status.ok()) {
      metrics_.transferSucceeded(Clock::now() - t.started);
    } else {
      metrics_.transferFailed(status.error().code);
    }
    return [fn = std::move(t.on_done), id, status = std::move(status)]() mutable { fn(id, std::move(status)); };
  }
  std::function<void()> arrivalCall(std::uint64_t id, Expectation e, Result<CompletionRecord> record) {
    if (record.ok()) {
      metrics_.receiveSucceeded(Clock::now() - e.started);
    } else {
      metrics_.receiveFailed(record.error().code);
    }
    return [fn = std::move(e.on_arrival), id, record = std::move(record)]() mutable { fn(id, std::move(record)); };
  }

  Status putLocked(Transfer& t, std::span<const LayerPut> puts) {
    const auto token_bytes = t.descriptor.compat.tokenBytes();
    for (const auto& lp : puts) {
      const auto r = regions_.find(lp.local_region);
      if (r == regions_.end()) return makeError(ErrorCode::NotFound, fmt::format("no region {}", lp.local_region));
      const std::uint64_t bytes = std::uint64_t{lp.slice.num_tokens} * token_bytes;
      if (lp.local_offset > r->second.memory.size() || bytes > r->second.memory.size() - lp.local_offset) {
        return makeError(ErrorCode::InvalidArgument, "put past the local region");
      }
      for (std::size_t ti = 0; ti < t.descriptor.targets.size(); ++ti) {
        PD_TRY(planLayerPuts(t.descriptor, ti, lp.slice));
      }
    }
    for (const auto& lp : puts) {
      auto& local = regions_.at(lp.local_region);
      if (t.regions.insert(lp.local_region).second) ++local.users;
      for (std::size_t ti = 0; ti < t.descriptor.targets.size(); ++ti) {
        const auto& target = t.descriptor.targets[ti];
        if (fabric_->down_.contains(target.worker_address)) {
          return makeError(ErrorCode::PeerFailed, "loopback peer went down");
        }
        const auto peer = fabric_->transports_.find(target.worker_address);
        if (peer == fabric_->transports_.end()) return makeError(ErrorCode::PeerFailed, "loopback peer is gone");
        if (fabric_->silent_.contains(target.worker_address)) continue;
        auto planned = planLayerPuts(t.descriptor, ti, lp.slice);
        for (const auto& p : planned.value()) {
          PD_ASSIGN_OR_RETURN(std::byte * dest, peer->second->resolveLocked(target.regions[p.region_index].rkey,
                                                                            p.remote_address, p.length));
          std::memcpy(dest, local.memory.data() + lp.local_offset + p.local_offset, p.length);
          metrics_.addBytesPut(p.length);
        }
      }
    }
    return okStatus();
  }

  // What a remote key check does: the bytes must lie inside the region the key names.
  Result<std::byte*> resolveLocked(const std::vector<std::uint8_t>& rkey, std::uint64_t address, std::uint64_t length) {
    RegionId id = 0;
    if (rkey.size() != sizeof(id)) return makeError(ErrorCode::PeerFailed, "bad loopback remote key");
    std::memcpy(&id, rkey.data(), sizeof(id));
    const auto it = regions_.find(id);
    if (it == regions_.end()) return makeError(ErrorCode::PeerFailed, "remote region was deregistered");
    const auto base = reinterpret_cast<std::uint64_t>(it->second.memory.data());
    if (address < base || address - base > it->second.memory.size() ||
        length > it->second.memory.size() - (address - base)) {
      return makeError(ErrorCode::PeerFailed, "put outside the remote region");
    }
    return it->second.memory.data() + (address - base);
  }

  // Delivers a record to this transport (fabric lock held); returns the callback to run.
  std::function<void()> deliverLocked(const std::vector<std::uint8_t>& bytes) {
    metrics_.recordReceived();
    auto decoded = decodeRecord(bytes);
    if (!decoded.ok()) {
      metrics_.recordRejected();
      return [] {};
    }
    const bool completion = std::holds_alternative<CompletionRecord>(decoded.value());
    const TransferId transfer_id = completion ? std::get<CompletionRecord>(decoded.value()).transfer_id
                                              : std::get<FailureRecord>(decoded.value()).transfer_id;
    const auto hash = completion ? std::get<CompletionRecord>(decoded.value()).compat_hash
                                 : std::get<FailureRecord>(decoded.value()).compat_hash;
    const auto bound = bound_.find(transfer_id);
    if (bound == bound_.end()) {
      metrics_.recordRejected();  // never granted here, or no longer: a guessed or stale id
      return [] {};
    }
    const std::uint64_t id = bound->second;
    auto node = expectations_.extract(id);
    if (node.empty()) {
      metrics_.recordRejected();
      return [] {};
    }
    if (completion) unbindLocked(id);
    if (hash != compat_hash_) {
      return arrivalCall(id, std::move(node.mapped()),
                         makeError(ErrorCode::Unsupported, "compatibility hash mismatch"));
    }
    if (completion)
      return arrivalCall(id, std::move(node.mapped()), std::get<CompletionRecord>(std::move(decoded).value()));
    auto& failure = std::get<FailureRecord>(decoded.value());
    return arrivalCall(id, std::move(node.mapped()),
                       makeError(failure.code, fmt::format("prefill side failed request {}: {}", id, failure.message)));
  }

  Status close(const TransferId& request_id, const std::vector<std::uint8_t>& record, Status outcome) {
    std::vector<std::function<void()>> calls;
    {
      std::lock_guard lock(fabric_->mutex_);
      const auto it = transfers_.find(request_id);
      if (it == transfers_.end())
        return makeError(ErrorCode::NotFound, fmt::format("request {} not in flight", request_id));
      Transfer& t = it->second;
      if (t.finished) return makeError(ErrorCode::InvalidArgument, "finished twice");
      const auto& targets = t.descriptor.targets;
      const bool reachable = std::all_of(targets.begin(), targets.end(), [&](const KvTarget& target) {
        return fabric_->transports_.contains(target.worker_address) && !fabric_->down_.contains(target.worker_address);
      });
      bool silent = false;
      for (const auto& target : targets) {
        if (!reachable) break;
        if (fabric_->silent_.contains(target.worker_address)) {
          silent = true;
          continue;
        }
        metrics_.recordSent();
        calls.push_back(fabric_->transports_.at(target.worker_address)->deliverLocked(record));
      }
      if (!reachable) {
        calls.push_back(doneCall(request_id, std::move(t), makeError(ErrorCode::PeerFailed, "loopback peer is gone")));
        transfers_.erase(it);
      } else if (silent) {
        t.finished = true;  // only the deadline ends it
      } else {
        calls.push_back(doneCall(request_id, std::move(t), std::move(outcome)));
        transfers_.erase(it);
      }
    }
    for (auto& call : calls) call();
    return okStatus();
  }

  void peerDownLocked(const std::vector<std::uint8_t>& address, std::vector<std::function<void()>>& calls) {
    for (auto it = transfers_.begin(); it != transfers_.end();) {
      const auto& targets = it->second.descriptor.targets;
      const bool uses =
          std::any_of(targets.begin(), targets.end(), [&](const KvTarget& t) { return t.worker_address == address; });
      if (!uses) {
        ++it;
        continue;
      }
      calls.push_back(
          doneCall(it->first, std::move(it->second), makeError(ErrorCode::PeerFailed, "loopback peer went down")));
      it = transfers_.erase(it);
    }
  }

  std::shared_ptr<LoopbackFabric> fabric_;  // shared by every transport of the fabric
  const CompatInfo compat_;
  const std::uint64_t compat_hash_;
  std::uint64_t serial_ = 0;
  std::vector<std::uint8_t> address_;
  TransportMetrics metrics_;
  RegionId next_region_ = 1;
  std::map<RegionId, Region> regions_;
  std::map<TransferId, Transfer> transfers_;
  std::map<std::uint64_t, Expectation> expectations_;  // by the caller's local handle
  std::map<TransferId, std::uint64_t> bound_;          // granted wire id -> local handle
  std::map<std::uint64_t, TransferId> bindings_;       // local handle -> granted wire id
};

inline void LoopbackFabric::setPeerDown(const std::vector<std::uint8_t>& address, bool down) {
  std::vector<std::function<void()>> calls;
  {
    std::lock_guard lock(mutex_);
    if (!down) {
      down_.erase(address);
      return;
    }
    down_.insert(address);
    for (auto& [addr, transport] : transports_) transport->peerDownLocked(address, calls);
  }
  for (auto& call : calls) call();
}

}  // namespace pd::kvtransfer::fakes
