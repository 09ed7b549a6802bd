// The rank process group (process_group.h): spawning and joining the local ranks (shm or TCP).
#include "pd/comm/process_group.h"

#include <fmt/format.h>

#include <algorithm>
#include <csignal>

#include "pd/comm/shm_communicator.h"
#include "pd/comm/tcp_communicator.h"
#include "pd/common/log.h"

namespace pd::comm {

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
  const std::string shm_name = tcp ? std::string() : uniqueShmName();
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
  Result<std::unique_ptr<Communicator>> joined = makeError(ErrorCode::Internal, "not joined");
  if (tcp) {
    TcpOptions to;
    to.address = options.dist_init_address;
    to.rank = options.rank;
    to.size = options.size;
    to.group_key = options.group_key;
    to.join_timeout = options.join_timeout;
    to.while_joining = while_joining;
    to.on_listening = options.on_listening;
    joined = createTcpCommunicator(to);
  } else {
    ShmOptions so;
    so.name = shm_name;
    so.rank = 0;
    so.size = options.size;
    so.join_timeout = options.join_timeout;
    so.inject_latency = options.inject_latency;
    so.while_joining = while_joining;
    joined = createShmCommunicator(so);
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
  out.reserve(children_.size());
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

}  // namespace pd::comm
