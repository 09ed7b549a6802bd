// Tensor-parallel processes (tp_worker.h): spawning and joining the local ranks (shm or TCP), and a
// decode follower's pool, transport and serving loop.
#include "pd/decode/tp_worker.h"

#include <fmt/format.h>

#include <csignal>

#include "pd/common/log.h"
#include "pd/common/shm_communicator.h"
#include "pd/common/tcp_communicator.h"
#include "pd/decode/tp_engine.h"
#include "pd/kvtransfer/ucx_transport.h"

namespace pd::decode {

Result<std::unique_ptr<TpProcessGroup>> TpProcessGroup::start(TpGroupOptions options) {
  if (options.size < 2) return makeError(ErrorCode::InvalidArgument, "a tensor-parallel group needs 2 or more ranks");
  const int local = options.local_ranks == 0 ? options.size : options.local_ranks;
  if (local < 1 || options.rank < 0 || options.rank + local > options.size) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("tensor-parallel ranks {}..{} do not fit a group of {}",
                                                             options.rank, options.rank + local - 1, options.size));
  }
  const bool tcp = !options.dist_init_address.empty();
  if (!tcp && (options.rank != 0 || local != options.size)) {
    return makeError(ErrorCode::InvalidArgument, "a group spanning machines needs a rendezvous address");
  }
  if (local > 1 && options.child_argv.empty()) {
    return makeError(ErrorCode::InvalidArgument, "no command line for the spawned ranks");
  }
  std::unique_ptr<TpProcessGroup> group(new TpProcessGroup());
  group->first_child_rank_ = options.rank + 1;
  const std::string shm_name = tcp ? std::string() : comm::uniqueShmName();
  group->description_ = tcp ? "tcp " + options.dist_init_address : "shm " + shm_name;
  const std::string rank_flag = fmt::format("--{}.tp_rank", options.section);
  for (int r = options.rank + 1; r < options.rank + local; ++r) {
    proc::SpawnOptions o;
    o.argv = options.child_argv;
    o.argv.insert(o.argv.end(), {rank_flag, std::to_string(r)});
    if (!tcp) o.argv.insert(o.argv.end(), {fmt::format("--{}.tp_group", options.section), shm_name});
    o.capture_stdout = false;  // a spawned rank prints no READY line; its logs share our stderr
    o.capture_stderr = false;
    PD_ASSIGN_OR_RETURN(std::unique_ptr<proc::Subprocess> child, proc::Subprocess::spawn(o));
    log::info("tp", "started tensor-parallel rank {} (pid {})", r, child->pid());
    group->children_.push_back(std::move(child));
  }
  TpProcessGroup* g = group.get();
  auto while_joining = [g]() { return g->checkLocalRanks(); };
  Result<std::unique_ptr<comm::Communicator>> joined = makeError(ErrorCode::Internal, "not joined");
  if (tcp) {
    comm::TcpOptions to;
    to.address = options.dist_init_address;
    to.rank = options.rank;
    to.size = options.size;
    to.group_key = options.group_key;
    to.join_timeout = options.join_timeout;
    to.while_joining = while_joining;
    to.on_listening = options.on_listening;
    joined = comm::createTcpCommunicator(to);
  } else {
    comm::ShmOptions so;
    so.name = shm_name;
    so.rank = 0;
    so.size = options.size;
    so.join_timeout = options.join_timeout;
    so.inject_latency = options.inject_latency;
    so.while_joining = while_joining;
    joined = comm::createShmCommunicator(so);
  }
  if (!joined.ok()) {
    for (auto& c : group->children_) c->signal(SIGKILL);  // a group that never formed is of no use
    return std::move(joined).error();
  }
  group->comm_ = std::move(joined).value();
  return group;
}

std::vector<std::optional<int>> TpProcessGroup::pollLocalRanks() {
  std::vector<std::optional<int>> out;
  for (auto& c : children_) out.push_back(c->poll());
  return out;
}

Status TpProcessGroup::checkLocalRanks() {
  const std::vector<std::optional<int>> exits = pollLocalRanks();
  for (std::size_t i = 0; i < exits.size(); ++i) {
    if (exits[i]) {
      return makeError(ErrorCode::PeerFailed, fmt::format("tensor-parallel rank {} exited with status {}",
                                                          first_child_rank_ + static_cast<int>(i), *exits[i]));
    }
  }
  return okStatus();
}

TpProcessGroup::~TpProcessGroup() {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (std::size_t i = 0; i < children_.size(); ++i) {
    const int rank = first_child_rank_ + static_cast<int>(i);
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    const std::optional<int> status = children_[i]->wait(std::max(left, std::chrono::milliseconds(0)));
    if (!status) {
      log::warn("tp", "tensor-parallel rank {} did not exit; killing it", rank);
    } else if (*status != 0) {
      log::warn("tp", "tensor-parallel rank {} exited with status {}", rank, *status);
    }
  }
  children_.clear();  // ~Subprocess kills and reaps any still running
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
