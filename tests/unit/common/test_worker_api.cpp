// The workers' internal API codecs (worker_api.h): round trips, and refusal of bad input.
#include <gtest/gtest.h>

#include <array>
#include <set>

#include "pd/common/choices.h"
#include "pd/common/worker_api.h"

namespace pd::worker_api {
namespace {

TEST(WorkerApi, Base64RoundTripsEveryLength) {
  std::string bytes;
  for (int n = 0; n < 40; ++n) {
    const std::string encoded = base64Encode(bytes);
    EXPECT_EQ(encoded.size() % 4, 0U);
    auto decoded = base64Decode(encoded);
    ASSERT_TRUE(decoded.ok()) << decoded.error().toString();
    EXPECT_EQ(*decoded, bytes);
    bytes += static_cast<char>((n * 97 + 13) & 0xFF);
  }
  EXPECT_EQ(base64Encode("foob"), "Zm9vYg==");
  EXPECT_EQ(base64Encode("fooba"), "Zm9vYmE=");
}

TEST(WorkerApi, Base64RefusesMalformedText) {
  EXPECT_FALSE(base64Decode("Zm9").ok());       // length
  EXPECT_FALSE(base64Decode("Zm9*").ok());      // alphabet
  EXPECT_FALSE(base64Decode("Zm==Zm9v").ok());  // padding in the middle
  EXPECT_FALSE(base64Decode("Zm9vYh==").ok());  // non-zero padding bits
}

TEST(WorkerApi, DecodeOpenRoundTrips) {
  DecodeOpen v;
  v.request_id = "cmpl-7";
  v.prompt_tokens = 20;
  v.max_tokens = 5;
  v.sampling.temperature = 0.7;
  v.sampling.top_k = 40;
  v.sampling.seed = 0xFFFFFFFFFFFFFFF0ULL;
  v.sampling.top_logprobs = 3;
  v.sampling.min_p = 0.25;
  v.sampling.logit_bias = {{5, -100.0F}, {128000, 2.5F}};
  v.logprobs = true;
  v.stop_token_ids = {1, 2};
  v.ignore_eos = true;
  v.kv_timeout_ms = 1234;
  v.prefill_attempts = 3;
  v.traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  auto back = parseDecodeOpen(toJson(v));
  ASSERT_TRUE(back.ok()) << back.error().toString();
  EXPECT_EQ(back->request_id, v.request_id);
  EXPECT_EQ(back->prompt_tokens, 20);
  EXPECT_EQ(back->max_tokens, 5);
  EXPECT_DOUBLE_EQ(back->sampling.temperature, 0.7);
  EXPECT_EQ(back->sampling.top_k, 40);
  EXPECT_EQ(back->sampling.seed, v.sampling.seed);
  EXPECT_EQ(back->sampling.top_logprobs, 3);
  EXPECT_DOUBLE_EQ(back->sampling.min_p, 0.25);
  EXPECT_EQ(back->sampling.logit_bias, v.sampling.logit_bias);
  EXPECT_TRUE(back->logprobs);
  EXPECT_EQ(back->stop_token_ids, v.stop_token_ids);
  EXPECT_TRUE(back->ignore_eos);
  EXPECT_EQ(back->kv_timeout_ms, 1234);
  EXPECT_EQ(back->prefill_attempts, 3);
  EXPECT_EQ(back->traceparent, v.traceparent);
  // Optional: absent stays empty and is not written.
  v.traceparent.clear();
  EXPECT_EQ(toJson(v).find("traceparent"), std::string::npos);
  EXPECT_TRUE(parseDecodeOpen(toJson(v))->traceparent.empty());
  EXPECT_EQ(toJson(v).find("resumed_token_ids"), std::string::npos);
  EXPECT_TRUE(parseDecodeOpen(toJson(v))->resumed_token_ids.empty());
  // A resumed generation's tokens (docs/kv-memory.md): fewer than the prompt's.
  v.resumed_token_ids = {7, 8, 9};
  v.arrival_us = 1764620000123456;
  back = parseDecodeOpen(toJson(v));
  ASSERT_TRUE(back.ok()) << back.error().toString();
  EXPECT_EQ(back->resumed_token_ids, v.resumed_token_ids);
  EXPECT_EQ(back->arrival_us, v.arrival_us);
  v.resumed_token_ids.assign(20, 3);
  auto too_many = parseDecodeOpen(toJson(v));
  ASSERT_FALSE(too_many.ok());
  EXPECT_NE(too_many.error().message.find("resumed_token_ids"), std::string::npos);
  EXPECT_FALSE(
      parseDecodeOpen(R"({"request_id":"a","prompt_tokens":4,"max_tokens":1,"sampling":{},"resumed_token_ids":[-1]})")
          .ok());
}

// Conditional disaggregation: the prompt's ids for a local prefill, and a resumed leg's forced
// first token, travel in the open (docs/kv-memory.md, "Local prefill").
TEST(WorkerApi, DecodeOpenCarriesALocalPromptAndItsForcedFirstToken) {
  DecodeOpen v;
  v.request_id = "local-1";
  v.prompt_tokens = 4;
  v.max_tokens = 3;
  EXPECT_EQ(toJson(v).find("local_prompt_token_ids"), std::string::npos);
  EXPECT_EQ(toJson(v).find("forced_first_token"), std::string::npos);
  auto plain = parseDecodeOpen(toJson(v));
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->local_prompt_token_ids.empty());
  EXPECT_EQ(plain->forced_first_token, -1);
  v.local_prompt_token_ids = {0, 17, 4, 99};
  v.forced_first_token = 12;
  auto back = parseDecodeOpen(toJson(v));
  ASSERT_TRUE(back.ok()) << back.error().toString();
  EXPECT_EQ(back->local_prompt_token_ids, v.local_prompt_token_ids);
  EXPECT_EQ(back->forced_first_token, 12);
  // The ids must be the whole prompt; a forced first token needs them.
  v.local_prompt_token_ids = {0, 17, 4};
  auto short_prompt = parseDecodeOpen(toJson(v));
  ASSERT_FALSE(short_prompt.ok());
  EXPECT_NE(short_prompt.error().message.find("local_prompt_token_ids"), std::string::npos);
  auto forced_alone =
      parseDecodeOpen(R"({"request_id":"a","prompt_tokens":4,"max_tokens":1,"sampling":{},"forced_first_token":3})");
  ASSERT_FALSE(forced_alone.ok());
  EXPECT_NE(forced_alone.error().message.find("forced_first_token"), std::string::npos);
  EXPECT_FALSE(parseDecodeOpen(R"({"request_id":"a","prompt_tokens":1,"max_tokens":1,"sampling":{},)"
                               R"("local_prompt_token_ids":[1],"forced_first_token":-5})")
                   .ok());
}

// Decode-side prefix reuse: the prompt's token ids for a decode worker with a prefix cache, and
// the status fields that say it has one.
TEST(WorkerApi, DecodeOpenCarriesThePromptsTokenIdsForThePrefixCache) {
  DecodeOpen v;
  v.request_id = "turn-2";
  v.prompt_tokens = 4;
  EXPECT_EQ(toJson(v).find("prompt_token_ids"), std::string::npos);
  v.prompt_token_ids = {5, 6, 7, 8};
  auto back = parseDecodeOpen(toJson(v));
  ASSERT_TRUE(back.ok()) << back.error().toString();
  EXPECT_EQ(back->prompt_token_ids, v.prompt_token_ids);
  // Exactly the prompt; never with a local prompt or an attach.
  for (const char* bad :
       {R"({"request_id":"a","prompt_tokens":4,"max_tokens":1,"sampling":{},"prompt_token_ids":[1,2,3]})",
        R"({"request_id":"a","prompt_tokens":1,"max_tokens":1,"sampling":{},"prompt_token_ids":[1],)"
        R"("local_prompt_token_ids":[1]})",
        R"({"request_id":"a","prompt_tokens":1,"max_tokens":1,"sampling":{},"prompt_token_ids":[1],)"
        R"("attach_to":"p","choice":1})",
        R"({"request_id":"a","prompt_tokens":1,"max_tokens":1,"sampling":{},"prompt_token_ids":[-1]})"}) {
    auto r = parseDecodeOpen(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.error().message.find("prompt_token_ids"), std::string::npos) << r.error().message;
  }
  WorkerStatus st;
  st.role = "decode";
  EXPECT_EQ(toJson(st).find("prefix_cache"), std::string::npos);  // written only with a cache
  st.prefix_cache_blocks = 12;
  st.prefix_cache_capacity = 64;
  auto status = parseWorkerStatus(toJson(st));
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->prefix_cache_blocks, 12);
  EXPECT_EQ(status->prefix_cache_capacity, 64);
  EXPECT_FALSE(parseWorkerStatus(R"({"role":"decode","ready":true,"prefix_cache_capacity":-1})").ok());
}

TEST(WorkerApi, StatusCarriesTheLocalPrefillLimitWhenReported) {
  WorkerStatus st;
  st.role = "decode";
  EXPECT_EQ(toJson(st).find("local_prefill_max_tokens"), std::string::npos);  // -1: not reported
  EXPECT_EQ(parseWorkerStatus(toJson(st))->local_prefill_max_tokens, -1);
  for (const std::int64_t limit : {std::int64_t{0}, std::int64_t{4096}}) {
    st.local_prefill_max_tokens = limit;
    auto status = parseWorkerStatus(toJson(st));
    ASSERT_TRUE(status.ok()) << status.error().toString();
    EXPECT_EQ(status->local_prefill_max_tokens, limit);
  }
  for (const char* bad : {R"({"role":"decode","ready":true,"local_prefill_max_tokens":-1})",
                          R"({"role":"decode","ready":true,"local_prefill_max_tokens":"4"})"}) {
    const auto r = parseWorkerStatus(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.error().message.find("local_prefill_max_tokens"), std::string::npos) << r.error().message;
  }
}

TEST(WorkerApi, DecodeOpenRefusesBadInputNamingTheField) {
  const auto message = [](std::string_view json) {
    auto r = parseDecodeOpen(json);
    EXPECT_FALSE(r.ok());
    return r.ok() ? std::string() : r.error().message;
  };
  EXPECT_NE(message("{").find("malformed JSON"), std::string::npos);
  EXPECT_NE(message("[]").find("object"), std::string::npos);
  EXPECT_NE(message(R"({"prompt_tokens":1,"max_tokens":1,"sampling":{}})").find("request_id"), std::string::npos);
  EXPECT_NE(message(R"({"request_id":"a","prompt_tokens":0,"max_tokens":1,"sampling":{}})").find("prompt_tokens"),
            std::string::npos);
  EXPECT_NE(message(R"({"request_id":"a","prompt_tokens":1,"max_tokens":1.5,"sampling":{}})").find("max_tokens"),
            std::string::npos);
  EXPECT_NE(message(R"({"request_id":"a","prompt_tokens":1,"max_tokens":1,"sampling":{"logit_bias":[[1]]}})")
                .find("logit_bias"),
            std::string::npos);
  EXPECT_NE(message(R"({"request_id":"a","prompt_tokens":1,"max_tokens":1,"sampling":{"logit_bias":[[1,200]]}})")
                .find("logit_bias"),
            std::string::npos);
  EXPECT_NE(message(R"({"request_id":"a","prompt_tokens":1,"max_tokens":1,"sampling":{"top_p":0}})").find("sampling"),
            std::string::npos);
  EXPECT_NE(message(R"({"request_id":"a","prompt_tokens":1,"max_tokens":1,"sampling":{},"stop_token_ids":[-1]})")
                .find("stop_token_ids"),
            std::string::npos);
  EXPECT_NE(message(R"({"request_id":"a","prompt_tokens":1,"max_tokens":1,"sampling":{},"prefill_attempts":0})")
                .find("prefill_attempts"),
            std::string::npos);
  EXPECT_NE(message(R"({"request_id":"","prompt_tokens":1,"max_tokens":1,"sampling":{}})").find("empty"),
            std::string::npos);
  EXPECT_NE(message(R"({"request_id":"a","prompt_tokens":1,"max_tokens":1,"sampling":{},"traceparent":7})")
                .find("traceparent"),
            std::string::npos);
  EXPECT_NE(message(R"({"request_id":"a","prompt_tokens":1,"max_tokens":1,"sampling":{},"traceparent":")" +
                    std::string(200, 'a') + R"("})")
                .find("traceparent"),
            std::string::npos);
}

TEST(WorkerApi, DecodeEventsRoundTrip) {
  DecodeEvent descriptor;
  descriptor.type = DecodeEventType::Descriptor;
  descriptor.kv_descriptor = std::string("PDKV\0\x01\xff", 7);
  descriptor.blocks = 3;
  DecodeEvent tokens;
  tokens.type = DecodeEventType::Tokens;
  tokens.token_ids = {5, 6};
  tokens.logprobs = {{5, -0.5F, {{5, -0.5F}, {9, -1.5F}}}, {6, -0.25F, {}}};
  DecodeEvent finish;
  finish.type = DecodeEventType::Finish;
  finish.finish_reason = pd::FinishReason::Length;
  finish.prompt_tokens = 4;
  finish.completion_tokens = 2;
  DecodeEvent error;
  error.type = DecodeEventType::Error;
  error.code = ErrorCode::Timeout;
  error.message = "KV did not arrive";
  DecodeEvent preempted;
  preempted.type = DecodeEventType::Preempted;
  preempted.code = ErrorCode::Overloaded;
  preempted.message = "the KV pool ran dry";
  preempted.completion_tokens = 12;
  for (const auto* e : {&descriptor, &tokens, &finish, &error, &preempted}) {
    const std::string line = toJson(*e);
    EXPECT_EQ(line.find('\n'), std::string::npos);
    auto back = parseDecodeEvent(line);
    ASSERT_TRUE(back.ok()) << back.error().toString();
    EXPECT_EQ(back->type, e->type);
    EXPECT_EQ(toJson(*back), line);
  }
  auto back = parseDecodeEvent(toJson(tokens));
  ASSERT_TRUE(back.ok());
  ASSERT_EQ(back->logprobs.size(), 2U);
  EXPECT_EQ(back->logprobs[0].top.size(), 2U);
  EXPECT_EQ(back->logprobs[0].top[1].token, 9);
  EXPECT_FLOAT_EQ(back->logprobs[0].top[1].logprob, -1.5F);
  EXPECT_EQ(parseDecodeEvent(toJson(descriptor))->kv_descriptor, descriptor.kv_descriptor);
  EXPECT_EQ(parseDecodeEvent(toJson(error))->code, ErrorCode::Timeout);
  EXPECT_EQ(parseDecodeEvent(toJson(preempted))->completion_tokens, 12);
  EXPECT_EQ(parseDecodeEvent(toJson(preempted))->message, preempted.message);
}

TEST(WorkerApi, DecodeEventRefusesUnknownOrInconsistentEvents) {
  EXPECT_FALSE(parseDecodeEvent(R"({"event":"bogus"})").ok());
  EXPECT_FALSE(parseDecodeEvent(R"({"event":"finish","finish_reason":"abort"})").ok());
  EXPECT_FALSE(parseDecodeEvent(R"({"event":"error","code":"NoSuchCode","message":"x"})").ok());
  EXPECT_FALSE(parseDecodeEvent(R"({"event":"descriptor","kv_descriptor":"@@@@"})").ok());
  EXPECT_FALSE(parseDecodeEvent(R"({"event":"preempted","completion_tokens":-1})").ok());
  EXPECT_FALSE(parseDecodeEvent(R"({"event":"tokens","token_ids":[1,2],"logprobs":[{"token":1,"logprob":0}]})").ok());
}

TEST(WorkerApi, PrefillMessagesRoundTrip) {
  PrefillSubmit s;
  s.request_id = "chatcmpl-1";
  s.token_ids = {0, 1, 2, 65535};
  s.sampling.seed = 9;
  s.logprobs = true;
  s.kv_descriptor = std::string(100, '\x7f');
  s.timeout_ms = 5000;
  s.traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
  auto back = parsePrefillSubmit(toJson(s));
  ASSERT_TRUE(back.ok()) << back.error().toString();
  EXPECT_EQ(back->traceparent, s.traceparent);
  EXPECT_EQ(back->token_ids, s.token_ids);
  EXPECT_EQ(back->kv_descriptor, s.kv_descriptor);
  EXPECT_EQ(back->timeout_ms, 5000);
  EXPECT_EQ(back->sampling.seed, 9U);
  EXPECT_EQ(back->resumed_tokens, 0);
  EXPECT_EQ(toJson(s).find("resumed_tokens"), std::string::npos);
  EXPECT_EQ(back->forced_first_token, -1);
  s.resumed_tokens = 3;
  s.forced_first_token = 42;
  back = parsePrefillSubmit(toJson(s));
  ASSERT_TRUE(back.ok()) << back.error().toString();
  EXPECT_EQ(back->resumed_tokens, 3);
  EXPECT_EQ(back->forced_first_token, 42);
  s.resumed_tokens = 4;  // every token: nothing would be the prompt
  EXPECT_FALSE(parsePrefillSubmit(toJson(s)).ok());
  EXPECT_FALSE(parsePrefillSubmit(R"({"request_id":"a","token_ids":[],"sampling":{},"kv_descriptor":""})").ok());

  PrefillOutcome o{17, 4, 0.5, 12.25, 1.0};
  auto ob = parsePrefillOutcome(toJson(o));
  ASSERT_TRUE(ob.ok());
  EXPECT_EQ(ob->first_token, 17);
  EXPECT_DOUBLE_EQ(ob->compute_ms, 12.25);
  EXPECT_EQ(ob->cached_tokens, 0);
  // The prefix cache's reuse: additive (absent means 0), never above the prompt.
  o.cached_tokens = 4;
  ob = parsePrefillOutcome(toJson(o));
  ASSERT_TRUE(ob.ok());
  EXPECT_EQ(ob->cached_tokens, 4);
  EXPECT_FALSE(parsePrefillOutcome(R"({"first_token":1,"prompt_tokens":4,"cached_tokens":5})").ok());
  EXPECT_FALSE(parsePrefillOutcome(R"({"first_token":1,"prompt_tokens":4,"cached_tokens":-1})").ok());
  EXPECT_FALSE(parsePrefillOutcome(R"({"first_token":1,"prompt_tokens":4,"cached_tokens":"2"})").ok());
}

TEST(WorkerApi, StatusAndErrorsRoundTrip) {
  WorkerStatus st;
  st.role = "decode";
  st.ready = true;
  st.model_hash = "0123456789abcdef";
  st.free_blocks = 10;
  st.total_blocks = 16;
  st.block_size = 64;
  st.drafts_proposed = 1000;
  st.drafts_accepted = 720;
  st.kv_pool_memory = "cuda:3";
  st.kv_cache_dtype = "fp8";
  st.kv_pool_bytes = 35'516'000'000;
  st.kv_transfer_path = "staging";
  auto back = parseWorkerStatus(toJson(st));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->kv_transfer_path, "staging");
  EXPECT_EQ(back->kv_pool_memory, "cuda:3");
  EXPECT_EQ(back->kv_cache_dtype, "fp8");
  EXPECT_EQ(back->kv_pool_bytes, 35'516'000'000);
  EXPECT_EQ(back->free_blocks, 10);
  EXPECT_EQ(back->drafts_proposed, 1000);
  EXPECT_EQ(back->drafts_accepted, 720);
  EXPECT_EQ(back->model_hash, st.model_hash);
  EXPECT_FALSE(back->busy);
  st.ready = false;
  st.busy = true;
  back = parseWorkerStatus(toJson(st));
  ASSERT_TRUE(back.ok());
  EXPECT_FALSE(back->ready);
  EXPECT_TRUE(back->busy);
  // busy is optional: a worker that does not send it is not busy.
  auto older = parseWorkerStatus(R"({"role":"prefill","ready":false})");
  ASSERT_TRUE(older.ok());
  EXPECT_FALSE(older->busy);
  EXPECT_EQ(older->drafts_proposed, 0);
  EXPECT_EQ(older->kv_pool_memory, "");
  EXPECT_EQ(older->kv_pool_bytes, 0);
  EXPECT_FALSE(parseWorkerStatus(R"({"role":"decode","ready":true,"kv_pool_bytes":-5})").ok());
  EXPECT_FALSE(parseWorkerStatus(R"({"role":"decode","ready":true,"kv_pool_memory":7})").ok());
  const std::string long_memory =
      R"({"role":"decode","ready":true,"kv_pool_memory":")" + std::string(100, 'x') + R"("})";
  EXPECT_FALSE(parseWorkerStatus(long_memory).ok());
  EXPECT_EQ(older->kv_transfer_path, "");
  EXPECT_FALSE(parseWorkerStatus(R"({"role":"decode","ready":true,"drafts_accepted":-1})").ok());
  EXPECT_FALSE(parseWorkerStatus(R"({"role":"decode","ready":true,"busy":1})").ok());
  EXPECT_FALSE(parseWorkerStatus(R"({"role":"router","ready":true})").ok());

  const Error e = parseErrorJson(503, errorJson(makeError(ErrorCode::Overloaded, "pool full")));
  EXPECT_EQ(e.code, ErrorCode::Overloaded);
  EXPECT_EQ(e.message, "pool full");
  const Error junk = parseErrorJson(502, "<html>bad gateway</html>");
  EXPECT_EQ(junk.code, ErrorCode::Corrupt);
  EXPECT_NE(junk.message.find("502"), std::string::npos);
  EXPECT_EQ(httpStatusFor(ErrorCode::Overloaded), 503);
  EXPECT_EQ(httpStatusFor(ErrorCode::Timeout), 504);
  EXPECT_EQ(httpStatusFor(ErrorCode::PeerFailed), 502);
  EXPECT_EQ(parseErrorCode("ResourceExhausted"), ErrorCode::ResourceExhausted);
  EXPECT_FALSE(parseErrorCode("nope").has_value());
}

TEST(WorkerApi, HttpStatusTableReadsBackBothWays) {
  constexpr std::array kAll = {ErrorCode::InvalidArgument,   ErrorCode::NotFound,    ErrorCode::Io,
                               ErrorCode::Corrupt,           ErrorCode::Unsupported, ErrorCode::Timeout,
                               ErrorCode::PeerFailed,        ErrorCode::Cancelled,   ErrorCode::Overloaded,
                               ErrorCode::ResourceExhausted, ErrorCode::Internal};
  for (const ErrorCode code : kAll) {
    // A status read back as a code answers with the same status again.
    const int status = httpStatusFor(code);
    EXPECT_EQ(httpStatusFor(errorCodeForHttpStatus(status)), status) << errorCodeName(code);
  }
  EXPECT_EQ(errorCodeForHttpStatus(400), ErrorCode::InvalidArgument);
  EXPECT_EQ(errorCodeForHttpStatus(404), ErrorCode::NotFound);
  EXPECT_EQ(errorCodeForHttpStatus(409), ErrorCode::Cancelled);
  EXPECT_EQ(errorCodeForHttpStatus(503), ErrorCode::Overloaded);
  EXPECT_EQ(errorCodeForHttpStatus(504), ErrorCode::Timeout);
  EXPECT_EQ(errorCodeForHttpStatus(413), ErrorCode::InvalidArgument);
  EXPECT_EQ(errorCodeForHttpStatus(431), ErrorCode::InvalidArgument);
  EXPECT_EQ(errorCodeForHttpStatus(500), ErrorCode::Internal);
  EXPECT_EQ(errorCodeForHttpStatus(599), ErrorCode::Internal);
}

}  // namespace
// The output constraint travels as text in both requests; absent stays empty and is not written;
// a non-string or one over kMaxConstraintBytes is refused naming the field.
TEST(WorkerApi, ConstraintRoundTripsInBothRequestsAndIsSizeLimited) {
  const std::string constraint = R"({"kind":"json_schema","schema":"{\"type\":\"object\"}"})";
  DecodeOpen d;
  d.request_id = "chatcmpl-1";
  d.prompt_tokens = 3;
  d.max_tokens = 4;
  EXPECT_EQ(toJson(d).find("constraint"), std::string::npos);
  EXPECT_EQ(toJson(d).find("tool_call_format"), std::string::npos);
  d.constraint = constraint;
  d.tool_call_format = "deepseek_v31";
  auto db = parseDecodeOpen(toJson(d));
  ASSERT_TRUE(db.ok()) << db.error().toString();
  EXPECT_EQ(db->constraint, constraint);
  EXPECT_EQ(db->tool_call_format, "deepseek_v31");
  PrefillSubmit p;
  p.request_id = "chatcmpl-1";
  p.token_ids = {1, 2, 3};
  p.kv_descriptor = "x";
  p.constraint = constraint;
  p.tool_call_format = "deepseek_v3";
  auto pb = parsePrefillSubmit(toJson(p));
  ASSERT_TRUE(pb.ok()) << pb.error().toString();
  EXPECT_EQ(pb->constraint, constraint);
  EXPECT_EQ(pb->tool_call_format, "deepseek_v3");

  d.constraint = std::string(kMaxConstraintBytes + 1, 'a');
  auto too_long = parseDecodeOpen(toJson(d));
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.error().message.find("constraint"), std::string::npos);
  p.constraint = d.constraint;
  EXPECT_FALSE(parsePrefillSubmit(toJson(p)).ok());
  auto not_text =
      parseDecodeOpen(R"({"request_id":"a","prompt_tokens":1,"max_tokens":1,"sampling":{},"constraint":{}})");
  ASSERT_FALSE(not_text.ok());
  EXPECT_NE(not_text.error().message.find("constraint"), std::string::npos);
  EXPECT_FALSE(
      parseDecodeOpen(R"({"request_id":"a","prompt_tokens":1,"max_tokens":1,"sampling":{},"tool_call_format":")" +
                      std::string(64, 'x') + R"("})")
          .ok());
}

// n > 1: choices on both requests, attach_to + choice on an attached choice's open; absent means
// one choice and is not written; out-of-range counts and inconsistent combinations are refused.
TEST(WorkerApi, ChoicesAndAttachRoundTripAndAreChecked) {
  DecodeOpen d;
  d.request_id = "chatcmpl-1";
  d.prompt_tokens = 3;
  d.max_tokens = 4;
  EXPECT_EQ(toJson(d).find("choices"), std::string::npos);
  EXPECT_EQ(toJson(d).find("attach_to"), std::string::npos);
  d.choices = 3;
  auto db = parseDecodeOpen(toJson(d));
  ASSERT_TRUE(db.ok()) << db.error().toString();
  EXPECT_EQ(db->choices, 3);
  EXPECT_TRUE(db->attach_to.empty());
  DecodeOpen child = d;
  child.request_id = "chatcmpl-1-c2";
  child.choices = 1;
  child.attach_to = "chatcmpl-1";
  child.choice = 2;
  auto cb = parseDecodeOpen(toJson(child));
  ASSERT_TRUE(cb.ok()) << cb.error().toString();
  EXPECT_EQ(cb->attach_to, "chatcmpl-1");
  EXPECT_EQ(cb->choice, 2);
  child.choice = 0;  // choice 0 is the parent's own stream
  EXPECT_FALSE(parseDecodeOpen(toJson(child)).ok());
  child.choice = 1;
  child.choices = 2;  // an attached choice has no choices of its own
  EXPECT_FALSE(parseDecodeOpen(toJson(child)).ok());
  d.choices = pd::kMaxChoices + 1;
  EXPECT_FALSE(parseDecodeOpen(toJson(d)).ok());

  PrefillSubmit p;
  p.request_id = "chatcmpl-1";
  p.token_ids = {1, 2, 3};
  p.kv_descriptor = "x";
  EXPECT_EQ(toJson(p).find("choices"), std::string::npos);
  p.choices = 4;
  auto pb = parsePrefillSubmit(toJson(p));
  ASSERT_TRUE(pb.ok()) << pb.error().toString();
  EXPECT_EQ(pb->choices, 4);
  p.forced_first_token = 5;  // a resumed leg is one choice
  EXPECT_FALSE(parsePrefillSubmit(toJson(p)).ok());
  p.forced_first_token = -1;
  p.choices = 0;
  EXPECT_FALSE(parsePrefillSubmit(toJson(p)).ok());
}

// choiceSeed: choice 0 keeps the seed (the n = 1 answer), the others differ from it and from each
// other, and the derivation is fixed (the value below is part of the documented contract).
TEST(WorkerApi, ChoiceSeedKeepsChoiceZeroAndSpreadsTheOthers) {
  EXPECT_EQ(pd::choiceSeed(42, 0), 42U);
  std::set<std::uint64_t> seen{42};
  for (std::int64_t i = 1; i < 64; ++i) EXPECT_TRUE(seen.insert(pd::choiceSeed(42, i)).second) << i;
  EXPECT_EQ(pd::choiceSeed(0, 1), 0xE220A8397B1DCDAFULL);  // splitmix64's first output for state 0
}

}  // namespace pd::worker_api

namespace pd::worker_api {
namespace {

KvEvents sampleEvents() {
  KvEvents v;
  v.instance_id = "0123456789abcdef";
  v.model_hash = 0xfedcba9876543210ULL;
  v.block_size = 64;
  v.seq = 12;
  v.events = {{10, true, 0xffffffffffffffffULL}, {11, false, 1}, {12, true, 0x8000000000000000ULL}};
  v.more = true;
  return v;
}

TEST(WorkerApi, KvEventsRoundTripWithFullWidthKeys) {
  const KvEvents events = sampleEvents();
  auto parsed = parseKvEvents(toJson(events));
  ASSERT_TRUE(parsed.ok()) << parsed.error().toString();
  EXPECT_EQ(*parsed, events);
  KvEvents snapshot;
  snapshot.instance_id = "w-1";
  snapshot.model_hash = 7;
  snapshot.block_size = 16;
  snapshot.seq = 99;
  snapshot.snapshot = true;
  snapshot.blocks = {0, 5, 0xdeadbeefcafef00dULL};
  auto back = parseKvEvents(toJson(snapshot));
  ASSERT_TRUE(back.ok()) << back.error().toString();
  EXPECT_EQ(*back, snapshot);
}

TEST(WorkerApi, KvEventsRefusesGarbledAnswers) {
  const std::string good = toJson(sampleEvents());
  const auto with = [&](std::string_view from, std::string_view to) {
    std::string s = good;
    const auto at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  EXPECT_TRUE(parseKvEvents(good).ok());
  EXPECT_FALSE(parseKvEvents(with("\"seq\":11", "\"seq\":13")).ok());                            // not consecutive
  EXPECT_FALSE(parseKvEvents(with("\"seq\":12,\"snapshot\"", "\"seq\":14,\"snapshot\"")).ok());  // ends elsewhere
  EXPECT_FALSE(parseKvEvents(with("\"op\":\"removed\"", "\"op\":\"moved\"")).ok());
  EXPECT_FALSE(parseKvEvents(with("\"block\":\"0000000000000001\"", "\"block\":\"1\"")).ok());
  EXPECT_FALSE(parseKvEvents(with("\"block\":\"0000000000000001\"", "\"block\":\"000000000000000g\"")).ok());
  EXPECT_FALSE(parseKvEvents(with("\"block\":\"0000000000000001\"", "\"block\":1")).ok());
  EXPECT_FALSE(parseKvEvents(with("\"block_size\":64", "\"block_size\":0")).ok());
  EXPECT_FALSE(parseKvEvents(with("\"model_hash\":\"fedcba9876543210\"", "\"model_hash\":\"-1\"")).ok());
  EXPECT_FALSE(parseKvEvents(with("\"instance_id\":\"0123456789abcdef\"", "\"instance_id\":\"\"")).ok());
  EXPECT_FALSE(parseKvEvents(with("\"snapshot\":false", "\"snapshot\":true")).ok());  // a snapshot with events
  EXPECT_FALSE(parseKvEvents(with("\"blocks\":[]", "\"blocks\":[\"0000000000000001\"]")).ok());
  EXPECT_FALSE(parseKvEvents("[]").ok());
  EXPECT_FALSE(parseKvEvents("{").ok());
  EXPECT_FALSE(parseKvEvents(good.substr(0, good.size() / 2)).ok());
}

}  // namespace
}  // namespace pd::worker_api
