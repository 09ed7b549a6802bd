// Tensor-parallel processes (tp_worker.h): spawning and joining the local ranks (shm or TCP), and a
// decode follower's pool, transport and serving loop.
#include "pd/decode/tp_worker.h"

#include <fmt/format.h>

#include <csignal>

#include "pd/comm/shm_communicator.h"
#include "pd/comm/tcp_communicator.h"
#include "pd/common/log.h"
#include "pd/engine/tp_engine.h"
#include "pd/kvtransfer/ucx_transport.h"

namespace pd::decode {

Result<std::unique_ptr<TpFollowerWorker>> TpFollowerWorker::start(std::unique_ptr<model::Engine> engine,
                                                                  comm::Communicator& comm, TpFollowerOptions options) {
  PD_CHECK(engine != nullptr);
  if (comm.rank() == 0) return makeError(ErrorCode::InvalidArgument, "rank 0 is the leader, not a follower");
  std::unique_ptr<TpFollowerWorker> w(new TpFollowerWorker(std::move(engine), comm, std::move(options)));
  const DecodeConfig& cfg = w->options_.decode;
  // The pool in the engine's memory, as on the leader (DecodeServer): the CUDA engine's GPU memory,
  // which its steps read and write in place.
  PD_ASSIGN_OR_RETURN(std::unique_ptr<model::CacheMemory> memory,
                      w->engine_->allocateCache(poolBlocks(cfg), cfg.block_size, poolDtype(cfg)));
  PD_ASSIGN_OR_RETURN(KvPool pool, KvPool::create(std::move(memory)));
  w->pool_ = std::make_unique<KvPool>(std::move(pool));
  const kvtransfer::CompatInfo compat =
      w->pool_->compat(w->options_.model_hash, static_cast<std::uint32_t>(comm.size()));
  kvtransfer::UcxTransportOptions tx = kvtransfer::ucxOptionsFromConfig(w->options_.kvtransfer, compat);
  tx.name = fmt::format("decode-kv-tp{}", comm.rank());
  tx.auth = w->options_.auth;
  kvtransfer::inheritLoopbackHost(tx, w->options_.decode.host);
  PD_ASSIGN_OR_RETURN(kvtransfer::KvTransport kv,
                      kvtransfer::createKvTransport(w->options_.kvtransfer, tx, kvtransfer::KvTransportUse::Receive,
                                                    w->pool_->onDevice(), w->pool_->view().device));
  w->transport_ = std::move(kv.transport);
  w->path_ = kv.path;
  log::info("tp", "rank {}: KV pool: {} blocks x {} tokens, {}, in {} memory ({}), KV transfer path {}", comm.rank(),
            w->pool_->numBlocks(), w->pool_->blockSize(), kvDTypeName(w->pool_->dtype()),
            w->pool_->onDevice() ? "GPU" : "host", w->pool_->location(), kvtransfer::kvTransferPathName(w->path_));
  PD_ASSIGN_OR_RETURN(w->region_, w->transport_->registerRegion(w->pool_->memory()));
  w->region_registered_ = true;
  const kvtransfer::RegionLayout layout = w->pool_->regionLayout(w->region_);
  PD_ASSIGN_OR_RETURN(kvtransfer::KvTarget target,
                      w->transport_->exportTarget(static_cast<std::uint32_t>(comm.rank()),
                                                  std::span<const kvtransfer::RegionLayout>(&layout, 1)));
  PD_TRY(exchangeKvTargets(comm, std::move(target)));
  return w;
}

TpFollowerWorker::~TpFollowerWorker() {
  if (region_registered_ && transport_) {
    if (Status s = transport_->deregisterRegion(region_); !s.ok()) {
      log::warn("tp", "deregistering the KV pool: {}", s.error().toString());
    }
  }
  transport_.reset();  // before the pool it wrote into
}

Status TpFollowerWorker::run() {
  model::TpFollowerHooks hooks;
  hooks.expect_kv = [this](std::uint64_t id, std::uint32_t timeout_ms) {
    expectUntil(id, kvtransfer::Clock::now() + std::chrono::milliseconds(timeout_ms));
  };
  hooks.cancel_kv = [this](std::uint64_t id) {
    (void)transport_->cancelExpect(id);
    noteOutcome(id, false);
  };
  hooks.await_kv = [this](std::uint64_t id, std::uint32_t timeout_ms) {
    return awaitLanded(id, std::chrono::milliseconds(timeout_ms));
  };
  hooks.grant_kv = [this](std::uint64_t id, std::span<const std::byte> bytes, std::uint32_t blocks) {
    return grant(id, bytes, blocks);
  };
  return model::runTpFollower(*engine_, comm_, model::fixedTpCache(pool_->view()), hooks);
}

void TpFollowerWorker::expectUntil(std::uint64_t id, kvtransfer::Deadline deadline) {
  // The leader's own record decides the request's fate (the sender completes every target's
  // puts before any record goes out). Here a failed prefill attempt only re-arms the
  // expectation (on the transport's thread, as the leader does), so that the next attempt's
  // bytes land; it ends at the deadline or when the leader cancels it.
  const int rank = comm_.rank();
  {
    std::lock_guard lock(kv_mutex_);
    kv_landed_.try_emplace(id, false);
  }
  const Status s = transport_->expect(
      id, deadline, [this, rank, deadline](std::uint64_t rid, const Result<kvtransfer::CompletionRecord>& r) {
        if (r.ok()) {
          noteOutcome(rid, true);  // in the pool: the staging path copies before it answers
          return;
        }
        const ErrorCode code = r.error().code;
        log::debug("tp", "rank {}: KV of request {} did not arrive: {}", rank, rid, r.error().toString());
        if (code != ErrorCode::Timeout && code != ErrorCode::Cancelled) {
          expectUntil(rid, deadline);
        } else {
          noteOutcome(rid, false);
        }
      });
  if (!s.ok()) {
    log::warn("tp", "rank {}: cannot expect KV of request {}: {}", rank, id, s.error().toString());
    noteOutcome(id, false);
  }
}

void TpFollowerWorker::noteOutcome(std::uint64_t id, bool landed) {
  {
    std::lock_guard lock(kv_mutex_);
    if (landed) {
      if (const auto it = kv_landed_.find(id); it != kv_landed_.end()) it->second = true;
    } else {
      kv_landed_.erase(id);
    }
  }
  kv_changed_.notify_all();
}

bool TpFollowerWorker::awaitLanded(std::uint64_t id, std::chrono::milliseconds timeout) {
  std::unique_lock lock(kv_mutex_);
  const bool settled = kv_changed_.wait_for(lock, timeout, [&] {
    const auto it = kv_landed_.find(id);
    return it == kv_landed_.end() || it->second;
  });
  const auto it = kv_landed_.find(id);
  const bool landed = settled && it != kv_landed_.end() && it->second;
  if (it != kv_landed_.end()) kv_landed_.erase(it);
  if (!landed) log::warn("tp", "rank {}: the KV of request {} is not in this rank's pool", comm_.rank(), id);
  return landed;
}

std::optional<std::vector<std::uint32_t>> TpFollowerWorker::grant(std::uint64_t id, std::span<const std::byte> bytes,
                                                                  std::uint32_t blocks) {
  const int rank = comm_.rank();
  const std::span<const std::uint8_t> raw(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
  Result<kvtransfer::KvDescriptor> descriptor = kvtransfer::decodeKvDescriptor(raw);
  if (!descriptor.ok()) {
    log::error("tp", "rank {}: the leader's KV grant does not decode: {}", rank, descriptor.error().toString());
    return std::nullopt;
  }
  Result<kvtransfer::KvDescriptor> granted = transport_->grant(id, std::move(descriptor).value());
  if (!granted.ok()) {
    // Fail closed: an unconfined expectation would take writes anywhere in this rank's pool.
    log::error("tp", "rank {}: cannot confine the KV of request {}: {}", rank, id, granted.error().toString());
    (void)transport_->cancelExpect(id);
    return std::nullopt;
  }
  // This rank's own target: its staging blocks on the staging path, none of its own otherwise.
  for (const kvtransfer::KvTarget& t : granted->targets) {
    if (t.tp_rank != static_cast<std::uint32_t>(rank) || t.block_ids.empty()) continue;
    if (t.block_ids.size() != blocks) {
      log::error("tp", "rank {}: the KV grant of request {} names {} blocks of its own, not {}", rank, id,
                 t.block_ids.size(), blocks);
      (void)transport_->cancelExpect(id);
      return std::nullopt;
    }
    return t.block_ids;
  }
  return std::vector<std::uint32_t>{};
}

Result<std::vector<kvtransfer::KvTarget>> exchangeKvTargets(comm::Communicator& comm, kvtransfer::KvTarget mine) {
  // Each rank's target travels inside an otherwise empty descriptor (the kvtransfer codec).
  kvtransfer::KvDescriptor own;
  own.targets.push_back(std::move(mine));
  const std::vector<std::uint8_t> own_bytes = kvtransfer::encode(own);
  std::vector<kvtransfer::KvTarget> all;
  for (int r = 0; r < comm.size(); ++r) {
    std::vector<std::byte> message;
    if (r == comm.rank()) {
      message.resize(own_bytes.size());
      std::memcpy(message.data(), own_bytes.data(), own_bytes.size());
    }
    PD_ASSIGN_OR_RETURN(std::vector<std::byte> got, comm::broadcastMessage(comm, std::move(message), r));
    const std::span<const std::uint8_t> raw(reinterpret_cast<const std::uint8_t*>(got.data()), got.size());
    PD_ASSIGN_OR_RETURN(kvtransfer::KvDescriptor d, kvtransfer::decodeKvDescriptor(raw));
    if (d.targets.size() != 1 || d.targets[0].tp_rank != static_cast<std::uint32_t>(r)) {
      return makeError(ErrorCode::Corrupt, fmt::format("rank {} sent a KV target that is not its own", r));
    }
    all.push_back(std::move(d.targets[0]));
  }
  return all;
}

}  // namespace pd::decode
