// kv_test_peer: the other process of the cross-process KV transfer tests
// (test_kv_cross_process.cpp). It talks to the test over stdin/stdout, one line per message:
//
// Every mode takes --tls T and --path auto|rma|am (the sender's data path); with --staging 1 the
// transport is the staging path (StagingTransport over UCX, host memory standing in for the
// device).
//   kv_test_peer receive --tls T --tokens N --blocks B --seed S [--model-hash H] [--timeout-ms MS]
//       registers a pool of B blocks, prints "DESCRIPTOR <hex>", waits for the request's record,
//       verifies every byte, prints "RESULT ok" or "RESULT <what went wrong>", and stays up
//       until its stdin closes.
//   kv_test_peer send --tls T --seed S [--model-hash H] [--stall-after-layers K]
//       reads "DESCRIPTOR <hex>" from stdin, puts every layer, finishes, prints "RESULT ...";
//       with --stall-after-layers it puts K layers, prints "POSTED" and hangs (to be killed).
//   kv_test_peer corpus DIR
//       writes a seed corpus of valid wire messages for fuzz_kv_wire.

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <thread>

#include "pd/common/log.h"
#include "pd/kvtransfer/staging_transport.h"
#include "pd/kvtransfer/ucx_transport.h"
#include "unit/kvtransfer/kv_test_util.h"

namespace pd::kvtransfer {
namespace {

using namespace std::chrono_literals;

void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

std::map<std::string, std::string> parseFlags(int argc, char** argv, int first) {
  std::map<std::string, std::string> flags;
  for (int i = first; i + 1 < argc; i += 2) flags[argv[i]] = argv[i + 1];
  return flags;
}

std::uint64_t flagU64(const std::map<std::string, std::string>& flags, const std::string& name,
                      std::uint64_t fallback) {
  const auto it = flags.find(name);
  return it == flags.end() ? fallback : std::stoull(it->second, nullptr, 0);
}

std::unique_ptr<Transport> transport(const std::map<std::string, std::string>& flags, const CompatInfo& compat,
                                     StagingTransportOptions staging) {
  UcxTransportOptions options;
  options.ucx_tls = flags.count("--tls") != 0 ? flags.at("--tls") : "tcp";
  options.data_path = parseKvDataPath(flags.count("--path") != 0 ? flags.at("--path") : "auto").value();
  options.compat = compat;
  options.connect_timeout = testutil::kHangGuard;
  options.spin_time = 50us;
  options.name = "peer";
  auto t = createUcxTransport(options);
  if (!t.ok()) {
    say("RESULT " + t.error().toString());
    std::exit(1);
  }
  if (flagU64(flags, "--staging", 0) == 0) return std::move(t).value();
  auto staged = createStagingTransport(std::move(t).value(), createHostCopier(), std::move(staging));
  if (!staged.ok()) {
    say("RESULT " + staged.error().toString());
    std::exit(1);
  }
  return std::move(staged).value();
}

/// The receiver stays up, its endpoints open, until its stdin closes or it is killed: a receiver
/// that exited right after its record arrived could close the connection before the sender had
/// seen the record's send complete, and the sender would report the delivered transfer as
/// PeerFailed. The test's ChildProcess ends us (SIGKILL, then closes stdin) only in its
/// destructor, after the test's own outcome, so the order holds by construction.
void lingerUntilStdinCloses() {
  std::string line;
  while (std::getline(std::cin, line)) {
  }
}

int receive(const std::map<std::string, std::string>& flags) {
  const CompatInfo compat = testutil::realCompat(flagU64(flags, "--model-hash", 0x5eed));
  const auto tokens = static_cast<std::uint32_t>(flagU64(flags, "--tokens", 130));
  const auto blocks = static_cast<std::uint32_t>(flagU64(flags, "--blocks", 4));
  const auto seed = flagU64(flags, "--seed", 1);
  const auto timeout_ms = static_cast<std::uint32_t>(flagU64(flags, "--timeout-ms", 20000));
  StagingTransportOptions staging;
  staging.receive_blocks = blocks;
  auto t = transport(flags, compat, staging);
  testutil::KvPool pool(*t, compat, blocks);
  const std::uint32_t needed = (tokens + compat.block_size - 1) / compat.block_size;
  auto desc = pool.descriptor(seed, tokens, testutil::shuffledBlocks(blocks, needed, seed), timeout_ms);
  if (!desc.ok()) {
    say("RESULT " + desc.error().toString());
    return 1;
  }
  testutil::Outcomes out;
  if (const Status s = t->expect(seed, Clock::now() + std::chrono::milliseconds(timeout_ms), out.onArrival());
      !s.ok()) {
    say("RESULT " + s.error().toString());
    return 1;
  }
  // The transfer id the descriptor carries is the grant's, drawn here as a decode worker would.
  // The pool's block ids: with staging, the granted descriptor names staging blocks instead.
  const KvDescriptor asked = desc.value();
  desc = t->grant(seed, std::move(desc).value());
  if (!desc.ok()) {
    say("RESULT " + desc.error().toString());
    return 1;
  }
  say("DESCRIPTOR " + testutil::toHex(encode(desc.value())));
  const auto arrived = out.waitArrival(seed, std::chrono::milliseconds(timeout_ms) + 5s);
  if (!arrived) {
    say("RESULT no callback");
    return 1;
  }
  if (!arrived->ok()) {
    say("RESULT " + arrived->error().toString());
    return 0;
  }
  const std::string mismatch = pool.verify(asked, seed);
  say(mismatch.empty() ? fmt::format("RESULT ok first_token={}", arrived->value().first_token)
                       : "RESULT mismatch: " + mismatch);
  lingerUntilStdinCloses();
  return 0;
}

int send(const std::map<std::string, std::string>& flags) {
  const CompatInfo compat = testutil::realCompat(flagU64(flags, "--model-hash", 0x5eed));
  const auto seed = flagU64(flags, "--seed", 1);
  const auto stall_after = flagU64(flags, "--stall-after-layers", 0);
  std::string line;
  if (!std::getline(std::cin, line) || line.rfind("DESCRIPTOR ", 0) != 0) {
    say("RESULT no descriptor on stdin");
    return 1;
  }
  const auto bytes = testutil::fromHex(line.substr(11));
  auto desc = bytes ? decodeKvDescriptor(*bytes) : Result<KvDescriptor>(makeError(ErrorCode::Corrupt, "bad hex"));
  if (!desc.ok()) {
    say("RESULT " + desc.error().toString());
    return 1;
  }
  StagingTransportOptions staging;
  staging.send_bytes = std::uint64_t{compat.num_layers} * desc->num_tokens * compat.tokenBytes();
  auto t = transport(flags, compat, staging);
  testutil::SourceKv source(compat, desc->num_tokens, seed);
  testutil::ScopedRegion src(*t, source.bytes);
  testutil::Outcomes out;
  const TransferId id = desc->transfer_id;
  if (stall_after > 0) {
    // A complete warm-up transfer first (its record is dropped by the receiver as unexpected), so
    // the connection is fully wired up before the test kills us: UCX 1.13 aborts a process whose
    // peer vanishes within the first round trip of a connection (docs/kv-transfer.md, "UCX 1.13").
    KvDescriptor warm = desc.value();
    warm.transfer_id = TransferId{id.hi ^ 1, id.lo ^ 1};
    const bool sent = t->beginTransfer(warm, Clock::now() + 20s, out.onDone()).ok() &&
                      t->finish(CompletionRecord{warm.transfer_id}).ok();
    const auto warm_done = sent ? out.waitDone(warm.transfer_id.lo, 20s) : std::nullopt;
    if (!warm_done || !warm_done->ok()) {
      say("RESULT warm-up failed");
      return 1;
    }
  }
  if (const Status s = t->beginTransfer(desc.value(), Clock::now() + 20s, out.onDone()); !s.ok()) {
    say("RESULT " + s.error().toString());
    return 0;
  }
  auto puts = source.chunkPuts(src.id(), 0, desc->num_tokens);
  if (stall_after > 0) puts.resize(std::min<std::size_t>(puts.size(), stall_after));
  if (const Status s = t->put(id, puts); !s.ok()) {
    say("RESULT " + s.error().toString());
    return 0;
  }
  if (stall_after > 0) {
    say("POSTED");
    std::this_thread::sleep_for(std::chrono::hours(1));  // the test kills us
    return 0;
  }
  CompletionRecord record;
  record.transfer_id = id;
  record.num_tokens = desc->num_tokens;
  record.first_token = 4242;
  if (const Status s = t->finish(record); !s.ok()) {
    say("RESULT " + s.error().toString());
    return 0;
  }
  const auto done = out.waitDone(id.lo, 25s);
  say(!done        ? std::string("RESULT no callback")
      : done->ok() ? std::string("RESULT ok")
                   : "RESULT " + done->error().toString());
  return 0;
}

int corpus(const std::string& dir) {
  int n = 0;
  const auto write = [&](const std::vector<std::uint8_t>& bytes) {
    std::ofstream(fmt::format("{}/seed-{:02d}", dir, n++), std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  };
  CompatInfo compat = testutil::smallCompat();
  KvDescriptor d{TransferId{0x5eed5eed5eed5eedULL, 1}, compat, 10, 1000, {3, 1, 2}, {}};
  d.targets.push_back(KvTarget{0, {1, 2, 3, 4}, {KvRegion{1ULL << 40, 3ULL * 10 * 64, 0, 3, 640, 64, {7, 7}}}});
  write(encode(d));
  d.targets[0].regions = {KvRegion{1ULL << 40, 640, 0, 1, 0, 64, {1}}, KvRegion{1ULL << 41, 1280, 1, 2, 640, 64, {2}}};
  write(encode(d));
  d.present_tokens = 4;  // decode-side prefix reuse: the first block is present (protocol 6)
  write(encode(d));
  CompletionRecord c;
  c.transfer_id = TransferId{0x0123456789abcdefULL, 9};
  c.hidden_state = {1.0F, 2.0F, 3.0F};
  write(encode(c));
  c.first_logprob = TokenLogprob{5, -0.5F};
  c.top_logprobs = {{5, -0.5F}, {6, -1.5F}};
  c.traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  write(encode(c));
  write(encode(FailureRecord{TransferId{3, 3}, 4, ErrorCode::Timeout, "deadline"}));
  return 0;
}

}  // namespace
}  // namespace pd::kvtransfer

int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape): a test helper; an exception aborts it
  pd::log::setLevel(pd::log::Level::Error);
  if (argc < 2) return 2;
  const std::string mode = argv[1];
  if (mode == "receive") return pd::kvtransfer::receive(pd::kvtransfer::parseFlags(argc, argv, 2));
  if (mode == "send") return pd::kvtransfer::send(pd::kvtransfer::parseFlags(argc, argv, 2));
  if (mode == "corpus" && argc == 3) return pd::kvtransfer::corpus(argv[2]);
  return 2;
}
