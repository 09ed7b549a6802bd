#pragma once
/// The host Communicator for ranks on different machines (multi-node tensor parallelism,
/// docs/tensor-parallel.md "Across nodes"): TCP connections in a star around rank 0.
///
/// Rendezvous: rank 0 listens on the port of `address` (every interface); ranks 1.. connect to
/// `address` (host:port, a DNS name or an IP), retrying until join_timeout (the leader may start
/// later, its name may not resolve yet), and send a hello (rank, size, group key). Rank 0 accepts
/// until every rank 1..size-1 is connected, refusing (with a reason the peer reports) a hello with
/// another size or group key, a rank out of range or a rank already connected; then it tells
/// every rank that the group is complete and create() returns on every rank.
///
/// Collectives go through rank 0: the other ranks send their data to it, rank 0 combines (sums in
/// rank order 0..size-1, as ShmCommunicator, so every rank gets bitwise the same result; or
/// concatenates) and sends the result back. Every message carries the collective's sequence
/// number and kind; a mismatch (ranks calling different collectives) fails the group.
///
/// Failure detection: every collective has a deadline (timeout); a closed or reset connection is
/// PeerFailed at once; TCP keep-alive (a few seconds) detects a peer whose machine vanished,
/// also while a follower waits without a deadline (broadcastUnbounded). After a failure the rank
/// closes all its connections, so the failure reaches every rank within milliseconds (rank 0
/// closing makes every follower fail; a follower closing makes rank 0 fail and close).
///
/// checkPeers(): whether a connection to a peer (rank 0: every follower; a follower: rank 0) was
/// closed or reset, without reading; safe from any thread while a collective runs.
///
/// Thread rules: one thread at a time per object (see communicator.h), except checkPeers().

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "pd/comm/communicator.h"
#include "pd/common/result.h"

namespace pd::comm {

struct TcpOptions {
  /// host:port of rank 0 ("[v6addr]:port" for IPv6 literals). Rank 0 listens on the port on every
  /// interface; port 0 on rank 0 picks a free one (tests; see on_listening).
  std::string address;
  int rank = 0;
  int size = 1;  ///< 1..1024
  /// Must be equal on every rank (e.g. the model hash): a rank of another group or another model
  /// is refused at the rendezvous.
  std::uint64_t group_key = 0;
  std::chrono::milliseconds timeout{30000};        ///< deadline of one collective
  std::chrono::milliseconds join_timeout{600000};  ///< deadline for every rank to join
  /// Optional, called every few ms while waiting at the rendezvous: an error ends the wait at once
  /// with that error (e.g. a locally spawned rank exited).
  std::function<Status()> while_joining;
  /// Rank 0 only, optional: called with the port it listens on, before waiting for the others.
  std::function<void(int port)> on_listening;
};

struct HostPort {
  std::string host;
  int port = 0;
};

/// Parses "host:port" or "[v6addr]:port" (port 0..65535); InvalidArgument saying what is wrong.
Result<HostPort> parseHostPort(std::string_view address);

/// Creates (rank 0: listens) or joins (others: connects) the group and returns once every rank is
/// connected. InvalidArgument for bad options, Io when rank 0 cannot listen, Timeout when not
/// every rank joined by join_timeout, PeerFailed when rank 0 refused this rank (with its reason)
/// or a peer failed while joining.
Result<std::unique_ptr<Communicator>> createTcpCommunicator(const TcpOptions& options);

}  // namespace pd::comm
