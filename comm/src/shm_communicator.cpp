// The shared-memory Communicator (shm_communicator.h): segment layout, join protocol, and the
// publish / wait / read collective step.
#include "pd/comm/shm_communicator.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <random>
#include <thread>

#include "pd/common/log.h"

namespace pd::comm {
namespace {

constexpr std::uint64_t kMagic = 0x70647470'73686d31ULL;  // "pdtpshm1"
constexpr int kMaxRanks = 64;
constexpr std::size_t kLine = 64;

struct alignas(kLine) RankControl {
  std::atomic<std::uint32_t> seq;      // collectives this rank has published (futex word)
  std::atomic<std::uint32_t> waiters;  // peers sleeping on seq
  std::atomic<std::int32_t> pid;
};

struct alignas(kLine) Header {
  std::atomic<std::uint64_t> magic;  // written last by rank 0
  std::int32_t size;
  std::uint64_t slot_bytes;
  std::atomic<std::uint32_t> joined;
  std::atomic<std::uint32_t> abort;  // any rank failed
  std::atomic<std::int32_t> abort_rank;
  RankControl ranks[kMaxRanks];
};
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

std::size_t segmentBytes(int size, std::size_t slot_bytes) {
  return sizeof(Header) + 2 * static_cast<std::size_t>(size) * slot_bytes;
}

long futex(std::atomic<std::uint32_t>* addr, int op, std::uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(addr), op, value, timeout, nullptr, 0);
}

void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

// Whether process `pid` exists and is not a zombie.
bool processAlive(int pid) {
  if (pid <= 0) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[512];
  const std::size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');  // "pid (comm) S ..."
  if (close == nullptr || close[1] == '\0' || close[2] == '\0') return true;
  return close[2] != 'Z' && close[2] != 'X';
}

bool reached(std::uint32_t seq, std::uint32_t target) {
  return static_cast<std::int32_t>(seq - target) >= 0;
}

class ShmCommunicator final : public Communicator {
 public:
  ShmCommunicator(std::string name, int rank, int size, std::size_t slot_bytes, std::chrono::milliseconds timeout,
                  std::chrono::microseconds spin, void* base, std::size_t bytes, bool unlink_pending,
                  std::chrono::microseconds inject_latency)
      : name_(std::move(name)),
        rank_(rank),
        size_(size),
        slot_bytes_(slot_bytes),
        timeout_(timeout),
        spin_(spin),
        base_(base),
        bytes_(bytes),
        unlink_pending_(unlink_pending),
        inject_latency_(inject_latency) {}

  ShmCommunicator(const ShmCommunicator&) = delete;
  ShmCommunicator& operator=(const ShmCommunicator&) = delete;

  ~ShmCommunicator() override {
    if (unlink_pending_) shm_unlink(("/" + name_).c_str());
    if (munmap(base_, bytes_) != 0)
      log::warn("comm", "munmap of shm segment {} failed: {}", name_, std::strerror(errno));
  }

  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] int size() const override { return size_; }
  [[nodiscard]] std::string kind() const override { return "shm"; }

  // Joins: registers this rank and waits until every rank did.
  Status join(std::chrono::milliseconds join_timeout, const std::function<Status()>& while_joining) {
    RankControl& me = header()->ranks[rank_];
    std::int32_t expected = 0;
    const auto pid = static_cast<std::int32_t>(getpid());
    if (!me.pid.compare_exchange_strong(expected, pid)) {
      if (processAlive(expected)) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("shm group '{}': rank {} is already taken by process {}", name_, rank_, expected));
      }
      me.pid.store(pid);
    }
    header()->joined.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + join_timeout;
    while (static_cast<int>(header()->joined.load()) < size_) {
      if (header()->abort.load() != 0) return makeError(ErrorCode::PeerFailed, "shm group aborted while joining");
      if (std::chrono::steady_clock::now() > deadline) {
        fail();
        return makeError(ErrorCode::Timeout, fmt::format("shm group '{}': only {} of {} ranks joined within {} ms",
                                                         name_, header()->joined.load(), size_, join_timeout.count()));
      }
      if (while_joining) {
        if (Status s = while_joining(); !s.ok()) {
          fail();
          return s;
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (unlink_pending_) {
      shm_unlink(("/" + name_).c_str());
      unlink_pending_ = false;
    }
    return okStatus();
  }

  Status allReduceSum(std::span<float> data) override {
    if (data.empty()) return barrier();
    const std::size_t per = slot_bytes_ / sizeof(float);
    for (std::size_t off = 0; off < data.size(); off += per) {
      const std::size_t n = std::min(per, data.size() - off);
      float* piece = data.data() + off;
      std::memcpy(slot(rank_), piece, n * sizeof(float));
      PD_TRY(step(true));
      std::memcpy(piece, slot(0), n * sizeof(float));
      for (int r = 1; r < size_; ++r) {
        const auto* sr = reinterpret_cast<const float*>(slot(r));
        for (std::size_t i = 0; i < n; ++i) piece[i] += sr[i];
      }
      advance();
    }
    return okStatus();
  }

  Status allGather(std::span<const std::byte> send, std::span<std::byte> recv) override {
    if (recv.size() != send.size() * static_cast<std::size_t>(size_)) {
      return makeError(ErrorCode::InvalidArgument, "allGather: recv must be size() times send");
    }
    for (std::size_t off = 0; off < send.size(); off += slot_bytes_) {
      const std::size_t n = std::min(slot_bytes_, send.size() - off);
      std::memcpy(slot(rank_), send.data() + off, n);
      PD_TRY(step(true));
      for (int r = 0; r < size_; ++r) {
        std::memcpy(recv.data() + static_cast<std::size_t>(r) * send.size() + off, slot(r), n);
      }
      advance();
    }
    return okStatus();
  }

  Status broadcast(std::span<std::byte> data, int root) override { return doBroadcast(data, root, true); }
  Status broadcastUnbounded(std::span<std::byte> data, int root) override { return doBroadcast(data, root, false); }

  Status barrier() override {
    PD_TRY(step(true));
    advance();
    return okStatus();
  }

 private:
  Header* header() const { return static_cast<Header*>(base_); }
  std::byte* slot(int r) const {
    return static_cast<std::byte*>(base_) + sizeof(Header) +
           (static_cast<std::size_t>(op_ & 1U) * static_cast<std::size_t>(size_) + static_cast<std::size_t>(r)) *
               slot_bytes_;
  }

  Status doBroadcast(std::span<std::byte> data, int root, bool bounded) {
    if (root < 0 || root >= size_) return makeError(ErrorCode::InvalidArgument, "broadcast: bad root");
    for (std::size_t off = 0; off < data.size(); off += slot_bytes_) {
      const std::size_t n = std::min(slot_bytes_, data.size() - off);
      if (rank_ == root) std::memcpy(slot(rank_), data.data() + off, n);
      // Only the first piece may wait unbounded: the rest follow at once.
      PD_TRY(step(bounded || rank_ == root || off > 0));
      if (rank_ != root) std::memcpy(data.data() + off, slot(root), n);
      advance();
    }
    return okStatus();
  }

  void advance() { ++op_; }

  void fail() {
    Header* h = header();
    std::int32_t none = -1;
    h->abort_rank.compare_exchange_strong(none, rank_);
    h->abort.store(1);
    for (int r = 0; r < size_; ++r) {
      futex(&h->ranks[r].seq, FUTEX_WAKE, INT32_MAX, nullptr);
    }
    broken_ = true;
  }

  // TEST-ONLY latency injection (ShmOptions::inject_latency): holds this rank's message back
  // before it is published. Sleeps for most of it (frees the CPU), spins the last 100 µs (timer
  // slack would otherwise add ~50-100 µs to every message).
  void injectLatency() const {
    const auto until = std::chrono::steady_clock::now() + inject_latency_;
    const auto slack = std::chrono::microseconds(100);
    if (inject_latency_ > slack) std::this_thread::sleep_for(inject_latency_ - slack);
    while (std::chrono::steady_clock::now() < until) cpuRelax();
  }

  // Publishes arrival at collective op_ and waits until every rank arrived there.
  Status step(bool bounded) {
    if (broken_) return makeError(ErrorCode::PeerFailed, "shm group is broken by an earlier failure");
    if (inject_latency_.count() > 0) injectLatency();
    Header* h = header();
    const std::uint32_t target = op_ + 1;
    RankControl& me = h->ranks[rank_];
    me.seq.store(target, std::memory_order_seq_cst);
    if (me.waiters.load(std::memory_order_seq_cst) != 0) futex(&me.seq, FUTEX_WAKE, INT32_MAX, nullptr);
    const auto start = std::chrono::steady_clock::now();
    auto next_liveness = start + std::chrono::milliseconds(20);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      RankControl& peer = h->ranks[r];
      int spins = 0;
      while (true) {
        const std::uint32_t seen = peer.seq.load(std::memory_order_acquire);
        if (reached(seen, target)) break;
        if (h->abort.load(std::memory_order_relaxed) != 0) {
          broken_ = true;
          return makeError(ErrorCode::PeerFailed,
                           fmt::format("shm group '{}': rank {} failed", name_, h->abort_rank.load()));
        }
        // Spin (a peer in lockstep arrives within microseconds), then sleep on the futex.
        if ((++spins & 255) != 0) {
          cpuRelax();
          continue;
        }
        const auto now = std::chrono::steady_clock::now();
        if (now - start < spin_) continue;
        if (bounded && now - start > timeout_) {
          fail();
          return makeError(ErrorCode::Timeout, fmt::format("shm group '{}': rank {} did not arrive within {} ms", name_,
                                                           r, timeout_.count()));
        }
        if (now >= next_liveness) {
          next_liveness = now + std::chrono::milliseconds(20);
          if (!processAlive(peer.pid.load())) {
            fail();
            return makeError(ErrorCode::PeerFailed,
                             fmt::format("shm group '{}': rank {} (process {}) is gone", name_, r, peer.pid.load()));
          }
        }
        peer.waiters.fetch_add(1, std::memory_order_seq_cst);
        const timespec wait{0, 1'000'000};  // 1 ms: deadlines and liveness are re-checked after it
        if (!reached(peer.seq.load(std::memory_order_seq_cst), target)) futex(&peer.seq, FUTEX_WAIT, seen, &wait);
        peer.waiters.fetch_sub(1, std::memory_order_seq_cst);
      }
    }
    return okStatus();
  }

  std::string name_;
  int rank_;
  int size_;
  std::size_t slot_bytes_;
  std::chrono::milliseconds timeout_;
  std::chrono::microseconds spin_;
  void* base_;
  std::size_t bytes_;
  bool unlink_pending_;
  std::chrono::microseconds inject_latency_;
  std::uint32_t op_ = 0;  // collectives completed
  bool broken_ = false;
};

// Closes a file descriptor on scope exit.
struct FdCloser {
  int fd;
  explicit FdCloser(int owned) : fd(owned) {}
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  ~FdCloser() {
    if (fd >= 0) close(fd);
  }
};

}  // namespace

std::string uniqueShmName() {
  std::random_device rd;
  return fmt::format("pdserve-tp-{}-{:08x}", getpid(), rd());
}

Result<std::unique_ptr<Communicator>> createShmCommunicator(const ShmOptions& o) {
  if (o.size < 1 || o.size > kMaxRanks || o.rank < 0 || o.rank >= o.size) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("shm communicator: rank {} of size {} (size 1..{})", o.rank, o.size, kMaxRanks));
  }
  if (o.name.empty() || o.name.find('/') != std::string::npos || o.name.size() > 200) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("shm communicator: bad segment name '{}'", o.name));
  }
  if (o.inject_latency.count() < 0 || o.inject_latency > std::chrono::seconds(1)) {
    return makeError(ErrorCode::InvalidArgument, "shm communicator: inject_latency must be 0..1 s");
  }
  if (o.slot_bytes < 4096 || o.slot_bytes % kLine != 0) {
    return makeError(ErrorCode::InvalidArgument, "shm communicator: slot_bytes must be a multiple of 64, >= 4096");
  }
  const std::string path = "/" + o.name;
  if (o.rank == 0) {
    const int fd = shm_open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      return makeError(errno == EEXIST ? ErrorCode::InvalidArgument : ErrorCode::Io,
                       fmt::format("shm_open('{}') for creation: {}", path, std::strerror(errno)));
    }
    FdCloser closer{fd};
    const std::size_t bytes = segmentBytes(o.size, o.slot_bytes);
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int err = errno;
      shm_unlink(path.c_str());
      return makeError(ErrorCode::Io, fmt::format("ftruncate('{}', {}): {}", path, bytes, std::strerror(err)));
    }
    void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      const int err = errno;
      shm_unlink(path.c_str());
      return makeError(ErrorCode::Io, fmt::format("mmap('{}'): {}", path, std::strerror(err)));
    }
    auto* h = new (base) Header{};  // the segment starts zeroed; this sets up the atomics
    h->size = o.size;
    h->slot_bytes = o.slot_bytes;
    h->abort_rank.store(-1);
    h->magic.store(kMagic, std::memory_order_release);
    auto comm = std::make_unique<ShmCommunicator>(o.name, 0, o.size, o.slot_bytes, o.timeout, o.spin, base, bytes, true,
                                                  o.inject_latency);
    PD_TRY(comm->join(o.join_timeout, o.while_joining));
    return std::unique_ptr<Communicator>(std::move(comm));
  }

  const auto deadline = std::chrono::steady_clock::now() + o.join_timeout;
  const auto expired = [&] { return std::chrono::steady_clock::now() > deadline; };
  int fd = -1;
  while ((fd = shm_open(path.c_str(), O_RDWR, 0)) < 0) {
    if (errno != ENOENT) return makeError(ErrorCode::Io, fmt::format("shm_open('{}'): {}", path, std::strerror(errno)));
    if (expired()) {
      return makeError(ErrorCode::Timeout,
                       fmt::format("shm group '{}' did not appear within {} ms", o.name, o.join_timeout.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  FdCloser closer{fd};
  struct stat st {};
  while (true) {
    if (fstat(fd, &st) != 0)
      return makeError(ErrorCode::Io, fmt::format("fstat('{}'): {}", path, std::strerror(errno)));
    if (static_cast<std::size_t>(st.st_size) >= sizeof(Header)) break;
    if (expired()) return makeError(ErrorCode::Timeout, fmt::format("shm group '{}' was never sized", o.name));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const auto bytes = static_cast<std::size_t>(st.st_size);
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return makeError(ErrorCode::Io, fmt::format("mmap('{}'): {}", path, std::strerror(errno)));
  auto* h = static_cast<Header*>(base);
  const auto unmap_error = [&](Error e) -> Result<std::unique_ptr<Communicator>> {
    munmap(base, bytes);
    return e;
  };
  while (h->magic.load(std::memory_order_acquire) != kMagic) {
    if (expired())
      return unmap_error(makeError(ErrorCode::Timeout, fmt::format("shm group '{}' never initialized", o.name)));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (h->size != o.size || segmentBytes(h->size, h->slot_bytes) != bytes) {
    return unmap_error(
        makeError(ErrorCode::InvalidArgument,
                  fmt::format("shm group '{}' has size {}, this rank expects {}", o.name, h->size, o.size)));
  }
  auto comm = std::make_unique<ShmCommunicator>(o.name, o.rank, o.size, h->slot_bytes, o.timeout, o.spin, base, bytes,
                                                false, o.inject_latency);
  PD_TRY(comm->join(o.join_timeout, o.while_joining));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace pd::comm
