#pragma once
/// The prefill worker's KV event log (docs/routing.md): every block its prefix cache stores or
/// removes gets the next sequence number, so that a router can follow what the worker holds
/// (GET /v1/internal/kv_events) and send each prompt where its longest prefix is cached.
///
/// Memory is bounded: the log keeps the last `capacity` events and the set of blocks held now
/// (at most the prefix cache's capacity). A reader that is further behind than the kept events,
/// names another instance (it followed an earlier process on this address) or a sequence number
/// the log never issued gets a snapshot of the held blocks instead of events.
///
/// Thread rules: thread-safe. The prefix cache appends from the engine thread; HTTP handlers read.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_set>

#include "pd/common/worker_api.h"

namespace pd::prefill {

class KvEventLog {
 public:
  /// Events kept for readers that poll behind the newest.
  static constexpr std::size_t kDefaultCapacity = 16384;
  /// Most events one read() returns.
  static constexpr std::size_t kMaxEventsPerRead = 4096;

  /// `instance_id`: unique per process (randomInstanceId()); `block_size` > 0; `capacity` > 0.
  KvEventLog(std::string instance_id, std::uint64_t model_hash, std::int64_t block_size,
             std::size_t capacity = kDefaultCapacity);
  KvEventLog(const KvEventLog&) = delete;
  KvEventLog& operator=(const KvEventLog&) = delete;
  KvEventLog(KvEventLog&&) = delete;
  KvEventLog& operator=(KvEventLog&&) = delete;
  ~KvEventLog() = default;

  /// A block entered the prefix cache (ignored when it is already held).
  void stored(std::uint64_t block);
  /// A block left the prefix cache (ignored when it is not held).
  void removed(std::uint64_t block);

  /// What a reader that has seen `instance`'s events up to `after` gets next: the events after it
  /// (at most `max_events`, `more` set when others follow), or a snapshot (see the file comment).
  [[nodiscard]] worker_api::KvEvents read(std::string_view instance, std::uint64_t after,
                                          std::size_t max_events = kMaxEventsPerRead) const;

  [[nodiscard]] const std::string& instanceId() const { return instance_id_; }
  [[nodiscard]] std::uint64_t lastSeq() const;
  [[nodiscard]] std::size_t heldBlocks() const;

 private:
  void append(bool stored, std::uint64_t block);  // mu_ held

  const std::string instance_id_;
  const std::uint64_t model_hash_;
  const std::int64_t block_size_;
  const std::size_t capacity_;
  mutable std::mutex mu_;
  std::deque<worker_api::KvEvent> events_;  // guarded by mu_: the newest `capacity_`, oldest first
  std::unordered_set<std::uint64_t> held_;  // guarded by mu_
  std::uint64_t seq_ = 0;                   // guarded by mu_: the last event's number
};

/// 16 random hex digits (std::random_device), a fresh one per call.
[[nodiscard]] std::string randomInstanceId();

}  // namespace pd::prefill
