// prefill_decode_peer: a decode worker's KV receiving side in its own process, for the prefill
// worker's fault tests (test_prefill_worker.cpp), which kill it (SIGKILL) or stop it (SIGSTOP)
// while a real `pdserve prefill` streams into it.
//
//   prefill_decode_peer --model DIR --tokens N --blocks B --block-size S --timeout-ms MS --id ID
//       registers a decode KvPool (F32) on a UCX transport (tcp), expects request ID, prints
//       "DESCRIPTOR <hex of the encoded KvDescriptor>", waits for the record and prints
//       "RESULT ok first_token=T" or "RESULT <error>".

#include <cstdio>
#include <map>
#include <string>

#include "integration/prefill_worker_util.h"
#include "pd/common/log.h"

namespace {

void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape): a test helper; an exception aborts it
  using namespace pd;
  using namespace pd::prefill::testsupport;
  log::setLevel(log::Level::Error);
  std::map<std::string, std::string> flags;
  for (int i = 1; i + 1 < argc; i += 2) flags[argv[i]] = argv[i + 1];
  const auto num = [&](const std::string& name, std::uint64_t fallback) {
    const auto it = flags.find(name);
    return it == flags.end() ? fallback : std::stoull(it->second);
  };
  if (!flags.contains("--model")) {
    say("RESULT --model is required");
    return 2;
  }
  const auto tokens = static_cast<std::uint32_t>(num("--tokens", 40));
  const auto blocks = static_cast<std::uint32_t>(num("--blocks", 64));
  const auto block_size = static_cast<std::uint32_t>(num("--block-size", 16));
  const auto id = num("--id", 1);
  const auto timeout = std::chrono::milliseconds(num("--timeout-ms", 20000));
  auto side = DecodeSide::create(flags.at("--model"), blocks, block_size, DType::F32);
  if (!side.ok()) {
    say("RESULT " + side.error().toString());
    return 1;
  }
  const std::uint32_t needed = (tokens + block_size - 1) / block_size;
  const kvt::KvDescriptor d = (*side)->expect(id, tokens, kvt::testutil::shuffledBlocks(blocks, needed, id), timeout);
  say("DESCRIPTOR " + kvt::testutil::toHex(kvt::encode(d)));
  const auto arrived = (*side)->outcomes().waitArrival(id, timeout + 5s);
  if (!arrived) {
    say("RESULT no callback");
    return 1;
  }
  say(arrived->ok() ? fmt::format("RESULT ok first_token={}", arrived->value().first_token)
                    : "RESULT " + arrived->error().toString());
  return 0;
}
