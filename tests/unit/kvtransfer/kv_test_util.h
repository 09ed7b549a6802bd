#pragma once
// Shared by the kvtransfer tests and their helper process: a decode-side KV pool laid out like
// the real one, a prefill-side source buffer with a seeded pattern that the other process can
// recompute, byte-for-byte verification, and a child process with pipes.
// Thread rules: test code, one thread at a time per object.

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pd/kvtransfer/transport.h"
#include "pd/kvtransfer/wire.h"

namespace pd::kvtransfer::testutil {

/// A fixed transfer id for test request `n` (a real one comes from Transport::grant, which keeps
/// an id the descriptor already carries): `n` is its low half, so tests can still count in ints.
inline TransferId tid(std::uint64_t n) {
  return TransferId{0x7e57'1d00'0000'0000ULL, n};
}

/// Deadline for waits on an event that must happen (a connect, a transfer, an arrival): it exists
/// only to end a hung test, never to order events, so it is long enough for a loaded machine.
inline constexpr std::chrono::seconds kHangGuard{60};
/// kHangGuard as a descriptor's timeout_ms (which caps the sender's deadline).
inline constexpr std::uint32_t kHangGuardMs = 60000;

/// Polls `done` (1 ms apart) until it holds or kHangGuard passes; true if it held.
template <typename Pred>
bool eventually(Pred done) {
  for (const auto until = std::chrono::steady_clock::now() + kHangGuard; !done();) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

inline constexpr std::byte kUntouched{0xEE};

/// Latent KV as DeepSeek-V3 ships it: 61 layers (its main layers; the MTP layer would add one),
/// block size 64, 576 BF16 values per token.
inline CompatInfo realCompat(std::uint64_t model_hash = 0x5eed, std::uint32_t num_layers = 61) {
  CompatInfo c;
  c.model_hash = model_hash;
  c.kv_dtype = DType::BF16;
  c.block_size = 64;
  c.num_layers = num_layers;
  c.kv_dim = 576;
  c.tp_size = 1;
  return c;
}

inline CompatInfo smallCompat(std::uint64_t model_hash = 0x5eed) {
  CompatInfo c;
  c.model_hash = model_hash;
  c.kv_dtype = DType::BF16;
  c.block_size = 4;
  c.num_layers = 3;
  c.kv_dim = 8;
  c.tp_size = 1;
  return c;
}

inline std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// The 8 pattern bytes at `word` (8-byte index) of token `token` of layer `layer`.
inline std::uint64_t patternWord(std::uint64_t seed, std::uint32_t layer, std::uint32_t token, std::uint64_t word) {
  return splitmix(seed ^ (std::uint64_t{layer} << 48) ^ (std::uint64_t{token} << 24) ^ word);
}

/// Prefill side: [num_layers][num_tokens][token_bytes], filled with the seeded pattern.
struct SourceKv {
  CompatInfo compat;
  std::uint32_t num_tokens = 0;
  std::vector<std::byte> bytes;

  SourceKv(const CompatInfo& c, std::uint32_t tokens, std::uint64_t seed) : compat(c), num_tokens(tokens) {
    const std::uint64_t tb = c.tokenBytes();
    bytes.resize(c.num_layers * std::uint64_t{tokens} * tb);
    for (std::uint32_t l = 0; l < c.num_layers; ++l) {
      for (std::uint32_t t = 0; t < tokens; ++t) {
        std::byte* dst = tokenPtr(l, t);
        for (std::uint64_t w = 0; w * 8 < tb; ++w) {
          const std::uint64_t v = patternWord(seed, l, t, w);
          std::memcpy(dst + w * 8, &v, std::min<std::uint64_t>(8, tb - w * 8));
        }
      }
    }
  }
  [[nodiscard]] std::uint64_t layerOffset(std::uint32_t layer) const {
    return std::uint64_t{layer} * num_tokens * compat.tokenBytes();
  }
  std::byte* tokenPtr(std::uint32_t layer, std::uint32_t token) {
    return bytes.data() + layerOffset(layer) + std::uint64_t{token} * compat.tokenBytes();
  }
  /// Puts for tokens [first, first + count) of every layer, read from `region`.
  [[nodiscard]] std::vector<LayerPut> chunkPuts(RegionId region, std::uint32_t first, std::uint32_t count) const {
    std::vector<LayerPut> puts;
    for (std::uint32_t l = 0; l < compat.num_layers; ++l) {
      puts.push_back(
          LayerPut{LayerSlice{l, first, count}, region, layerOffset(l) + std::uint64_t{first} * compat.tokenBytes()});
    }
    return puts;
  }
};

/// Decode side: one registered region [num_layers][num_blocks][block_size][token_bytes],
/// initialised to kUntouched.
class KvPool {
 public:
  KvPool(Transport& transport, const CompatInfo& compat, std::uint32_t num_blocks)
      : transport_(transport), compat_(compat), num_blocks_(num_blocks) {
    bytes_.assign(blockBytes() * num_blocks * compat.num_layers, kUntouched);
    auto id = transport.registerRegion(bytes_);
    if (id.ok()) region_ = id.value();
  }
  ~KvPool() {
    if (region_) (void)transport_.deregisterRegion(*region_);
  }
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;
  KvPool(KvPool&&) = delete;
  KvPool& operator=(KvPool&&) = delete;

  [[nodiscard]] bool registered() const { return region_.has_value(); }
  [[nodiscard]] std::uint64_t blockBytes() const { return std::uint64_t{compat_.block_size} * compat_.tokenBytes(); }
  [[nodiscard]] Result<KvTarget> target(std::uint32_t tp_rank = 0) const {
    const RegionLayout layout{*region_, 0, 0, compat_.num_layers, blockBytes() * num_blocks_, blockBytes()};
    return transport_.exportTarget(tp_rank, std::span(&layout, 1));
  }
  /// A descriptor for `num_tokens` tokens in `block_ids`.
  [[nodiscard]] Result<KvDescriptor> descriptor(std::uint64_t request_id, std::uint32_t num_tokens,
                                                std::vector<std::uint32_t> block_ids, std::uint32_t timeout_ms) const {
    PD_ASSIGN_OR_RETURN(auto t, target());
    KvDescriptor d;
    d.transfer_id = tid(request_id);
    d.compat = compat_;
    d.num_tokens = num_tokens;
    d.timeout_ms = timeout_ms;
    d.block_ids = std::move(block_ids);
    d.targets.push_back(std::move(t));
    return d;
  }
  /// Whether no byte of `block` in `layer` was written.
  [[nodiscard]] bool blockUntouched(std::uint32_t layer, std::uint32_t block) const {
    const std::byte* p = at(layer, block, 0);
    return std::all_of(p, p + blockBytes(), [](std::byte x) { return x == kUntouched; });
  }
  /// Checks every token of the request against the seeded pattern and that every block not in
  /// the request is untouched. Returns an empty string when all is well, else the first mismatch.
  [[nodiscard]] std::string verify(const KvDescriptor& d, std::uint64_t seed) const {
    const std::uint64_t tb = compat_.tokenBytes();
    const std::uint32_t used_blocks = (d.num_tokens + compat_.block_size - 1) / compat_.block_size;
    std::vector<bool> used(num_blocks_, false);
    for (std::uint32_t i = 0; i < used_blocks; ++i) used[d.block_ids[i]] = true;
    std::vector<std::byte> expected(tb);
    for (std::uint32_t l = 0; l < compat_.num_layers; ++l) {
      for (std::uint32_t t = 0; t < d.num_tokens; ++t) {
        for (std::uint64_t w = 0; w * 8 < tb; ++w) {
          const std::uint64_t v = patternWord(seed, l, t, w);
          std::memcpy(expected.data() + w * 8, &v, std::min<std::uint64_t>(8, tb - w * 8));
        }
        const std::byte* got = at(l, d.block_ids[t / compat_.block_size], t % compat_.block_size);
        if (std::memcmp(got, expected.data(), tb) != 0) return fmt::format("layer {} token {} differs", l, t);
      }
      for (std::uint32_t b = 0; b < num_blocks_; ++b) {
        const std::uint32_t first_free_slot =
            used[b]
                ? (b == d.block_ids[used_blocks - 1] ? (d.num_tokens - 1) % compat_.block_size + 1 : compat_.block_size)
                : 0;
        const std::byte* p = at(l, b, first_free_slot);
        const std::byte* end = at(l, b, 0) + blockBytes();
        if (std::any_of(p, end, [](std::byte x) { return x != kUntouched; })) {
          return fmt::format("layer {} block {} was written outside the request", l, b);
        }
      }
    }
    return {};
  }

 private:
  [[nodiscard]] const std::byte* at(std::uint32_t layer, std::uint32_t block, std::uint32_t slot) const {
    return bytes_.data() + (std::uint64_t{layer} * num_blocks_ + block) * blockBytes() +
           std::uint64_t{slot} * compat_.tokenBytes();
  }

  Transport& transport_;
  CompatInfo compat_;
  std::uint32_t num_blocks_;
  std::vector<std::byte> bytes_;
  std::optional<RegionId> region_;
};

/// A registration released on scope exit.
class ScopedRegion {
 public:
  ScopedRegion(Transport& transport, std::span<std::byte> memory) : transport_(transport) {
    auto id = transport.registerRegion(memory);
    if (id.ok()) id_ = id.value();
  }
  ~ScopedRegion() {
    if (id_) (void)transport_.deregisterRegion(*id_);
  }
  ScopedRegion(const ScopedRegion&) = delete;
  ScopedRegion& operator=(const ScopedRegion&) = delete;
  ScopedRegion(ScopedRegion&&) = delete;
  ScopedRegion& operator=(ScopedRegion&&) = delete;
  [[nodiscard]] bool ok() const { return id_.has_value(); }
  [[nodiscard]] RegionId id() const { return *id_; }

 private:
  Transport& transport_;
  std::optional<RegionId> id_;
};

/// Collects transport callbacks (which run on a progress thread) for the test thread.
class Outcomes {
 public:
  TransferDoneFn onDone() {
    return [this](const TransferId& id, Status s) {
      std::lock_guard lock(mutex_);
      done_.insert_or_assign(id.lo, std::move(s));  // tid(n) has n as its low half
      ++done_calls_;
      cv_.notify_all();
    };
  }
  ArrivalFn onArrival() {
    return [this](std::uint64_t id, Result<CompletionRecord> r) {
      std::lock_guard lock(mutex_);
      arrived_.insert_or_assign(id, std::move(r));
      ++arrival_calls_;
      cv_.notify_all();
    };
  }
  std::optional<Status> waitDone(std::uint64_t id, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    if (!cv_.wait_for(lock, timeout, [&] { return done_.contains(id); })) return std::nullopt;
    return done_.at(id);
  }
  std::optional<Result<CompletionRecord>> waitArrival(std::uint64_t id, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    if (!cv_.wait_for(lock, timeout, [&] { return arrived_.contains(id); })) return std::nullopt;
    return arrived_.at(id);
  }
  /// Callbacks so far; every begin/expect must be answered exactly once.
  int doneCalls() {
    std::lock_guard lock(mutex_);
    return done_calls_;
  }
  int arrivalCalls() {
    std::lock_guard lock(mutex_);
    return arrival_calls_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::uint64_t, Status> done_;
  std::map<std::uint64_t, Result<CompletionRecord>> arrived_;
  int done_calls_ = 0;
  int arrival_calls_ = 0;
};

/// `count` distinct block ids out of `num_blocks`, shuffled with `seed` (not contiguous, like a
/// fragmented pool).
inline std::vector<std::uint32_t> shuffledBlocks(std::uint32_t num_blocks, std::uint32_t count, std::uint64_t seed) {
  std::vector<std::uint32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0U);
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(count);
  return ids;
}

inline std::string toHex(std::span<const std::uint8_t> bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const auto b : bytes) out += fmt::format("{:02x}", b);
  return out;
}

inline std::optional<std::vector<std::uint8_t>> fromHex(std::string_view hex) {
  if (hex.size() % 2 != 0) return std::nullopt;
  std::vector<std::uint8_t> out(hex.size() / 2);
  for (std::size_t i = 0; i < out.size(); ++i) {
    unsigned v = 0;
    for (int k = 0; k < 2; ++k) {
      const char c = hex[2 * i + static_cast<std::size_t>(k)];
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= static_cast<unsigned>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v |= static_cast<unsigned>(c - 'a' + 10);
      } else {
        return std::nullopt;
      }
    }
    out[i] = static_cast<std::uint8_t>(v);
  }
  return out;
}

/// A child process (fork + exec) with its stdin and stdout on pipes. Killed on destruction.
class ChildProcess {
 public:
  explicit ChildProcess(const std::vector<std::string>& argv) {
    int in[2];
    int out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) return;
    std::vector<char*> args;
    args.reserve(argv.size() + 1);
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(in[0], STDIN_FILENO);
      ::dup2(out[1], STDOUT_FILENO);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    stdin_ = in[1];
    stdout_ = out[0];
  }
  ~ChildProcess() {
    if (pid_ > 0 && !exited_) {
      ::kill(pid_, SIGCONT);
      ::kill(pid_, SIGKILL);
      (void)wait(std::chrono::seconds(5));
    }
    if (stdin_ >= 0) ::close(stdin_);
    if (stdout_ >= 0) ::close(stdout_);
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ChildProcess(ChildProcess&&) = delete;
  ChildProcess& operator=(ChildProcess&&) = delete;

  [[nodiscard]] bool started() const { return pid_ > 0; }
  [[nodiscard]] pid_t pid() const { return pid_; }

  bool writeLine(const std::string& line) {
    const std::string data = line + "\n";
    return ::write(stdin_, data.data(), data.size()) == static_cast<ssize_t>(data.size());
  }
  /// The next line that starts with `prefix` (other lines are skipped), without the prefix.
  std::optional<std::string> readLine(const std::string& prefix, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      const auto nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
        continue;
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd pfd{stdout_, POLLIN, 0};
      if (::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[65536];
      const ssize_t n = ::read(stdout_, chunk, sizeof(chunk));
      if (n <= 0) return std::nullopt;
      buffer_.append(chunk, static_cast<std::size_t>(n));
    }
  }
  void signal(int sig) const { ::kill(pid_, sig); }
  /// Waits for exit; the exit status, or nullopt on timeout.
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        return status;
      }
      if (std::chrono::steady_clock::now() > deadline) return std::nullopt;
      ::usleep(2000);
    }
  }

 private:
  pid_t pid_ = -1;
  int stdin_ = -1;
  int stdout_ = -1;
  bool exited_ = false;
  std::string buffer_;
};

}  // namespace pd::kvtransfer::testutil
