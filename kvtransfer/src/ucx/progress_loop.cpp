// UcxTransport's progress thread: the loop that progresses the worker, runs commands queued by
// other threads, fires deadlines and sleeps on the worker's fd; and the teardown it runs last.

#include <pthread.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "pd/common/log.h"
#include "ucx/ucx_transport_impl.h"

namespace pd::kvtransfer::detail {

void UcxTransport::wake() {
  const std::uint64_t one = 1;
  if (::write(event_fd_.get(), &one, sizeof(one)) < 0 && errno != EAGAIN) {
    log::warn("kv", "{}: eventfd write: {}", options_.name, std::strerror(errno));
  }
}

bool UcxTransport::runCommands() {
  std::deque<std::function<void()>> batch;
  {
    std::lock_guard lock(mutex_);
    batch.swap(commands_);
  }
  for (auto& command : batch) command();
  return !batch.empty();
}

void UcxTransport::run() {
  const std::string thread_name = (options_.name + "-ucx").substr(0, 15);
  pthread_setname_np(pthread_self(), thread_name.c_str());
  auto last_activity = Clock::now();
  while (!stop_requested_.load()) {
    bool active = runCommands();
    for (int i = 0; i < 64 && ucp_worker_progress(worker_.get()) != 0; ++i) active = true;
    afterProgress();
    const auto now = Clock::now();
    fireDeadlines(now);
    if (active) {
      last_activity = now;
      continue;
    }
    if (now - last_activity < options_.spin_time) continue;
    waitForEvents(now);
  }
  shutdown();
}

Deadline UcxTransport::nextDeadline() const {
  Deadline next = Deadline::max();
  for (const auto& [id, t] : transfers_) {
    next = std::min(next, t->deadline_fired ? t->force_closed_at + kForceCloseGrace : t->deadline);
  }
  for (const auto& [id, e] : expectations_) next = std::min(next, e.deadline);
  for (const auto& [key, peer] : peers_) {
    if (!peer->connected) next = std::min(next, peer->connect_deadline);
  }
  return next;
}

void UcxTransport::waitForEvents(Clock::time_point now) {
  const ucs_status_t st = ucp_worker_arm(worker_.get());
  if (st == UCS_ERR_BUSY) return;  // events are pending: progress again
  std::int64_t timeout_ms = 1000;
  const Deadline next = nextDeadline();
  if (next != Deadline::max()) timeout_ms = std::clamp<std::int64_t>(msUntil(next, now), 0, 1000);
  if (st != UCS_OK) timeout_ms = std::min<std::int64_t>(timeout_ms, 1);  // cannot sleep on the fd: poll
  std::array<epoll_event, 4> events{};
  const int n =
      ::epoll_wait(epoll_fd_.get(), events.data(), static_cast<int>(events.size()), static_cast<int>(timeout_ms));
  for (int i = 0; i < n; ++i) {
    if (events[static_cast<std::size_t>(i)].data.fd == event_fd_.get()) {
      std::uint64_t value = 0;
      while (::read(event_fd_.get(), &value, sizeof(value)) > 0) {
      }
    }
  }
}

void UcxTransport::afterProgress() {
  if (!failed_peers_.empty()) {
    auto failed = std::move(failed_peers_);
    failed_peers_.clear();
    for (const auto& report : failed) {
      // The peer may already be closing or replaced; only a live one is failed.
      const Peer* peer = report.first;
      const auto it =
          std::find_if(peers_.begin(), peers_.end(), [peer](const auto& kv) { return kv.second.get() == peer; });
      if (it == peers_.end()) continue;
      const std::string key = it->first;
      failPeer(key,
               makeError(ErrorCode::PeerFailed,
                         fmt::format("{} failed: {}", it->second->name, ucs_status_string(report.second))),
               false);
    }
  }
  for (auto it = pending_recvs_.begin(); it != pending_recvs_.end();) {
    if (!(*it)->done) {
      ++it;
      continue;
    }
    if ((*it)->status == UCS_OK) {
      inbox_.push_back(InboxRecord{std::move((*it)->bytes), (*it)->data_bytes, (*it)->tag});
    } else {
      metrics_.recordRejected();
      log::warn("kv", "{}: receiving a record failed: {}", options_.name, ucs_status_string((*it)->status));
    }
    it = pending_recvs_.erase(it);
  }
  handleInbox();
  const auto now = Clock::now();
  std::erase_if(closing_, [&](const ClosingPeer& c) {
    if (c.close.empty() || c.close.status() != UCS_INPROGRESS) return true;
    if (now - c.since > kShutdownCloseBound) {
      log::warn("kv", "{}: closing {} did not complete; releasing it", options_.name, c.peer->name);
      return true;
    }
    return false;
  });
  advanceDirty();
}

void UcxTransport::fireDeadlines(Clock::time_point now) {
  std::vector<std::uint64_t> expired;
  for (const auto& [id, e] : expectations_) {
    if (e.deadline <= now) expired.push_back(id);
  }
  for (const auto id : expired) {
    auto node = expectations_.extract(id);
    const Expectation& e = node.mapped();
    metrics_.receiveFailed(ErrorCode::Timeout);
    const std::string what =
        e.held_record
            ? fmt::format("the record arrived but only {} of its {} data bytes", e.bytes_received, e.record_data_bytes)
            : fmt::format("no completion record ({} data bytes arrived)", e.bytes_received);
    log::warn("kv", "{}: request {}: {} within the deadline; releasing its blocks", options_.name, id, what);
    const std::optional<TransferId> granted =
        e.grant ? std::optional<TransferId>(e.grant->id) : std::optional<TransferId>();
    node.mapped().on_arrival(
        id,
        makeError(ErrorCode::Timeout,
                  fmt::format("KV receive of request {}: deadline expired after {} ms: {}", id,
                              std::chrono::duration_cast<std::chrono::milliseconds>(now - e.started).count(), what)));
    if (granted) releaseGrantId(*granted);
  }

  std::vector<std::string> unconnected;
  for (const auto& [key, peer] : peers_) {
    if (!peer->connected && peer->connect_deadline <= now) unconnected.push_back(key);
  }
  for (const auto& key : unconnected) {
    failPeer(key,
             makeError(ErrorCode::PeerFailed,
                       fmt::format("{}: not connected within {} ms", peerName(key), options_.connect_timeout.count())),
             true);
  }

  std::vector<TransferId> late;
  for (const auto& [id, t] : transfers_) {
    if ((!t->deadline_fired && t->deadline <= now) ||
        (t->deadline_fired && now - t->force_closed_at > kForceCloseGrace)) {
      late.push_back(id);
    }
  }
  for (const TransferId& id : late) {
    const auto it = transfers_.find(id);
    if (it == transfers_.end()) continue;
    Transfer& t = *it->second;
    if (t.deadline_fired) {
      // UCX did not complete the requests of a force-closed endpoint: release them unanswered.
      log::error("kv", "{}: transfer {}: {} requests still outstanding after force close; releasing them",
                 options_.name, id, t.ops.size());
      t.ops.clear();
      dirty_.insert(id);
      continue;
    }
    t.deadline_fired = true;
    t.force_closed_at = now;
    const auto budget = std::chrono::round<std::chrono::milliseconds>(t.deadline - t.started).count();
    failTransfer(t, makeError(ErrorCode::Timeout, fmt::format("KV transfer {}: deadline of {} ms expired ({} requests "
                                                              "outstanding)",
                                                              id, budget, t.ops.size())));
    if (!t.ops.empty()) {
      // The transfer waits on the network: the peer is stalled or the link is cut. Cancel by
      // force-closing its endpoints and stop sending to the peer for a while.
      std::vector<std::string> keys;
      keys.reserve(t.links.size());
      for (const auto& link : t.links) keys.push_back(link.key);
      for (const auto& key : keys) {
        failPeer(key,
                 makeError(ErrorCode::PeerFailed,
                           fmt::format("{} is suspect: transfer {} missed its deadline", peerName(key), id)),
                 true);
      }
    }
  }
  if (std::erase_if(suspects_, [&](const auto& s) { return s.second.first <= now; }) > 0) updatePeerGauges();
  advanceDirty();
}

void UcxTransport::drainWorker(Clock::time_point until) {
  // Endpoints UCX created for peers that connected to us may still hold wireup messages; UCX
  // 1.13 aborts in ucp_worker_destroy if one is pending (ucp_request_send_state_ff assertion),
  // so flush the whole worker, bounded, before it is destroyed.
  ucp_request_param_t params{};
  const ucs_status_ptr_t flush = ucp_worker_flush_nbx(worker_.get(), &params);
  if (!UCS_PTR_IS_PTR(flush)) return;
  const ucx::Request request(flush);
  while (request.status() == UCS_INPROGRESS && Clock::now() < until) ucp_worker_progress(worker_.get());
  if (request.status() == UCS_INPROGRESS)
    log::warn("kv", "{}: worker flush did not complete at shutdown", options_.name);
}

void UcxTransport::shutdown() {
  stopping_ = true;
  // Let connections still in wireup finish first (bounded): UCX 1.13 aborts the *peer* process if
  // we vanish while its wireup reply is pending (a spurious assertion in ucp_request_send_state_ff,
  // removed upstream in openucx/ucx#8175).
  const auto wireup_until = Clock::now() + kShutdownCloseBound;
  const auto wiring = [&] {
    return std::any_of(peers_.begin(), peers_.end(), [](const auto& kv) { return !kv.second->probe.empty(); });
  };
  while (wiring() && Clock::now() < wireup_until) ucp_worker_progress(worker_.get());
  for (auto& [id, t] : transfers_) failTransfer(*t, makeError(ErrorCode::Cancelled, "KV transport shutting down"));
  std::vector<std::string> keys;
  keys.reserve(peers_.size());
  for (const auto& [key, peer] : peers_) keys.push_back(key);
  for (const auto& key : keys) failPeer(key, makeError(ErrorCode::Cancelled, "KV transport shutting down"), false);
  for (auto& [id, t] : transfers_) t->ops.clear();
  advanceDirty();
  auto expectations = std::move(expectations_);
  expectations_.clear();
  for (auto& [id, e] : expectations) {
    metrics_.receiveFailed(ErrorCode::Cancelled);
    e.on_arrival(id, makeError(ErrorCode::Cancelled, "KV transport shutting down"));
  }
  granted_ids_.clear();
  const auto start = Clock::now();
  while (!closing_.empty() && Clock::now() - start < kShutdownCloseBound) {
    ucp_worker_progress(worker_.get());
    std::erase_if(closing_, [](const ClosingPeer& c) { return c.close.empty() || c.close.status() != UCS_INPROGRESS; });
  }
  closing_.clear();
  pending_recvs_.clear();
  drainWorker(start + kShutdownCloseBound);
  {
    std::lock_guard lock(mutex_);
    accepting_ = false;
  }
  runCommands();  // commands queued while stopping answer Cancelled
  updatePeerGauges();
}

Status UcxTransport::cancelledStatus() const {
  return makeError(ErrorCode::Cancelled, fmt::format("{}: KV transport is shutting down", options_.name));
}

void UcxTransport::updatePeerGauges() {
  const auto connecting =
      std::count_if(peers_.begin(), peers_.end(), [](const auto& p) { return !p.second->connected; });
  metrics_.setPeers(static_cast<std::int64_t>(peers_.size()), static_cast<std::int64_t>(connecting),
                    static_cast<std::int64_t>(suspects_.size()));
}

}  // namespace pd::kvtransfer::detail
