#pragma once
/// The host Communicator for ranks that are processes on one machine: one POSIX shared-memory
/// segment (/dev/shm/<name>) holding, per rank, two data slots (used alternately by successive
/// collectives) and an arrival counter. A collective copies this rank's data into its slot,
/// publishes the next sequence number and waits (busy-poll for `spin`, then futex) until every
/// rank published it; then each rank reads the slots it needs, summing in rank order. Because a rank reaches
/// collective k+1 only after every rank arrived at k (and so finished reading k-1), the two slot
/// sets never race. Data longer than a slot goes in slot-sized pieces.
///
/// Rank 0 creates the segment (the name must not exist); ranks 1.. open it (waiting for it up
/// to join_timeout). create() returns once every rank joined; rank 0 then unlinks the name, so
/// nothing is left in /dev/shm however the processes end.
///
/// Failure detection: every wait has a deadline (timeout), checks a group-wide abort flag and
/// every 20 ms whether each peer process still runs (/proc/<pid>/stat, zombies count as dead).
/// The first failing rank sets the abort flag, so peers fail within milliseconds.
///
/// Test-only latency injection: ShmOptions::inject_latency delays every message (see there).
///
/// Thread rules: one thread at a time per object (see communicator.h). Move-free; destroy to
/// leave the group (a peer still waiting then sees this process as gone only once it exits).

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "pd/comm/communicator.h"
#include "pd/common/result.h"

namespace pd::comm {

struct ShmOptions {
  std::string name;  ///< shm object name without the leading '/', e.g. "pdserve-tp-1234"
  int rank = 0;
  int size = 1;                                   ///< 1..64
  std::size_t slot_bytes = std::size_t{4} << 20;  ///< per rank and slot; rank 0's value wins
  std::chrono::milliseconds timeout{30000};       ///< deadline of one collective
  /// How long a wait busy-polls before sleeping on a futex (1 ms sleeps): longer is lower latency
  /// on dedicated cores, shorter frees the CPU sooner on a shared machine.
  std::chrono::microseconds spin{1000};
  std::chrono::milliseconds join_timeout{30000};  ///< deadline for every rank to join
  /// Optional, called every few ms while waiting for the other ranks to join: an error (e.g.
  /// "rank 2's process exited") ends the wait at once with that error.
  std::function<Status()> while_joining;
  /// TEST-ONLY (latency experiments, tools/bench/netlat_experiment.sh): every collective step
  /// waits this long before publishing this rank's data, so each message between ranks arrives
  /// `inject_latency` later, as over a network with that one-way latency. 0 (the default) = off;
  /// never set in production.
  std::chrono::microseconds inject_latency{0};
};

/// Creates (rank 0) or joins (others) the group. InvalidArgument for bad options or a size
/// mismatch, Io when the segment cannot be made, Timeout / PeerFailed when ranks do not all join.
Result<std::unique_ptr<Communicator>> createShmCommunicator(const ShmOptions& options);

/// A name unlikely to collide: "pdserve-tp-<pid>-<random>".
std::string uniqueShmName();

}  // namespace pd::comm
