#include "pd/prefill/transport_kv_sink.h"

#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "pd/common/log.h"
#include "pd/engine/latent_cache.h"

namespace pd::prefill {

void TransferTimeline::admitted() {
  std::lock_guard lock(mutex_);
  state_.admitted = Clock::now();
}

void TransferTimeline::prefixCached(std::int64_t tokens) {
  std::lock_guard lock(mutex_);
  state_.cached_tokens = tokens;
}

void TransferTimeline::computed(std::int32_t first_token) {
  std::lock_guard lock(mutex_);
  state_.computed = Clock::now();
  state_.first_token = first_token;
}

void TransferTimeline::failed(const Error& reason) {
  std::lock_guard lock(mutex_);
  if (!state_.failure) state_.failure = reason;
}

void TransferTimeline::forward(Forward f) {
  if (!detailed_) return;
  std::lock_guard lock(mutex_);
  state_.forwards.push_back(f);
}

void TransferTimeline::put(std::uint32_t layer, std::int64_t first_pos) {
  if (!detailed_) return;
  const Clock::time_point now = Clock::now();
  std::lock_guard lock(mutex_);
  state_.puts.push_back({layer, first_pos, now});
}

TransferTimeline::Snapshot TransferTimeline::snapshot() const {
  std::lock_guard lock(mutex_);
  return state_;
}

struct TransportKvSink::Staging {
  std::vector<std::byte> bytes;  // [num_layers][num_tokens][token bytes]
  kvtransfer::RegionId region = 0;
  std::mutex mutex;
  std::optional<Status> outcome;  // guarded by mutex: the transport's answer, once given
};

Result<std::unique_ptr<TransportKvSink>> TransportKvSink::create(
    kvtransfer::Transport& transport, kvtransfer::KvDescriptor descriptor, kvtransfer::Deadline deadline,
    kvtransfer::TransferDoneFn on_done, std::shared_ptr<TransferTimeline> timeline, std::string record_traceparent) {
  const kvtransfer::CompatInfo& c = descriptor.compat;
  if (!isKvDType(c.kv_dtype)) {
    return makeError(ErrorCode::Unsupported, fmt::format("KV dtype {} cannot be staged", dtypeName(c.kv_dtype)));
  }
  auto staging = std::make_shared<Staging>();
  staging->bytes.resize(std::uint64_t{c.num_layers} * descriptor.num_tokens * c.tokenBytes());
  PD_ASSIGN_OR_RETURN(staging->region, transport.registerRegion(staging->bytes));
  auto done = [&transport, staging, on_done = std::move(on_done)](const kvtransfer::TransferId& transfer_id,
                                                                  Status status) {
    // The transport no longer reads the staging buffer once it answers.
    Status s = transport.deregisterRegion(staging->region);
    if (!s.ok())
      log::warn("prefill", "transfer {}: staging region not deregistered: {}", transfer_id, s.error().toString());
    {
      std::lock_guard lock(staging->mutex);
      staging->outcome = status;
    }
    on_done(transfer_id, std::move(status));
  };
  Status begun = transport.beginTransfer(descriptor, deadline, std::move(done));
  if (!begun.ok()) {
    (void)transport.deregisterRegion(staging->region);
    return std::move(begun).error();
  }
  return std::unique_ptr<TransportKvSink>(new TransportKvSink(transport, std::move(descriptor), std::move(staging),
                                                              std::move(timeline), std::move(record_traceparent)));
}

TransportKvSink::TransportKvSink(kvtransfer::Transport& transport, kvtransfer::KvDescriptor descriptor,
                                 std::shared_ptr<Staging> staging, std::shared_ptr<TransferTimeline> timeline,
                                 std::string record_traceparent)
    : transport_(transport),
      descriptor_(std::move(descriptor)),
      staging_(std::move(staging)),
      timeline_(std::move(timeline)),
      record_traceparent_(std::move(record_traceparent)) {}

TransportKvSink::~TransportKvSink() {
  if (!ended_) abortTransfer(makeError(ErrorCode::Cancelled, "prefill request dropped"));
}

void TransportKvSink::admitted() {
  if (timeline_) timeline_->admitted();
}

void TransportKvSink::prefixCached(std::int64_t tokens) {
  if (timeline_) timeline_->prefixCached(tokens);
}

void TransportKvSink::forwardTimed(std::int64_t first_pos, std::int64_t n, bool mtp,
                                   std::chrono::steady_clock::time_point start,
                                   std::chrono::steady_clock::time_point end) {
  if (timeline_) timeline_->forward({first_pos, n, mtp, start, end});
}

Status TransportKvSink::putLayer(std::uint32_t layer, std::int64_t first_pos, std::span<const float> rows) {
  const kvtransfer::CompatInfo& c = descriptor_.compat;
  const auto dim = static_cast<std::int64_t>(c.kv_dim);
  auto n = static_cast<std::int64_t>(rows.size()) / dim;
  if (layer >= c.num_layers || first_pos < 0 || static_cast<std::int64_t>(rows.size()) != n * dim ||
      first_pos + n > static_cast<std::int64_t>(descriptor_.num_tokens)) {
    return makeError(
        ErrorCode::InvalidArgument,
        fmt::format("transfer {}: layer {} rows [{}, {}) of width {} outside the descriptor", descriptor_.transfer_id,
                    layer, first_pos, first_pos + n, rows.size() / (n > 0 ? n : 1)));
  }
  {
    // A transfer the transport already ended (peer failed, deadline) reports why, not NotFound.
    std::lock_guard lock(staging_->mutex);
    if (staging_->outcome) {
      if (!staging_->outcome->ok()) return staging_->outcome->error();
      return makeError(ErrorCode::Internal,
                       fmt::format("transfer {}: put after the transfer ended", descriptor_.transfer_id));
    }
  }
  // Rows the decode worker already holds (its prefix cache: descriptor.present_tokens) are not
  // sent; the prefill still computed them, for the rows after them.
  const std::int64_t skip = std::clamp<std::int64_t>(descriptor_.present_tokens - first_pos, 0, n);
  if (n - skip == 0) return okStatus();
  first_pos += skip;
  rows = rows.subspan(static_cast<std::size_t>(skip * dim));
  n -= skip;
  // The staging buffer seen as one block per layer holding every prompt token.
  const std::uint64_t layer_bytes = std::uint64_t{descriptor_.num_tokens} * c.tokenBytes();
  model::LatentCacheView view;
  view.dtype = c.kv_dtype;
  view.latent_dim = dim;
  view.block_size = descriptor_.num_tokens;
  view.num_blocks = 1;
  view.layers.assign(c.num_layers, nullptr);
  view.layers[layer] = staging_->bytes.data() + layer * layer_bytes;
  const std::int32_t block = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    model::writeLatent(view, layer, std::span(&block, 1), first_pos + i, rows.data() + i * dim);
  }
  const kvtransfer::LayerPut put{
      kvtransfer::LayerSlice{layer, static_cast<std::uint32_t>(first_pos), static_cast<std::uint32_t>(n)},
      staging_->region, layer * layer_bytes + static_cast<std::uint64_t>(first_pos) * c.tokenBytes()};
  Status posted = transport_.put(descriptor_.transfer_id, std::span(&put, 1));
  if (posted.ok() && timeline_) timeline_->put(layer, first_pos);
  return posted;
}

void TransportKvSink::complete(kvtransfer::CompletionRecord record) {
  ended_ = true;
  if (timeline_) timeline_->computed(record.first_token);
  // The transfer is named by the decode worker's grant (the descriptor), not by the engine.
  const kvtransfer::TransferId id = descriptor_.transfer_id;
  record.transfer_id = id;
  record.traceparent = record_traceparent_;
  Status s = transport_.finish(std::move(record));
  if (!s.ok()) {
    // NotFound: the transfer already ended (deadline, peer failure) and its done callback says
    // why. Anything else must not leave the transfer waiting for its deadline.
    log::warn("prefill", "transfer {}: completion record not sent: {}", id, s.error().toString());
    if (s.error().code != ErrorCode::NotFound) abortTransfer(s.error());
  }
}

void TransportKvSink::fail(const Error& reason) {
  ended_ = true;
  if (timeline_) timeline_->failed(reason);
  abortTransfer(reason);
}

void TransportKvSink::abortTransfer(const Error& reason) {
  ended_ = true;
  Status s = transport_.abort(descriptor_.transfer_id, reason.code, reason.message);
  if (!s.ok() && s.error().code != ErrorCode::NotFound) {
    log::warn("prefill", "transfer {}: abort failed: {}", descriptor_.transfer_id, s.error().toString());
  }
}

}  // namespace pd::prefill
