#include "pd/prefill/kv_event_log.h"

#include <algorithm>
#include <random>
#include <utility>

#include "pd/common/check.h"
#include "pd/common/prefix_hash.h"

namespace pd::prefill {

KvEventLog::KvEventLog(std::string instance_id, std::uint64_t model_hash, std::int64_t block_size, std::size_t capacity)
    : instance_id_(std::move(instance_id)), model_hash_(model_hash), block_size_(block_size), capacity_(capacity) {
  PD_CHECK(!instance_id_.empty() && block_size_ > 0 && capacity_ > 0);
}

void KvEventLog::stored(std::uint64_t block) {
  std::lock_guard lock(mu_);
  if (held_.insert(block).second) append(true, block);
}

void KvEventLog::removed(std::uint64_t block) {
  std::lock_guard lock(mu_);
  if (held_.erase(block) != 0) append(false, block);
}

void KvEventLog::append(bool stored, std::uint64_t block) {
  events_.push_back(worker_api::KvEvent{++seq_, stored, block});
  while (events_.size() > capacity_) events_.pop_front();
}

worker_api::KvEvents KvEventLog::read(std::string_view instance, std::uint64_t after, std::size_t max_events) const {
  std::lock_guard lock(mu_);
  worker_api::KvEvents out;
  out.instance_id = instance_id_;
  out.model_hash = model_hash_;
  out.block_size = block_size_;
  // Events after `after` are all kept when `after` is at most seq_ and the oldest kept one follows it.
  const bool kept = after == seq_ || (after < seq_ && !events_.empty() && events_.front().seq <= after + 1);
  if (instance != instance_id_ || !kept) {
    out.snapshot = true;
    out.seq = seq_;
    out.blocks.assign(held_.begin(), held_.end());
    std::ranges::sort(out.blocks);
    return out;
  }
  out.seq = after;
  if (after == seq_) return out;
  const std::size_t first = static_cast<std::size_t>(after + 1 - events_.front().seq);
  const std::size_t n = std::min(events_.size() - first, std::max<std::size_t>(max_events, 1));
  out.events.assign(events_.begin() + static_cast<std::ptrdiff_t>(first),
                    events_.begin() + static_cast<std::ptrdiff_t>(first + n));
  out.seq = out.events.back().seq;
  out.more = out.seq < seq_;
  return out;
}

std::uint64_t KvEventLog::lastSeq() const {
  std::lock_guard lock(mu_);
  return seq_;
}

std::size_t KvEventLog::heldBlocks() const {
  std::lock_guard lock(mu_);
  return held_.size();
}

std::string randomInstanceId() {
  std::random_device rd;
  const std::uint64_t v = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  return hash64Hex(v);
}

}  // namespace pd::prefill
