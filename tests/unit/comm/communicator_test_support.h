#pragma once
// Shared by the communicator tests (test_communicator.cpp: loopback and shm; test_tcp_communicator
// .cpp): the collectives every implementation must get right, and forked ranks.
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "pd/comm/communicator.h"

namespace pd::comm::test {

// Per rank, terms whose sum depends on the order of the additions: in rank order 0, 1, 2, ...
// the 1.0 is absorbed by 1e8 and cancelled, in any other order it survives.
inline float orderSensitiveTerm(int rank, std::size_t i) {
  constexpr std::array<float, 4> kTerms{1.0F, 1.0e8F, -1.0e8F, 0.5F};
  return kTerms[static_cast<std::size_t>(rank) % kTerms.size()] * static_cast<float>(1 + i % 3);
}

// The collectives every implementation must get right, run by rank comm.rank(), and a reduction
// checked bitwise against the rank-order sum. Returns an empty string or the first mismatch.
inline std::string exercise(Communicator& comm, std::size_t big) {
  const int r = comm.rank();
  const int n = comm.size();
  std::vector<float> v(big);
  for (std::size_t i = 0; i < big; ++i) v[i] = static_cast<float>((r + 1) * static_cast<int>(i % 1000 + 1));
  if (Status s = comm.allReduceSum(v); !s.ok()) return "allReduceSum: " + s.error().toString();
  const int tri = n * (n + 1) / 2;
  for (std::size_t i = 0; i < big; ++i) {
    if (v[i] != static_cast<float>(tri * static_cast<int>(i % 1000 + 1))) {
      return "allReduceSum value at " + std::to_string(i);
    }
  }
  std::vector<float> mine(37, static_cast<float>(r) + 0.5F);
  std::vector<float> all(37 * static_cast<std::size_t>(n));
  if (Status s = allGatherFloats(comm, mine, all); !s.ok()) return "allGather: " + s.error().toString();
  for (int q = 0; q < n; ++q) {
    for (std::size_t i = 0; i < 37; ++i) {
      if (all[static_cast<std::size_t>(q) * 37 + i] != static_cast<float>(q) + 0.5F) return "allGather value";
    }
  }
  // broadcast from the last rank (forwarded by rank 0), and a long message from rank 0
  std::vector<std::byte> b(1000, std::byte{0});
  if (r == n - 1) std::fill(b.begin(), b.end(), std::byte{0x5a});
  if (Status s = comm.broadcast(b, n - 1); !s.ok()) return "broadcast: " + s.error().toString();
  for (std::byte x : b) {
    if (x != std::byte{0x5a}) return "broadcast value";
  }
  std::vector<std::byte> msg;
  if (r == 0) msg.assign(big * 3 + 7, std::byte{0x11});
  auto got = broadcastMessage(comm, msg, 0);
  if (!got.ok()) return "broadcastMessage: " + got.error().toString();
  if (got->size() != big * 3 + 7 || (*got)[big] != std::byte{0x11}) return "broadcastMessage value";
  if (Status s = comm.barrier(); !s.ok()) return "barrier: " + s.error().toString();
  // bitwise the rank-order sum, the same on every rank
  std::vector<float> odd(5);
  std::vector<float> expected(odd.size());
  for (std::size_t i = 0; i < odd.size(); ++i) {
    odd[i] = orderSensitiveTerm(r, i);
    expected[i] = orderSensitiveTerm(0, i);
    for (int q = 1; q < n; ++q) expected[i] += orderSensitiveTerm(q, i);
  }
  if (Status s = comm.allReduceSum(odd); !s.ok()) return "allReduceSum: " + s.error().toString();
  if (std::memcmp(odd.data(), expected.data(), odd.size() * sizeof(float)) != 0) return "not the rank-order sum";
  std::vector<float> gathered(odd.size() * static_cast<std::size_t>(n));
  if (Status s = allGatherFloats(comm, odd, gathered); !s.ok()) return "allGather: " + s.error().toString();
  for (int q = 0; q < n; ++q) {
    if (std::memcmp(gathered.data() + static_cast<std::size_t>(q) * odd.size(), odd.data(),
                    odd.size() * sizeof(float)) != 0) {
      return "ranks disagree on a reduction";
    }
  }
  return {};
}

// Forks `n - 1` children that run `child(rank)` and _exit with its result (0 = ok).
template <class F>
std::vector<pid_t> forkRanks(int n, F child) {
  std::vector<pid_t> pids;
  for (int r = 1; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) _exit(child(r));
    pids.push_back(pid);
  }
  return pids;
}

inline int waitExit(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace pd::comm::test
