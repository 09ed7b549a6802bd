// StagingTransport: the Transport decorator of the staging KV path (staging_transport.h).
// Everything the decorator learns (inner answers, copy completions, user calls) is applied to its
// maps under mutex_; calls into the inner transport, the copier and user callbacks happen after the
// lock is released, because any of them may call back into this transport.
#include "pd/kvtransfer/staging_transport.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "pd/common/log.h"
#include "pd/kvtransfer/layout.h"
#include "staging/staging_arena.h"
#include "staging/staging_block_pool.h"

namespace pd::kvtransfer {
namespace {

using Actions = std::vector<std::function<void()>>;

void run(Actions& actions) {
  for (auto& action : actions) action();
  actions.clear();
}

struct DeviceRegion {
  std::span<std::byte> memory;
  int users = 0;  // sending transfers that read it
};

// Where one layer of the device pool sits (from exportTarget).
struct DeviceLayer {
  std::byte* base = nullptr;     // block 0 of this layer
  std::uint64_t region_end = 0;  // bytes from base to the end of the region
  std::uint64_t block_stride = 0;
};

class StagingTransportImpl final : public StagingTransport {
 public:
  StagingTransportImpl(std::unique_ptr<Transport> inner, std::unique_ptr<DeviceCopier> copier,
                       StagingTransportOptions options, std::optional<StagingMemory> send_memory, RegionId send_region,
                       std::optional<StagingMemory> receive_memory, RegionId receive_region)
      : options_(std::move(options)),
        send_memory_(std::move(send_memory)),
        receive_memory_(std::move(receive_memory)),
        inner_(std::move(inner)),
        copier_owned_(std::move(copier)),
        copier_(copier_owned_.get()),
        token_bytes_(inner_->compat().tokenBytes()),
        block_bytes_(std::uint64_t{inner_->compat().block_size} * token_bytes_),
        num_layers_(inner_->compat().num_layers),
        send_region_(send_region),
        receive_region_(receive_region),
        arena_(send_memory_ ? send_memory_->span().size() : 0),
        blocks_(options_.receive_blocks) {}

  ~StagingTransportImpl() override {
    {
      // No copy is submitted from now on; wait for the submissions under way.
      std::unique_lock lock(mutex_);
      stopping_ = true;
      submissions_done_.wait(lock, [this] { return submitting_ == 0; });
    }
    // Running copies end (their callbacks may still put and deliver); queued ones are cancelled.
    copier_owned_.reset();
    // Best effort: a transfer still in flight keeps its buffer registered until the inner
    // transport's destruction answers it (which releases the registration too).
    if (send_memory_) (void)inner_->deregisterRegion(send_region_);
    if (receive_memory_) (void)inner_->deregisterRegion(receive_region_);
    // The inner transport answers what is still pending with Cancelled, through our callbacks.
    inner_.reset();
  }

  StagingTransportImpl(const StagingTransportImpl&) = delete;
  StagingTransportImpl& operator=(const StagingTransportImpl&) = delete;
  StagingTransportImpl(StagingTransportImpl&&) = delete;
  StagingTransportImpl& operator=(StagingTransportImpl&&) = delete;

  [[nodiscard]] TransportCapabilities capabilities() const override {
    TransportCapabilities caps = inner_->capabilities();
    caps.name = fmt::format("staging({}) over {}", copier_name_, caps.name);
    return caps;
  }
  [[nodiscard]] const CompatInfo& compat() const override { return inner_->compat(); }
  [[nodiscard]] TransportStats stats() const override { return inner_->stats(); }

  [[nodiscard]] StagingStats stagingStats() const override {
    std::lock_guard lock(mutex_);
    StagingStats s;
    s.send_capacity_bytes = arena_.capacity();
    s.send_reserved_bytes = arena_.used();
    s.transfers_waiting = admission_.size();
    s.bytes_staged_out = bytes_staged_out_;
    s.receive_blocks = blocks_.total();
    s.receive_blocks_free = blocks_.freeBlocks();
    s.receive_blocks_quarantined = blocks_.quarantinedBlocks();
    s.bytes_staged_in = bytes_staged_in_;
    return s;
  }

  // ---- memory: "device" regions stay with the decorator --------------------------------------

  Result<RegionId> registerRegion(std::span<std::byte> memory) override {
    if (memory.empty()) return makeError(ErrorCode::InvalidArgument, "cannot register an empty region");
    std::lock_guard lock(mutex_);
    const RegionId id = next_region_++;
    regions_.emplace(id, DeviceRegion{memory, 0});
    return id;
  }

  Status deregisterRegion(RegionId region) override {
    std::lock_guard lock(mutex_);
    const auto it = regions_.find(region);
    if (it == regions_.end()) return makeError(ErrorCode::NotFound, fmt::format("no registered region {}", region));
    if (it->second.users > 0) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("region {} is read by transfers in flight", region));
    }
    for (auto& layer : layers_) {
      const auto* base = it->second.memory.data();
      if (layer && layer->base >= base && layer->base < base + it->second.memory.size()) layer.reset();
    }
    regions_.erase(it);
    return okStatus();
  }

  Result<KvTarget> exportTarget(std::uint32_t tp_rank, std::span<const RegionLayout> layouts) override {
    if (!receive_memory_) return makeError(ErrorCode::InvalidArgument, "this staging transport does not receive");
    std::vector<RegionLayout> staged;
    {
      std::lock_guard lock(mutex_);
      std::vector<std::optional<DeviceLayer>> layers(num_layers_);
      for (const auto& l : layouts) {
        const auto r = regions_.find(l.region);
        if (r == regions_.end())
          return makeError(ErrorCode::NotFound, fmt::format("no registered region {}", l.region));
        if (l.num_layers == 0 || l.first_layer >= num_layers_ || l.num_layers > num_layers_ - l.first_layer) {
          return makeError(ErrorCode::InvalidArgument, fmt::format("layers {}+{} outside the {} KV layers",
                                                                   l.first_layer, l.num_layers, num_layers_));
        }
        if (l.block_stride < block_bytes_) return makeError(ErrorCode::InvalidArgument, "block stride below a block");
        const std::uint64_t size = r->second.memory.size();
        for (std::uint32_t i = 0; i < l.num_layers; ++i) {
          const unsigned __int128 start =
              static_cast<unsigned __int128>(l.offset) + static_cast<unsigned __int128>(i) * l.layer_stride;
          if (start >= size) return makeError(ErrorCode::InvalidArgument, "layout past the region");
          if (layers[l.first_layer + i]) return makeError(ErrorCode::InvalidArgument, "a layer in two layouts");
          const auto offset = static_cast<std::uint64_t>(start);
          layers[l.first_layer + i] = DeviceLayer{r->second.memory.data() + offset, size - offset, l.block_stride};
        }
        // The staging pool is layer-major over every KV layer: layer l at l * layer stride.
        staged.push_back(RegionLayout{receive_region_, l.first_layer * stagingLayerStride(), l.first_layer,
                                      l.num_layers, stagingLayerStride(), block_bytes_});
      }
      layers_ = std::move(layers);
    }
    Result<KvTarget> target = inner_->exportTarget(tp_rank, staged);
    if (target.ok()) {
      std::lock_guard lock(mutex_);
      own_address_ = target->worker_address;
    }
    return target;
  }

  // ---- sending side ------------------------------------------------------------------------

  Status beginTransfer(const KvDescriptor& descriptor, Deadline deadline, TransferDoneFn on_done) override {
    const std::uint64_t bytes = std::uint64_t{num_layers_} * descriptor.num_tokens * token_bytes_;
    Actions actions;
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return makeError(ErrorCode::Cancelled, "staging transport shut down");
      if (!send_memory_) return makeError(ErrorCode::InvalidArgument, "this staging transport does not send");
      if (bytes > arena_.capacity()) {
        return makeError(ErrorCode::ResourceExhausted,
                         fmt::format("a transfer of {} bytes does not fit the {} bytes of KV staging "
                                     "(kvtransfer.staging_send_mb)",
                                     bytes, arena_.capacity()));
      }
      if (descriptor.transfer_id.empty()) {
        return makeError(ErrorCode::InvalidArgument, "KV descriptor: no transfer id");
      }
      if (sends_.contains(descriptor.transfer_id)) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("transfer {} is already in flight", descriptor.transfer_id));
      }
      Send& s = sends_[descriptor.transfer_id];
      s.bytes = bytes;
      s.num_tokens = descriptor.num_tokens;
      s.on_done = std::move(on_done);
    }
    const TransferId id = descriptor.transfer_id;
    Status begun = inner_->beginTransfer(
        descriptor, deadline, [this](const TransferId& tid, Status status) { onInnerDone(tid, std::move(status)); });
    {
      std::lock_guard lock(mutex_);
      if (!begun.ok()) {
        sends_.erase(id);
        return begun;
      }
      admission_.push_back(id);  // skipped by admitLocked if the inner transport answered already
      admitLocked(actions);
    }
    run(actions);
    return okStatus();
  }

  Status put(const TransferId& transfer_id, std::span<const LayerPut> puts) override {
    Actions actions;
    {
      std::lock_guard lock(mutex_);
      const auto it = sends_.find(transfer_id);
      if (it == sends_.end() || it->second.inner_done) {
        return makeError(ErrorCode::NotFound, fmt::format("transfer {} not in flight", transfer_id));
      }
      Send& s = it->second;
      if (s.finish_requested || s.aborted) return makeError(ErrorCode::InvalidArgument, "put after finish");
      for (const auto& p : puts) {
        const auto r = regions_.find(p.local_region);
        if (r == regions_.end()) return makeError(ErrorCode::NotFound, fmt::format("no region {}", p.local_region));
        const std::uint64_t length = std::uint64_t{p.slice.num_tokens} * token_bytes_;
        if (p.local_offset > r->second.memory.size() || length > r->second.memory.size() - p.local_offset) {
          return makeError(ErrorCode::InvalidArgument, "put past the local region");
        }
        if (p.slice.layer >= num_layers_ || p.slice.first_token > s.num_tokens ||
            p.slice.num_tokens > s.num_tokens - p.slice.first_token) {
          return makeError(ErrorCode::InvalidArgument,
                           fmt::format("slice layer {} tokens {}+{} outside the transfer", p.slice.layer,
                                       p.slice.first_token, p.slice.num_tokens));
        }
      }
      for (const auto& p : puts) {
        if (s.regions.insert(p.local_region).second) ++regions_.at(p.local_region).users;
        s.queued.push_back(p);
      }
      if (s.offset) issueLocked(transfer_id, s, actions);
    }
    run(actions);
    return okStatus();
  }

  Status finish(CompletionRecord record) override {
    Actions actions;
    {
      std::lock_guard lock(mutex_);
      const auto it = sends_.find(record.transfer_id);
      if (it == sends_.end() || it->second.inner_done) {
        return makeError(ErrorCode::NotFound, fmt::format("transfer {} not in flight", record.transfer_id));
      }
      Send& s = it->second;
      if (s.finish_requested || s.aborted) return makeError(ErrorCode::InvalidArgument, "finished twice");
      s.finish_requested = true;
      s.record = std::move(record);
      maybeFinishLocked(it->first, s, actions);
    }
    run(actions);
    return okStatus();
  }

  Status abort(const TransferId& transfer_id, ErrorCode code, std::string reason) override {
    {
      std::lock_guard lock(mutex_);
      const auto it = sends_.find(transfer_id);
      if (it == sends_.end() || it->second.inner_done) {
        return makeError(ErrorCode::NotFound, fmt::format("transfer {} not in flight", transfer_id));
      }
      it->second.aborted = true;
      it->second.queued.clear();  // never copied now
    }
    return inner_->abort(transfer_id, code, std::move(reason));
  }

  // ---- receiving side ----------------------------------------------------------------------

  Status expect(std::uint64_t request_id, Deadline deadline, ArrivalFn on_arrival) override {
    // A record for this transport lands in its receive memory (onRecord): refuse here, as
    // exportTarget does, rather than rely on every caller holding a receiving transport.
    if (!receive_memory_) return makeError(ErrorCode::InvalidArgument, "this staging transport does not receive");
    bool created = false;
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return makeError(ErrorCode::Cancelled, "staging transport shut down");
      auto it = receives_.find(request_id);
      if (it == receives_.end()) {
        it = receives_.emplace(request_id, Receive{}).first;
        created = true;
      } else if (it->second.state != ReceiveState::Delivering) {
        return makeError(ErrorCode::InvalidArgument, fmt::format("request {} is already expected", request_id));
      }
      it->second.state = ReceiveState::Expected;  // from Delivering: re-armed by the callback
      it->second.on_arrival = std::move(on_arrival);
    }
    Status s = inner_->expect(request_id, deadline, [this](std::uint64_t id, Result<CompletionRecord> record) {
      onInnerArrival(id, std::move(record));
    });
    if (!s.ok()) {
      std::lock_guard lock(mutex_);
      const auto it = receives_.find(request_id);
      if (created) {
        receives_.erase(it);
      } else {
        it->second.state = ReceiveState::Delivering;  // the callback that re-arms will release it
        it->second.on_arrival = nullptr;
      }
    }
    return s;
  }

  bool cancelExpect(std::uint64_t request_id) override {
    {
      std::lock_guard lock(mutex_);
      const auto it = receives_.find(request_id);
      if (it == receives_.end()) return false;
      if (it->second.state == ReceiveState::Copying) {
        it->second.cancel_requested = true;  // answered Cancelled when the copy is over
        return true;
      }
      if (it->second.state != ReceiveState::Expected) return false;
    }
    return inner_->cancelExpect(request_id);
  }

  Result<KvDescriptor> grant(std::uint64_t request_id, KvDescriptor descriptor) override {
    const std::uint32_t block_size = inner_->compat().block_size;
    const std::uint32_t needed = (descriptor.num_tokens + block_size - 1) / block_size;
    bool allocated = false;
    std::vector<KvTarget>::iterator own;
    {
      std::lock_guard lock(mutex_);
      const auto it = receives_.find(request_id);
      if (it == receives_.end() || it->second.state != ReceiveState::Expected) {
        return makeError(ErrorCode::NotFound, fmt::format("request {} is not expected", request_id));
      }
      Receive& r = it->second;
      // The wire names this rank's staging blocks in its own target (KvTarget::block_ids), so that
      // with decode tensor parallelism each rank's grant chooses its own; block_ids stay the pool's.
      own = std::find_if(descriptor.targets.begin(), descriptor.targets.end(),
                         [&](const KvTarget& t) { return !own_address_.empty() && t.worker_address == own_address_; });
      if (own == descriptor.targets.end()) {
        return makeError(
            ErrorCode::InvalidArgument,
            fmt::format("request {}: the descriptor lists no target at this transport's address", request_id));
      }
      if (descriptor.block_ids.size() < needed) {
        return makeError(ErrorCode::InvalidArgument, "KV descriptor: the block list does not cover num_tokens");
      }
      std::vector<std::uint32_t> pool_ids(descriptor.block_ids.begin(), descriptor.block_ids.begin() + needed);
      if (!r.staging_ids.empty()) {
        if (pool_ids != r.pool_ids || descriptor.num_tokens != r.num_tokens ||
            descriptor.present_tokens / block_size != r.present_blocks) {
          return makeError(ErrorCode::InvalidArgument,
                           fmt::format("request {} is already granted other blocks", request_id));
        }
      } else {
        PD_TRY(checkPoolBlocksLocked(pool_ids));
        if (needed > blocks_.total()) {
          return makeError(ErrorCode::ResourceExhausted,
                           fmt::format("a prompt of {} blocks does not fit the {} KV staging blocks "
                                       "(kvtransfer.staging_receive_blocks)",
                                       needed, blocks_.total()));
        }
        auto staging = blocks_.allocate(needed, now());
        if (!staging) {
          return makeError(ErrorCode::Overloaded,
                           fmt::format("KV staging blocks exhausted ({} free, {} quarantined, {} needed)",
                                       blocks_.freeBlocks(), blocks_.quarantinedBlocks(), needed));
        }
        r.staging_ids = std::move(*staging);
        r.pool_ids = std::move(pool_ids);
        r.num_tokens = descriptor.num_tokens;
        r.present_blocks = descriptor.present_tokens / block_size;
        allocated = true;
      }
      own->block_ids = r.staging_ids;
    }
    Result<KvDescriptor> granted = inner_->grant(request_id, std::move(descriptor));
    if (!granted.ok() && allocated) {
      std::lock_guard lock(mutex_);
      if (const auto it = receives_.find(request_id); it != receives_.end()) {
        blocks_.release(it->second.staging_ids);
        it->second.staging_ids.clear();
        it->second.pool_ids.clear();
      }
    }
    return granted;
  }

 private:
  enum class ReceiveState {
    Expected,    // the inner transport waits for its record
    Copying,     // the record arrived; staged tokens are being copied into the pool
    Delivering,  // a failure is being delivered; the callback may re-arm
  };
  struct Receive {
    ReceiveState state = ReceiveState::Expected;
    ArrivalFn on_arrival;
    std::vector<std::uint32_t> staging_ids;  // granted, parallel to pool_ids
    std::vector<std::uint32_t> pool_ids;
    std::uint32_t num_tokens = 0;
    // Leading blocks the decode worker already holds (KvDescriptor::present_tokens, decode-side
    // prefix reuse): nothing is sent for them, so nothing is copied into them (they are shared).
    std::uint32_t present_blocks = 0;
    bool cancel_requested = false;
  };
  struct Send {
    std::uint64_t bytes = 0;
    std::uint32_t num_tokens = 0;
    std::optional<std::uint64_t> offset;  // in the arena, once admitted
    std::deque<LayerPut> queued;          // not copied yet
    int copies_in_flight = 0;
    bool finish_requested = false;
    bool finish_sent = false;
    bool aborted = false;
    std::optional<CompletionRecord> record;
    bool inner_done = false;
    Status outcome = okStatus();
    TransferDoneFn on_done;
    std::set<RegionId> regions;
  };

  Clock::time_point now() const { return options_.now ? options_.now() : Clock::now(); }
  std::uint64_t stagingLayerStride() const { return std::uint64_t{options_.receive_blocks} * block_bytes_; }

  Status checkPoolBlocksLocked(const std::vector<std::uint32_t>& pool_ids) const {
    if (layers_.empty()) return makeError(ErrorCode::InvalidArgument, "grant before exportTarget");
    const std::uint32_t highest = pool_ids.empty() ? 0 : *std::max_element(pool_ids.begin(), pool_ids.end());
    for (std::uint32_t l = 0; l < num_layers_; ++l) {
      const auto& layer = layers_[l];
      if (!layer) return makeError(ErrorCode::InvalidArgument, fmt::format("layer {} has no pool layout", l));
      const unsigned __int128 end = static_cast<unsigned __int128>(highest) * layer->block_stride + block_bytes_;
      if (end > layer->region_end) {
        return makeError(ErrorCode::InvalidArgument, fmt::format("pool block {} outside the pool", highest));
      }
    }
    return okStatus();
  }

  // ---- sending internals ---------------------------------------------------------------------

  // Admits waiting transfers in arrival order while the first one fits.
  void admitLocked(Actions& actions) {
    while (!admission_.empty()) {
      const TransferId id = admission_.front();
      const auto it = sends_.find(id);
      if (it == sends_.end() || it->second.inner_done) {
        admission_.pop_front();
        continue;
      }
      Send& s = it->second;
      const auto offset = arena_.allocate(s.bytes);
      if (!offset && s.bytes > 0) return;
      s.offset = offset.value_or(0);
      admission_.pop_front();
      issueLocked(id, s, actions);
      maybeFinishLocked(id, s, actions);
    }
  }

  // Starts the device -> staging copy of every queued put of an admitted transfer.
  void issueLocked(const TransferId& id, Send& s, Actions& actions) {
    if (s.queued.empty() || s.inner_done || s.aborted) return;
    std::vector<CopySpan> spans;
    std::vector<LayerPut> staged;
    for (const LayerPut& p : s.queued) {
      const std::uint64_t length = std::uint64_t{p.slice.num_tokens} * token_bytes_;
      const std::uint64_t offset =
          *s.offset + (std::uint64_t{p.slice.layer} * s.num_tokens + p.slice.first_token) * token_bytes_;
      spans.push_back(CopySpan{send_memory_->span().data() + offset,
                               regions_.at(p.local_region).memory.data() + p.local_offset, length});
      staged.push_back(LayerPut{p.slice, send_region_, offset});
      bytes_staged_out_ += length;
    }
    s.queued.clear();
    ++s.copies_in_flight;
    actions.push_back([this, id, spans = std::move(spans), staged = std::move(staged)]() mutable {
      auto on_copied = [this, id, staged](Status status) { onSendCopied(id, staged, std::move(status)); };
      Status queued = submitCopy(CopyDirection::DeviceToHost, std::move(spans), on_copied);
      if (!queued.ok()) onSendCopied(id, {}, std::move(queued));
    });
  }

  // A batch is in staging: put it from there (or give the transfer up when the copy failed).
  void onSendCopied(const TransferId& id, const std::vector<LayerPut>& staged, Status status) {
    Status posted = std::move(status);
    if (posted.ok()) posted = inner_->put(id, staged);
    Actions actions;
    bool give_up = false;
    {
      std::lock_guard lock(mutex_);
      const auto it = sends_.find(id);
      PD_CHECK(it != sends_.end());
      Send& s = it->second;
      --s.copies_in_flight;
      if (!posted.ok() && !s.inner_done && !s.aborted) {
        s.aborted = true;
        s.queued.clear();
        give_up = true;
      }
      if (give_up) {
        actions.push_back([this, id, error = posted.error()] {
          (void)inner_->abort(id, error.code, fmt::format("KV staging: {}", error.message));
        });
      } else {
        maybeFinishLocked(id, s, actions);
      }
      maybeCompleteLocked(id, actions);
    }
    run(actions);
  }

  void maybeFinishLocked(const TransferId& /*id*/, Send& s, Actions& actions) {
    if (!s.finish_requested || s.finish_sent || s.aborted || s.inner_done || !s.offset || !s.queued.empty() ||
        s.copies_in_flight > 0) {
      return;
    }
    s.finish_sent = true;
    actions.push_back([this, record = std::move(*s.record)]() mutable { (void)inner_->finish(std::move(record)); });
  }

  void onInnerDone(const TransferId& id, Status status) {
    Actions actions;
    {
      std::lock_guard lock(mutex_);
      const auto it = sends_.find(id);
      PD_CHECK(it != sends_.end());
      it->second.inner_done = true;
      it->second.queued.clear();
      it->second.outcome = std::move(status);
      maybeCompleteLocked(id, actions);
    }
    run(actions);
  }

  // The inner transport answered and no copy reads the source: release and answer the caller.
  void maybeCompleteLocked(const TransferId& id, Actions& actions) {
    const auto it = sends_.find(id);
    Send& s = it->second;
    if (!s.inner_done || s.copies_in_flight > 0) return;
    if (s.offset && s.bytes > 0) arena_.release(*s.offset);
    for (const RegionId r : s.regions) {
      if (const auto region = regions_.find(r); region != regions_.end()) --region->second.users;
    }
    actions.push_back(
        [fn = std::move(s.on_done), id, outcome = std::move(s.outcome)]() mutable { fn(id, std::move(outcome)); });
    sends_.erase(it);
    admitLocked(actions);
  }

  // ---- receiving internals -------------------------------------------------------------------

  void onInnerArrival(std::uint64_t request_id, Result<CompletionRecord> record) {
    if (record.ok()) return onRecord(request_id, std::move(record).value());
    ArrivalFn fn;
    {
      std::lock_guard lock(mutex_);
      const auto it = receives_.find(request_id);
      PD_CHECK(it != receives_.end() && it->second.state == ReceiveState::Expected);
      it->second.state = ReceiveState::Delivering;
      fn = std::move(it->second.on_arrival);
    }
    fn(request_id, std::move(record));  // may re-arm: expect() from inside
    std::lock_guard lock(mutex_);
    const auto it = receives_.find(request_id);
    if (it == receives_.end() || it->second.state != ReceiveState::Delivering) return;  // re-armed
    // A sender may still be writing: keep the staging blocks out of use for a while.
    blocks_.quarantine(it->second.staging_ids, now() + options_.quarantine);
    receives_.erase(it);
  }

  void onRecord(std::uint64_t request_id, CompletionRecord record) {
    std::vector<CopySpan> spans;
    bool pool_gone = false;
    {
      std::lock_guard lock(mutex_);
      const auto it = receives_.find(request_id);
      PD_CHECK(it != receives_.end() && it->second.state == ReceiveState::Expected);
      Receive& r = it->second;
      r.state = ReceiveState::Copying;
      const std::uint32_t block_size = inner_->compat().block_size;
      std::byte* staging = receive_memory_->span().data();
      for (std::uint32_t l = 0; l < num_layers_ && !r.staging_ids.empty(); ++l) {
        if (layers_.size() <= l || !layers_[l]) {
          pool_gone = true;  // the pool was deregistered under a live receive
          break;
        }
        const DeviceLayer& layer = *layers_[l];
        for (std::size_t i = r.present_blocks; i < r.staging_ids.size(); ++i) {
          const std::uint32_t first = static_cast<std::uint32_t>(i) * block_size;
          const std::uint64_t tokens = std::min<std::uint32_t>(block_size, r.num_tokens - first);
          spans.push_back(CopySpan{layer.base + std::uint64_t{r.pool_ids[i]} * layer.block_stride,
                                   staging + l * stagingLayerStride() + std::uint64_t{r.staging_ids[i]} * block_bytes_,
                                   tokens * token_bytes_});
          bytes_staged_in_ += tokens * token_bytes_;
        }
      }
    }
    auto record_ptr = std::make_shared<CompletionRecord>(std::move(record));
    auto on_copied = [this, request_id, record_ptr](const Status& status) {
      onReceiveCopied(request_id, std::move(*record_ptr), status);
    };
    Status queued = pool_gone ? Status(makeError(ErrorCode::Internal, "the KV pool was deregistered"))
                              : submitCopy(CopyDirection::HostToDevice, std::move(spans), on_copied);
    if (!queued.ok()) onReceiveCopied(request_id, std::move(*record_ptr), queued);
  }

  // Every copy goes through here, so that the destructor knows when none is being submitted.
  Status submitCopy(CopyDirection direction, std::vector<CopySpan> spans, CopyDoneFn on_done) {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return makeError(ErrorCode::Cancelled, "staging transport shut down");
      ++submitting_;
    }
    Status queued = copier_->copy(direction, std::move(spans), std::move(on_done));
    {
      std::lock_guard lock(mutex_);
      --submitting_;
    }
    submissions_done_.notify_all();
    return queued;
  }

  void onReceiveCopied(std::uint64_t request_id, CompletionRecord record, const Status& status) {
    ArrivalFn fn;
    Result<CompletionRecord> outcome = std::move(record);
    {
      std::lock_guard lock(mutex_);
      const auto it = receives_.find(request_id);
      PD_CHECK(it != receives_.end() && it->second.state == ReceiveState::Copying);
      Receive& r = it->second;
      if (r.cancel_requested) {
        outcome = makeError(ErrorCode::Cancelled, fmt::format("request {}: receive cancelled", request_id));
      } else if (!status.ok()) {
        outcome =
            makeError(status.error().code == ErrorCode::Cancelled ? ErrorCode::Cancelled : ErrorCode::Internal,
                      fmt::format("request {}: KV staging copy into the pool: {}", request_id, status.error().message));
      }
      // The sender flushed before its record: nothing more lands in these staging blocks.
      blocks_.release(r.staging_ids);
      fn = std::move(r.on_arrival);
      receives_.erase(it);
    }
    fn(request_id, std::move(outcome));
  }

  const StagingTransportOptions options_;
  // Staging memory outlives the inner transport that registered it (members die in reverse).
  const std::optional<StagingMemory> send_memory_;
  const std::optional<StagingMemory> receive_memory_;
  std::unique_ptr<Transport> inner_;
  std::unique_ptr<DeviceCopier> copier_owned_;
  DeviceCopier* const copier_;  // copier_owned_, kept for calls while the destructor resets it
  const std::string copier_name_ = copier_->name();
  const std::uint64_t token_bytes_;
  const std::uint64_t block_bytes_;
  const std::uint32_t num_layers_;
  const RegionId send_region_;
  const RegionId receive_region_;

  mutable std::mutex mutex_;
  bool stopping_ = false;  // guarded by mutex_
  int submitting_ = 0;     // guarded by mutex_: copier_->copy calls under way
  std::condition_variable submissions_done_;
  RegionId next_region_ = 1;
  std::map<RegionId, DeviceRegion> regions_;
  std::vector<std::optional<DeviceLayer>> layers_;  // by KV layer, from exportTarget
  std::vector<std::uint8_t> own_address_;           // the exported target's worker address
  staging::StagingArena arena_;
  std::deque<TransferId> admission_;  // begun, waiting for staging space, in arrival order
  std::map<TransferId, Send> sends_;
  staging::StagingBlockPool blocks_;
  std::map<std::uint64_t, Receive> receives_;
  std::uint64_t bytes_staged_out_ = 0;
  std::uint64_t bytes_staged_in_ = 0;
};

}  // namespace

Result<std::unique_ptr<StagingTransport>> createStagingTransport(std::unique_ptr<Transport> inner,
                                                                 std::unique_ptr<DeviceCopier> copier,
                                                                 StagingTransportOptions options) {
  PD_CHECK(inner != nullptr && copier != nullptr);
  const CompatInfo& c = inner->compat();
  if (c.num_layers == 0 || c.block_size == 0) return makeError(ErrorCode::InvalidArgument, "KV staging: no layers");
  std::optional<StagingMemory> send_memory;
  std::optional<StagingMemory> receive_memory;
  RegionId send_region = 0;
  RegionId receive_region = 0;
  if (options.send_bytes > 0) {
    PD_ASSIGN_OR_RETURN(StagingMemory memory, copier->allocateHost(options.send_bytes));
    PD_ASSIGN_OR_RETURN(send_region, inner->registerRegion(memory.span()));
    send_memory = std::move(memory);
  }
  if (options.receive_blocks > 0) {
    const unsigned __int128 bytes =
        static_cast<unsigned __int128>(c.num_layers) * options.receive_blocks * c.block_size * c.tokenBytes();
    if (bytes > (std::uint64_t{1} << 40)) {
      return makeError(ErrorCode::InvalidArgument, "KV staging: receive blocks larger than 1 TiB");
    }
    PD_ASSIGN_OR_RETURN(StagingMemory memory, copier->allocateHost(static_cast<std::size_t>(bytes)));
    PD_ASSIGN_OR_RETURN(receive_region, inner->registerRegion(memory.span()));
    receive_memory = std::move(memory);
  }
  log::info("kvtransfer", "KV staging path: {} copier, {} send bytes, {} receive blocks ({} ms quarantine)",
            copier->name(), options.send_bytes, options.receive_blocks, options.quarantine.count());
  return std::unique_ptr<StagingTransport>(std::make_unique<StagingTransportImpl>(
      std::move(inner), std::move(copier), std::move(options), std::move(send_memory), send_region,
      std::move(receive_memory), receive_region));
}

Result<KvTransferPathSetting> parseKvTransferPath(std::string_view text) {
  if (text == "auto") return KvTransferPathSetting::Auto;
  if (text == "direct") return KvTransferPathSetting::Direct;
  if (text == "staging") return KvTransferPathSetting::Staging;
  return makeError(ErrorCode::InvalidArgument,
                   fmt::format("kvtransfer.path '{}': expected auto, direct or staging", text));
}

std::string_view kvTransferPathName(KvTransferPath path) {
  return path == KvTransferPath::Direct ? "direct" : "staging";
}

KvTransferPath resolveKvTransferPath(KvTransferPathSetting setting, bool pool_in_device_memory,
                                     bool transport_registers_device_memory) {
  switch (setting) {
    case KvTransferPathSetting::Direct:
      return KvTransferPath::Direct;
    case KvTransferPathSetting::Staging:
      return KvTransferPath::Staging;
    case KvTransferPathSetting::Auto:
      break;
  }
  return (!pool_in_device_memory || transport_registers_device_memory) ? KvTransferPath::Direct
                                                                       : KvTransferPath::Staging;
}

}  // namespace pd::kvtransfer
