// Tensor-parallel decode processes (tp_worker.h): spawning and joining the followers, and a
// follower's pool, transport and serving loop.
#include "pd/decode/tp_worker.h"

#include <fmt/format.h>

#include <csignal>

#include "pd/common/log.h"
#include "pd/common/shm_communicator.h"
#include "pd/decode/tp_engine.h"
#include "pd/kvtransfer/ucx_transport.h"

namespace pd::decode {

Result<std::unique_ptr<TpLeaderGroup>> TpLeaderGroup::start(int size, std::vector<std::string> follower_argv,
                                                            std::chrono::milliseconds join_timeout,
                                                            std::chrono::microseconds inject_latency) {
  if (size < 2) return makeError(ErrorCode::InvalidArgument, "a tensor-parallel group needs 2 or more ranks");
  if (follower_argv.empty()) return makeError(ErrorCode::InvalidArgument, "no follower command line");
  std::unique_ptr<TpLeaderGroup> group(new TpLeaderGroup());
  group->name_ = comm::uniqueShmName();
  for (int r = 1; r < size; ++r) {
    proc::SpawnOptions o;
    o.argv = follower_argv;
    o.argv.insert(o.argv.end(), {"--decode.tp_rank", std::to_string(r), "--decode.tp_group", group->name_});
    o.capture_stdout = false;  // a follower prints no READY line; its logs share our stderr
    o.capture_stderr = false;
    PD_ASSIGN_OR_RETURN(std::unique_ptr<proc::Subprocess> child, proc::Subprocess::spawn(o));
    log::info("tp", "started tensor-parallel rank {} (pid {})", r, child->pid());
    group->followers_.push_back(std::move(child));
  }
  comm::ShmOptions so;
  so.name = group->name_;
  so.rank = 0;
  so.size = size;
  so.join_timeout = join_timeout;
  so.inject_latency = inject_latency;
  TpLeaderGroup* g = group.get();
  so.while_joining = [g]() -> Status {
    const std::vector<std::optional<int>> exits = g->pollFollowers();
    for (std::size_t i = 0; i < exits.size(); ++i) {
      if (exits[i]) {
        return makeError(ErrorCode::PeerFailed, fmt::format("tensor-parallel rank {} exited with status {} before "
                                                            "joining",
                                                            i + 1, *exits[i]));
      }
    }
    return okStatus();
  };
  auto joined = comm::createShmCommunicator(so);
  if (!joined.ok()) {
    for (auto& f : group->followers_) f->signal(SIGKILL);  // a group that never formed is of no use
    return std::move(joined).error();
  }
  group->comm_ = std::move(joined).value();
  return group;
}

std::vector<std::optional<int>> TpLeaderGroup::pollFollowers() {
  std::vector<std::optional<int>> out;
  for (auto& f : followers_) out.push_back(f->poll());
  return out;
}

TpLeaderGroup::~TpLeaderGroup() {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (std::size_t i = 0; i < followers_.size(); ++i) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    const std::optional<int> status = followers_[i]->wait(std::max(left, std::chrono::milliseconds(0)));
    if (!status) {
      log::warn("tp", "tensor-parallel rank {} did not exit; killing it", i + 1);
    } else if (*status != 0) {
      log::warn("tp", "tensor-parallel rank {} exited with status {}", i + 1, *status);
    }
  }
  followers_.clear();  // ~Subprocess kills and reaps any still running
}

Result<std::unique_ptr<TpFollowerWorker>> TpFollowerWorker::start(std::unique_ptr<model::Engine> engine,
                                                                  comm::Communicator& comm, TpFollowerOptions options) {
  PD_CHECK(engine != nullptr);
  if (comm.rank() == 0) return makeError(ErrorCode::InvalidArgument, "rank 0 is the leader, not a follower");
  std::unique_ptr<TpFollowerWorker> w(new TpFollowerWorker(std::move(engine), comm, std::move(options)));
  const DecodeConfig& cfg = w->options_.decode;
  const DType dtype = cfg.kv_dtype == "f32" ? DType::F32 : DType::BF16;
  PD_ASSIGN_OR_RETURN(KvPool pool, KvPool::create(w->engine_->config(), cfg.num_blocks, cfg.block_size, dtype));
  w->pool_ = std::make_unique<KvPool>(std::move(pool));
  const kvtransfer::CompatInfo compat =
      w->pool_->compat(w->options_.model_hash, static_cast<std::uint32_t>(comm.size()));
  kvtransfer::UcxTransportOptions tx = kvtransfer::ucxOptionsFromConfig(w->options_.kvtransfer, compat);
  tx.name = fmt::format("decode-kv-tp{}", comm.rank());
  PD_ASSIGN_OR_RETURN(w->transport_, kvtransfer::createUcxTransport(tx));
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
  TpFollowerHooks hooks;
  hooks.expect_kv = [this](std::uint64_t id, std::uint32_t timeout_ms) {
    expectUntil(id, kvtransfer::Clock::now() + std::chrono::milliseconds(timeout_ms));
  };
  hooks.cancel_kv = [this](std::uint64_t id) { (void)transport_->cancelExpect(id); };
  return runTpFollower(*engine_, comm_, fixedTpCache(pool_->view()), hooks);
}

void TpFollowerWorker::expectUntil(std::uint64_t id, kvtransfer::Deadline deadline) {
  // The leader's own record decides the request's fate (the sender completes every target's
  // puts before any record goes out). Here a failed prefill attempt only re-arms the
  // expectation (on the transport's thread, as the leader does), so that the next attempt's
  // bytes land; it ends at the deadline or when the leader cancels it.
  const int rank = comm_.rank();
  const Status s = transport_->expect(
      id, deadline, [this, rank, deadline](std::uint64_t rid, Result<kvtransfer::CompletionRecord> r) {
        if (r.ok()) return;
        const ErrorCode code = r.error().code;
        log::debug("tp", "rank {}: KV of request {} did not arrive: {}", rank, rid, r.error().toString());
        if (code != ErrorCode::Timeout && code != ErrorCode::Cancelled) expectUntil(rid, deadline);
      });
  if (!s.ok()) log::warn("tp", "rank {}: cannot expect KV of request {}: {}", rank, id, s.error().toString());
}

}  // namespace pd::decode
