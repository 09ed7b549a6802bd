// One request's trace across real `pdserve decode` and `pdserve prefill` processes (real HTTP,
// real UCX), with this test playing the router: it opens the decode stream and submits the
// prefill with traceparents of its own spans, and a small OTLP/HTTP receiver (pd's http::Server,
// support/otlp_receiver.h) collects what both workers export (the same trace through the real
// router: tests/e2e/test_e2e_trace.cpp). The workers are stopped (SIGTERM: their exporters flush on
// the way out) before the spans are checked, so nothing here waits on a timer.
#include <gtest/gtest.h>
#include <signal.h>

#include <boost/json.hpp>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "pd/common/http_client.h"
#include "pd/common/http_server.h"
#include "pd/common/worker_api.h"
#include "pd/trace/trace_context.h"
#include "support/cli_runner.h"
#include "support/otlp_receiver.h"
#include "support/role_process.h"
#include "support/test_files.h"

namespace pd {
namespace {

namespace json = boost::json;
using namespace std::chrono_literals;

const std::string kModel = std::string(PD_TEST_DATA_DIR) + "/golden/tiny-bf16";

using test::OtlpReceiver;
using test::ReceivedSpan;

TEST(TraceAcrossWorkers, OneTraceIdAndParentLinksFromRouterToPrefillAndDecode) {
  OtlpReceiver receiver;
  test::TempDir dir;
  // Both workers also write the same JSON lines file (each line one append).
  const std::string file = (dir.path() / "spans.jsonl").string();
  const std::vector<std::string> trace_flags = {"--trace.otlp_url=" + receiver.url(), "--trace.sample_ratio=0",
                                                "--trace.file=" + file};
  std::vector<std::string> dflags = {"--model.path",           kModel,
                                     "--decode.port=0",        "--decode.threads=1",
                                     "--decode.num_blocks=32", "--decode.block_size=16",
                                     "--log.level=warn"};
  std::vector<std::string> pflags = {
      "--model.path", kModel, "--prefill.port=0", "--prefill.threads=1", "--prefill.chunk_size=16", "--log.level=warn"};
  dflags.insert(dflags.end(), trace_flags.begin(), trace_flags.end());
  pflags.insert(pflags.end(), trace_flags.begin(), trace_flags.end());
  test::RoleProcess decode("decode", dflags);
  test::RoleProcess prefill("prefill", pflags);
  ASSERT_TRUE(decode.ready());
  ASSERT_TRUE(prefill.ready());

  // The "router"'s spans: sample_ratio 0 on the workers, so only the sampled flag these carry
  // makes them record (parent-based sampling).
  const trace::TraceId trace_id = trace::newTraceId();
  const trace::SpanContext decode_leg{trace_id, trace::newSpanId(), trace::kSampledFlag};
  const trace::SpanContext prefill_leg{trace_id, trace::newSpanId(), trace::kSampledFlag};

  std::vector<TokenId> prompt;
  for (int i = 0; i < 40; ++i) prompt.push_back(3 + (i * 7) % 50);
  worker_api::DecodeOpen open;
  open.request_id = "trace-1";
  open.prompt_tokens = static_cast<std::int64_t>(prompt.size());
  open.max_tokens = 6;
  open.ignore_eos = true;
  open.traceparent = trace::formatTraceparent(decode_leg);

  std::promise<worker_api::DecodeEvent> descriptor;
  std::vector<worker_api::DecodeEvent> events;
  std::thread stream([&] {
    http::Client client(decode.host(), decode.port());
    http::ClientRequest req{"POST", std::string(worker_api::kDecodeOpenPath), {}, worker_api::toJson(open)};
    bool first = true;
    auto r = client.streamLines(req, 120s, [&](std::string_view line) {
      auto ev = worker_api::parseDecodeEvent(line);
      if (!ev.ok()) return false;
      if (first) descriptor.set_value(*ev);
      first = false;
      events.push_back(*ev);
      return true;
    });
    if (first) descriptor.set_value({});  // no descriptor: the main thread fails on it
    EXPECT_TRUE(r.ok() && r->status == 200);
  });
  const worker_api::DecodeEvent desc = descriptor.get_future().get();
  ASSERT_EQ(desc.type, worker_api::DecodeEventType::Descriptor);

  worker_api::PrefillSubmit submit;
  submit.request_id = open.request_id;
  submit.token_ids = prompt;
  submit.kv_descriptor = desc.kv_descriptor;
  submit.kv_descriptor_tag = desc.kv_descriptor_tag;
  submit.traceparent = trace::formatTraceparent(prefill_leg);
  http::Client pclient(prefill.host(), prefill.port());
  auto answered = pclient.send({"POST", std::string(worker_api::kPrefillPath), {}, worker_api::toJson(submit)}, 120s);
  ASSERT_TRUE(answered.ok()) << answered.error().toString();
  EXPECT_EQ(answered->status, 200) << answered->body;
  stream.join();
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().type, worker_api::DecodeEventType::Finish);
  EXPECT_EQ(events.back().completion_tokens, 6);

  // Stopping the workers flushes their exporters.
  ASSERT_TRUE(decode.signal(SIGTERM) && prefill.signal(SIGTERM));
  EXPECT_EQ(decode.wait(60s), 0);
  EXPECT_EQ(prefill.wait(60s), 0);

  const auto spans = receiver.spans();
  EXPECT_EQ(receiver.bad_requests(), 0);
  std::map<std::string, const ReceivedSpan*> by_id;
  std::multimap<std::string, const ReceivedSpan*> by_name;
  for (const auto& s : spans) {
    by_id[s.span_id] = &s;
    by_name.emplace(s.name, &s);
    EXPECT_EQ(s.trace_id, trace_id.hex()) << s.name;  // one trace across both processes
    EXPECT_LE(s.start_ns, s.end_ns) << s.name;
    EXPECT_FALSE(s.error) << s.name;
  }
  auto one = [&](const std::string& name) -> const ReceivedSpan& {
    EXPECT_EQ(by_name.count(name), 1u) << name;
    static const ReceivedSpan kNone;
    auto it = by_name.find(name);
    return it == by_name.end() ? kNone : *it->second;
  };
  const ReceivedSpan& p = one("prefill.request");
  const ReceivedSpan& d = one("decode.request");
  EXPECT_EQ(p.service, "pdserve-prefill");
  EXPECT_EQ(d.service, "pdserve-decode");
  EXPECT_EQ(p.parent_span_id, prefill_leg.span_id.hex());
  EXPECT_EQ(d.parent_span_id, decode_leg.span_id.hex());
  for (const char* child : {"prefill.queue", "prefill.compute", "prefill.completion"}) {
    EXPECT_EQ(one(child).parent_span_id, p.span_id) << child;
  }
  for (const char* child : {"decode.admission", "decode.kv_wait", "decode.first_step", "decode.steps"}) {
    EXPECT_EQ(one(child).parent_span_id, d.span_id) << child;
  }
  // The KV completion record carried prefill.completion's context: the decode worker's
  // decode.kv_record is its child (across the processes, without the router) and links
  // decode.request.
  const ReceivedSpan& kv_record = one("decode.kv_record");
  EXPECT_EQ(kv_record.service, "pdserve-decode");
  EXPECT_EQ(kv_record.parent_span_id, one("prefill.completion").span_id);
  ASSERT_EQ(kv_record.links.size(), 1u);
  EXPECT_EQ(kv_record.links[0], std::make_pair(trace_id.hex(), d.span_id));
  EXPECT_GE(kv_record.start_ns, one("prefill.completion").start_ns);
  EXPECT_EQ(by_name.count("decode.preempted"), 0u);  // the pool had room
  // 40 prompt tokens in chunks of 16: three chunks, under prefill.compute, each with its layers.
  EXPECT_EQ(by_name.count("prefill.chunk"), 3u);
  const std::string compute_id = one("prefill.compute").span_id;
  for (auto [it, end] = by_name.equal_range("prefill.chunk"); it != end; ++it) {
    EXPECT_EQ(it->second->parent_span_id, compute_id);
  }
  EXPECT_GE(by_name.count("prefill.layers"), 3u);
  for (auto [it, end] = by_name.equal_range("prefill.layers"); it != end; ++it) {
    auto parent = by_id.find(it->second->parent_span_id);
    ASSERT_NE(parent, by_id.end());
    EXPECT_TRUE(parent->second->name == "prefill.chunk" || parent->second->name == "prefill.mtp");
  }
  // Every parent link resolves: to a span received, or to one of the "router"'s two.
  for (const auto& s : spans) {
    const bool known = by_id.contains(s.parent_span_id) || s.parent_span_id == prefill_leg.span_id.hex() ||
                       s.parent_span_id == decode_leg.span_id.hex();
    EXPECT_TRUE(known) << s.name << " has a dangling parent " << s.parent_span_id;
  }
  // The phases tile each request: their durations sum to the request's (within 5 %).
  const double prefill_phases =
      one("prefill.queue").ms() + one("prefill.compute").ms() + one("prefill.completion").ms();
  EXPECT_NEAR(prefill_phases, p.ms(), 0.05 * p.ms());
  const double decode_phases = one("decode.admission").ms() + one("decode.kv_wait").ms() +
                               one("decode.first_step").ms() + one("decode.steps").ms();
  EXPECT_NEAR(decode_phases, d.ms(), 0.05 * d.ms());
  // pdserve trace reads the file back as one table across both processes.
  const test::CommandResult table = test::pdserve({"trace", open.request_id, "--file", file});
  EXPECT_EQ(table.exit_code, 0) << table.err;
  EXPECT_NE(table.out.find("trace " + trace_id.hex() + ": " + std::to_string(spans.size()) + " spans"),
            std::string::npos)
      << table.out;
  for (const char* s : {"pdserve-prefill", "pdserve-decode", "prefill.request", "  prefill.chunk", "decode.kv_wait"}) {
    EXPECT_NE(table.out.find(s), std::string::npos) << s << "\n" << table.out;
  }
  EXPECT_TRUE(table.err.empty()) << table.err;  // every line of the shared file is whole
  EXPECT_NE(test::pdserve({"trace", "no-such-request", "--file", file}).exit_code, 0);
  std::printf("%s", table.out.c_str());
  std::printf("prefill.request %.3f ms (phases %.3f), decode.request %.3f ms (phases %.3f), %zu spans\n", p.ms(),
              prefill_phases, d.ms(), decode_phases, spans.size());
}

TEST(TraceAcrossWorkers, BadTraceOptionsAreRefusedAtStartup) {
  auto r = test::RoleProcess("prefill",
                             {"--model.path", kModel, "--check-config", "--trace.otlp_url=https://collector:4318"}, 0s);
  EXPECT_EQ(r.wait(60s), 2);
}

}  // namespace
}  // namespace pd
