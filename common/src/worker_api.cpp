// Codecs of the workers' internal API messages (worker_api.h, docs/internal-api.md).
#include "pd/common/worker_api.h"

#include <array>
#include <boost/json.hpp>
#include <cmath>
#include <limits>

#include "pd/common/choices.h"
#include "pd/common/prefix_hash.h"

namespace pd::worker_api {

namespace json = boost::json;

namespace {

// Reads typed fields out of one JSON object; the first problem is kept and reported by status().
class Reader {
 public:
  Reader(const json::object& object, std::string_view what) : object_(object), what_(what) {}

  // Absent: keeps the default unless `required`.
  void str(std::string_view key, std::string& out, bool required = true, std::size_t max_bytes = kMaxIdBytes) {
    const json::value* v = find(key, required);
    if (v == nullptr) return;
    const auto* s = v->if_string();
    if (s == nullptr) return fail(key, "must be a string");
    if (s->size() > max_bytes) return fail(key, "is too long");
    out.assign(s->data(), s->size());
  }
  void integer(std::string_view key, std::int64_t& out, bool required, std::int64_t lo,
               std::int64_t hi = std::numeric_limits<std::int64_t>::max()) {
    const json::value* v = find(key, required);
    if (v == nullptr) return;
    std::int64_t value = 0;
    if (const auto* i = v->if_int64()) {
      value = *i;
    } else if (const auto* u = v->if_uint64()) {
      if (*u > static_cast<std::uint64_t>(hi)) return fail(key, "is out of range");
      value = static_cast<std::int64_t>(*u);
    } else {
      return fail(key, "must be an integer");
    }
    if (value < lo || value > hi) return fail(key, "is out of range");
    out = value;
  }
  void unsignedInt(std::string_view key, std::uint64_t& out, bool required) {
    const json::value* v = find(key, required);
    if (v == nullptr) return;
    if (const auto* u = v->if_uint64()) {
      out = *u;
    } else if (const auto* i = v->if_int64(); i != nullptr && *i >= 0) {
      out = static_cast<std::uint64_t>(*i);
    } else {
      fail(key, "must be a non-negative integer");
    }
  }
  void number(std::string_view key, double& out, bool required) {
    const json::value* v = find(key, required);
    if (v == nullptr) return;
    if (const auto* d = v->if_double()) {
      out = *d;
    } else if (const auto* i = v->if_int64()) {
      out = static_cast<double>(*i);
    } else if (const auto* u = v->if_uint64()) {
      out = static_cast<double>(*u);
    } else {
      return fail(key, "must be a number");
    }
    if (!std::isfinite(out)) fail(key, "must be finite");
  }
  void boolean(std::string_view key, bool& out, bool required) {
    const json::value* v = find(key, required);
    if (v == nullptr) return;
    const auto* b = v->if_bool();
    if (b == nullptr) return fail(key, "must be true or false");
    out = *b;
  }
  void tokenIds(std::string_view key, std::vector<pd::TokenId>& out, bool required) {
    const json::value* v = find(key, required);
    if (v == nullptr) return;
    const auto* a = v->if_array();
    if (a == nullptr) return fail(key, "must be an array of token ids");
    out.clear();
    out.reserve(a->size());
    for (const auto& e : *a) {
      const auto* i = e.if_int64();
      if (i == nullptr || *i < 0 || *i > std::numeric_limits<pd::TokenId>::max()) {
        return fail(key, "must hold token ids (integers in [0, 2^31))");
      }
      out.push_back(static_cast<pd::TokenId>(*i));
    }
  }
  const json::object* object(std::string_view key, bool required) {
    const json::value* v = find(key, required);
    if (v == nullptr) return nullptr;
    const auto* o = v->if_object();
    if (o == nullptr) fail(key, "must be an object");
    return o;
  }
  const json::array* array(std::string_view key, bool required) {
    const json::value* v = find(key, required);
    if (v == nullptr) return nullptr;
    const auto* a = v->if_array();
    if (a == nullptr) fail(key, "must be an array");
    return a;
  }
  void fail(std::string_view key, std::string_view why) {
    if (!error_) error_ = makeError(ErrorCode::InvalidArgument, fmtField(key) + " " + std::string(why));
  }
  [[nodiscard]] bool ok() const { return !error_.has_value(); }
  [[nodiscard]] Status status() const { return error_ ? Status(*error_) : okStatus(); }

 private:
  const json::value* find(std::string_view key, bool required) {
    if (error_) return nullptr;
    const json::value* v = object_.if_contains(key);
    if (v == nullptr && required) fail(key, "is missing");
    return v;
  }
  [[nodiscard]] std::string fmtField(std::string_view key) const { return std::string(what_) + "." + std::string(key); }

  const json::object& object_;
  std::string_view what_;
  std::optional<Error> error_;
};

Result<json::object> parseObject(std::string_view text, std::string_view what) {
  json::error_code ec;
  json::value v = json::parse(text, ec);
  if (ec) return makeError(ErrorCode::InvalidArgument, std::string(what) + ": malformed JSON (" + ec.message() + ")");
  auto* o = v.if_object();
  if (o == nullptr) return makeError(ErrorCode::InvalidArgument, std::string(what) + ": must be a JSON object");
  return std::move(*o);
}

json::object samplingJson(const pd::SamplingParams& s) {
  json::object o{{"temperature", s.temperature},
                 {"top_k", s.top_k},
                 {"top_p", s.top_p},
                 {"min_p", s.min_p},
                 {"presence_penalty", s.presence_penalty},
                 {"frequency_penalty", s.frequency_penalty},
                 {"seed", s.seed},
                 {"top_logprobs", s.top_logprobs}};
  if (!s.logit_bias.empty()) {
    json::array bias;  // [[token, bias], ...]
    for (const auto& b : s.logit_bias) bias.push_back(json::array{b.token, static_cast<double>(b.bias)});
    o["logit_bias"] = std::move(bias);
  }
  return o;
}

void readSampling(Reader& parent, pd::SamplingParams& out) {
  const json::object* o = parent.object("sampling", true);
  if (o == nullptr) return;
  Reader r(*o, "sampling");
  r.number("temperature", out.temperature, false);
  r.integer("top_k", out.top_k, false, 0);
  r.number("top_p", out.top_p, false);
  r.number("min_p", out.min_p, false);
  r.number("presence_penalty", out.presence_penalty, false);
  r.number("frequency_penalty", out.frequency_penalty, false);
  r.unsignedInt("seed", out.seed, false);
  r.integer("top_logprobs", out.top_logprobs, false, 0, 20);
  if (const json::array* bias = r.array("logit_bias", false); bias != nullptr) {
    if (bias->size() > pd::kMaxLogitBias) {
      parent.fail("sampling", "is invalid: too many logit_bias entries");
      return;
    }
    for (const auto& e : *bias) {
      const auto* pair = e.if_array();
      if (pair == nullptr || pair->size() != 2 || !(*pair)[0].is_int64() || !(*pair)[1].is_number() ||
          (*pair)[0].get_int64() < 0 || (*pair)[0].get_int64() > INT32_MAX) {
        parent.fail("sampling", "is invalid: logit_bias entries must be [token id, bias]");
        return;
      }
      out.logit_bias.push_back(
          {static_cast<pd::TokenId>((*pair)[0].get_int64()), static_cast<float>((*pair)[1].to_number<double>())});
    }
  }
  if (!r.ok()) {
    const Status s = r.status();
    parent.fail("sampling", "is invalid: " + s.error().message);
    return;
  }
  if (auto valid = pd::validate(out); !valid.ok()) parent.fail("sampling", "is invalid: " + valid.error().message);
}

std::string dump(const json::object& v) {
  return json::serialize(v);
}

json::array logprobsJson(const std::vector<pd::SampledToken>& logprobs) {
  json::array out;
  out.reserve(logprobs.size());
  for (const auto& lp : logprobs) {
    json::array top;
    for (const auto& t : lp.top) top.push_back(json::object{{"token", t.token}, {"logprob", t.logprob}});
    out.push_back(json::object{{"token", lp.token}, {"logprob", lp.logprob}, {"top", std::move(top)}});
  }
  return out;
}

Status readLogprobs(const json::array& array, std::vector<pd::SampledToken>& out) {
  const auto bad = [] { return makeError(ErrorCode::InvalidArgument, "event.logprobs: malformed entry"); };
  const auto read_pair = [](const json::value& v, pd::TokenId& token, float& logprob) {
    const auto* o = v.if_object();
    if (o == nullptr) return false;
    const auto* t = o->if_contains("token");
    const auto* l = o->if_contains("logprob");
    if (t == nullptr || l == nullptr || !t->is_int64() || !l->is_number()) return false;
    const std::int64_t id = t->get_int64();
    if (id < 0 || id > std::numeric_limits<pd::TokenId>::max()) return false;
    token = static_cast<pd::TokenId>(id);
    logprob = static_cast<float>(l->to_number<double>());
    return true;
  };
  for (const auto& e : array) {
    pd::SampledToken lp;
    if (!read_pair(e, lp.token, lp.logprob)) return bad();
    const auto* top = e.as_object().if_contains("top");
    if (top != nullptr) {
      const auto* a = top->if_array();
      if (a == nullptr) return bad();
      for (const auto& t : *a) {
        pd::TokenLogprob alt;
        if (!read_pair(t, alt.token, alt.logprob)) return bad();
        lp.top.push_back(alt);
      }
    }
    out.push_back(std::move(lp));
  }
  return okStatus();
}

}  // namespace

std::string toJson(const DecodeOpen& v) {
  json::array stops;
  for (auto id : v.stop_token_ids) stops.push_back(id);
  json::object o{{"request_id", v.request_id},
                 {"prompt_tokens", v.prompt_tokens},
                 {"max_tokens", v.max_tokens},
                 {"sampling", samplingJson(v.sampling)},
                 {"logprobs", v.logprobs},
                 {"stop_token_ids", std::move(stops)},
                 {"ignore_eos", v.ignore_eos},
                 {"kv_timeout_ms", v.kv_timeout_ms},
                 {"prefill_attempts", v.prefill_attempts}};
  if (!v.traceparent.empty()) o["traceparent"] = v.traceparent;
  if (!v.resumed_token_ids.empty()) {
    json::array resumed;
    resumed.reserve(v.resumed_token_ids.size());
    for (auto id : v.resumed_token_ids) resumed.push_back(id);
    o["resumed_token_ids"] = std::move(resumed);
  }
  if (v.arrival_us > 0) o["arrival_us"] = v.arrival_us;
  if (!v.constraint.empty()) o["constraint"] = v.constraint;
  if (!v.tool_call_format.empty()) o["tool_call_format"] = v.tool_call_format;
  if (!v.local_prompt_token_ids.empty()) {
    json::array local;
    local.reserve(v.local_prompt_token_ids.size());
    for (auto id : v.local_prompt_token_ids) local.push_back(id);
    o["local_prompt_token_ids"] = std::move(local);
  }
  if (v.forced_first_token >= 0) o["forced_first_token"] = v.forced_first_token;
  if (v.choices != 1) o["choices"] = v.choices;
  if (!v.attach_to.empty()) {
    o["attach_to"] = v.attach_to;
    o["choice"] = v.choice;
  }
  if (!v.prompt_token_ids.empty()) {
    json::array ids;
    ids.reserve(v.prompt_token_ids.size());
    for (auto id : v.prompt_token_ids) ids.push_back(id);
    o["prompt_token_ids"] = std::move(ids);
  }
  return dump(o);
}

Result<DecodeOpen> parseDecodeOpen(std::string_view text) {
  auto object = parseObject(text, "decode request");
  if (!object.ok()) return object.error();
  DecodeOpen v;
  Reader r(*object, "decode request");
  r.str("request_id", v.request_id);
  if (r.ok() && v.request_id.empty()) r.fail("request_id", "must not be empty");
  r.integer("prompt_tokens", v.prompt_tokens, true, 1);
  r.integer("max_tokens", v.max_tokens, true, 1);
  readSampling(r, v.sampling);
  r.boolean("logprobs", v.logprobs, false);
  r.tokenIds("stop_token_ids", v.stop_token_ids, false);
  r.boolean("ignore_eos", v.ignore_eos, false);
  r.integer("kv_timeout_ms", v.kv_timeout_ms, false, 1, std::int64_t{24} * 3600 * 1000);
  r.integer("prefill_attempts", v.prefill_attempts, false, 1, 100);
  r.str("traceparent", v.traceparent, false, kMaxTraceparentBytes);
  r.tokenIds("resumed_token_ids", v.resumed_token_ids, false);
  r.integer("arrival_us", v.arrival_us, false, 0);
  if (r.ok() && static_cast<std::int64_t>(v.resumed_token_ids.size()) >= v.prompt_tokens) {
    r.fail("resumed_token_ids", "must be fewer than prompt_tokens");
  }
  r.str("constraint", v.constraint, false, kMaxConstraintBytes);
  r.str("tool_call_format", v.tool_call_format, false, kMaxToolCallFormatBytes);
  r.tokenIds("local_prompt_token_ids", v.local_prompt_token_ids, false);
  if (r.ok() && !v.local_prompt_token_ids.empty() &&
      static_cast<std::int64_t>(v.local_prompt_token_ids.size()) != v.prompt_tokens) {
    r.fail("local_prompt_token_ids", "must hold prompt_tokens token ids");
  }
  std::int64_t forced = -1;
  r.integer("forced_first_token", forced, false, 0, std::numeric_limits<pd::TokenId>::max());
  v.forced_first_token = static_cast<pd::TokenId>(forced);
  if (r.ok() && v.forced_first_token >= 0 && v.local_prompt_token_ids.empty()) {
    r.fail("forced_first_token", "is only allowed with local_prompt_token_ids");
  }
  r.integer("choices", v.choices, false, 1, pd::kMaxChoices);
  r.str("attach_to", v.attach_to, false, kMaxIdBytes);
  if (r.ok() && !v.attach_to.empty()) {
    r.integer("choice", v.choice, true, 1, pd::kMaxChoices - 1);
    if (r.ok() && v.choices != 1) r.fail("choices", "an attached choice cannot have choices of its own");
  }
  if (r.ok() && !v.local_prompt_token_ids.empty() && (v.choices != 1 || !v.attach_to.empty())) {
    r.fail("local_prompt_token_ids", "a local prefill is for one choice");
  }
  r.tokenIds("prompt_token_ids", v.prompt_token_ids, false);
  if (r.ok() && !v.prompt_token_ids.empty() &&
      (static_cast<std::int64_t>(v.prompt_token_ids.size()) != v.prompt_tokens || !v.local_prompt_token_ids.empty() ||
       !v.attach_to.empty())) {
    r.fail("prompt_token_ids", "must hold prompt_tokens token ids, and not with local_prompt_token_ids or attach_to");
  }
  if (!r.ok()) return r.status().error();
  return v;
}

std::string toJson(const DecodeEvent& v) {
  json::object o;
  switch (v.type) {
    case DecodeEventType::Descriptor:
      o = {{"event", "descriptor"}, {"kv_descriptor", base64Encode(v.kv_descriptor)}, {"blocks", v.blocks}};
      if (!v.kv_descriptor_tag.empty()) o["kv_descriptor_tag"] = v.kv_descriptor_tag;
      break;
    case DecodeEventType::Tokens: {
      json::array ids;
      for (auto id : v.token_ids) ids.push_back(id);
      o = {{"event", "tokens"}, {"token_ids", std::move(ids)}};
      if (!v.logprobs.empty()) o["logprobs"] = logprobsJson(v.logprobs);
      break;
    }
    case DecodeEventType::Finish:
      o = {{"event", "finish"},
           {"finish_reason", pd::finishReasonName(v.finish_reason)},
           {"prompt_tokens", v.prompt_tokens},
           {"completion_tokens", v.completion_tokens}};
      break;
    case DecodeEventType::Error:
      o = {{"event", "error"}, {"code", errorCodeName(v.code)}, {"message", v.message}};
      break;
    case DecodeEventType::Preempted:
      o = {{"event", "preempted"}, {"message", v.message}, {"completion_tokens", v.completion_tokens}};
      break;
  }
  return dump(o);
}

Result<DecodeEvent> parseDecodeEvent(std::string_view text) {
  auto object = parseObject(text, "decode event");
  if (!object.ok()) return object.error();
  DecodeEvent v;
  Reader r(*object, "event");
  std::string type;
  r.str("event", type);
  if (!r.ok()) return r.status().error();
  if (type == "descriptor") {
    v.type = DecodeEventType::Descriptor;
    std::string b64;
    r.str("kv_descriptor", b64, true, std::size_t{64} << 20);
    r.str("kv_descriptor_tag", v.kv_descriptor_tag, false, 64);
    r.integer("blocks", v.blocks, false, 0);
    if (!r.ok()) return r.status().error();
    auto bytes = base64Decode(b64);
    if (!bytes.ok()) return makeError(ErrorCode::InvalidArgument, "event.kv_descriptor: " + bytes.error().message);
    v.kv_descriptor = std::move(*bytes);
  } else if (type == "tokens") {
    v.type = DecodeEventType::Tokens;
    r.tokenIds("token_ids", v.token_ids, true);
    const json::array* lps = r.array("logprobs", false);
    if (!r.ok()) return r.status().error();
    if (lps != nullptr) {
      if (auto s = readLogprobs(*lps, v.logprobs); !s.ok()) return s.error();
      if (v.logprobs.size() != v.token_ids.size()) {
        return makeError(ErrorCode::InvalidArgument, "event.logprobs: one entry per token id expected");
      }
    }
  } else if (type == "finish") {
    v.type = DecodeEventType::Finish;
    std::string reason;
    r.str("finish_reason", reason);
    r.integer("prompt_tokens", v.prompt_tokens, false, 0);
    r.integer("completion_tokens", v.completion_tokens, false, 0);
    const auto parsed = pd::parseFinishReason(reason);
    if (r.ok() && (!parsed || (*parsed != pd::FinishReason::Stop && *parsed != pd::FinishReason::Length))) {
      r.fail("finish_reason", "must be \"stop\" or \"length\"");
    }
    if (parsed) v.finish_reason = *parsed;
  } else if (type == "error") {
    v.type = DecodeEventType::Error;
    std::string code;
    r.str("code", code);
    r.str("message", v.message, false, std::size_t{64} << 10);
    if (r.ok()) {
      auto parsed = parseErrorCode(code);
      if (!parsed) {
        r.fail("code", "is not a known error code");
      } else {
        v.code = *parsed;
      }
    }
  } else if (type == "preempted") {
    v.type = DecodeEventType::Preempted;
    v.code = ErrorCode::Overloaded;
    r.str("message", v.message, false, std::size_t{64} << 10);
    r.integer("completion_tokens", v.completion_tokens, false, 0);
  } else {
    r.fail("event", "is not descriptor, tokens, finish, error or preempted");
  }
  if (!r.ok()) return r.status().error();
  return v;
}

std::string toJson(const AbortRequest& v) {
  return dump(json::object{{"request_id", v.request_id}});
}

Result<AbortRequest> parseAbortRequest(std::string_view text) {
  auto object = parseObject(text, "abort request");
  if (!object.ok()) return object.error();
  AbortRequest v;
  Reader r(*object, "abort request");
  r.str("request_id", v.request_id);
  if (!r.ok()) return r.status().error();
  return v;
}

std::string toJson(const PrefillSubmit& v) {
  json::array ids;
  ids.reserve(v.token_ids.size());
  for (auto id : v.token_ids) ids.push_back(id);
  json::object o{{"request_id", v.request_id},
                 {"token_ids", std::move(ids)},
                 {"sampling", samplingJson(v.sampling)},
                 {"logprobs", v.logprobs},
                 {"kv_descriptor", base64Encode(v.kv_descriptor)},
                 {"timeout_ms", v.timeout_ms}};
  if (!v.kv_descriptor_tag.empty()) o["kv_descriptor_tag"] = v.kv_descriptor_tag;
  if (!v.traceparent.empty()) o["traceparent"] = v.traceparent;
  if (v.resumed_tokens > 0) o["resumed_tokens"] = v.resumed_tokens;
  if (v.forced_first_token >= 0) o["forced_first_token"] = v.forced_first_token;
  if (!v.constraint.empty()) o["constraint"] = v.constraint;
  if (!v.tool_call_format.empty()) o["tool_call_format"] = v.tool_call_format;
  if (v.choices != 1) o["choices"] = v.choices;
  return dump(o);
}

Result<PrefillSubmit> parsePrefillSubmit(std::string_view text) {
  auto object = parseObject(text, "prefill request");
  if (!object.ok()) return object.error();
  PrefillSubmit v;
  Reader r(*object, "prefill request");
  r.str("request_id", v.request_id);
  if (r.ok() && v.request_id.empty()) r.fail("request_id", "must not be empty");
  r.tokenIds("token_ids", v.token_ids, true);
  if (r.ok() && v.token_ids.empty()) r.fail("token_ids", "must not be empty");
  readSampling(r, v.sampling);
  r.boolean("logprobs", v.logprobs, false);
  std::string b64;
  r.str("kv_descriptor", b64, true, std::size_t{64} << 20);
  r.str("kv_descriptor_tag", v.kv_descriptor_tag, false, 64);
  r.integer("timeout_ms", v.timeout_ms, false, 1, std::int64_t{24} * 3600 * 1000);
  r.str("traceparent", v.traceparent, false, kMaxTraceparentBytes);
  r.integer("resumed_tokens", v.resumed_tokens, false, 0);
  r.integer("forced_first_token", v.forced_first_token, false, 0, std::numeric_limits<pd::TokenId>::max());
  if (r.ok() && v.resumed_tokens >= static_cast<std::int64_t>(v.token_ids.size())) {
    r.fail("resumed_tokens", "must be fewer than the token ids");
  }
  r.str("constraint", v.constraint, false, kMaxConstraintBytes);
  r.str("tool_call_format", v.tool_call_format, false, kMaxToolCallFormatBytes);
  r.integer("choices", v.choices, false, 1, pd::kMaxChoices);
  if (r.ok() && v.choices > 1 && v.forced_first_token >= 0) {
    r.fail("choices", "a forced first token is one choice's");
  }
  if (!r.ok()) return r.status().error();
  auto bytes = base64Decode(b64);
  if (!bytes.ok())
    return makeError(ErrorCode::InvalidArgument, "prefill request.kv_descriptor: " + bytes.error().message);
  v.kv_descriptor = std::move(*bytes);
  return v;
}

std::string toJson(const PrefillOutcome& v) {
  return dump(json::object{{"first_token", v.first_token},
                           {"prompt_tokens", v.prompt_tokens},
                           {"cached_tokens", v.cached_tokens},
                           {"queue_ms", v.queue_ms},
                           {"compute_ms", v.compute_ms},
                           {"transfer_ms", v.transfer_ms}});
}

Result<PrefillOutcome> parsePrefillOutcome(std::string_view text) {
  auto object = parseObject(text, "prefill outcome");
  if (!object.ok()) return object.error();
  PrefillOutcome v;
  Reader r(*object, "prefill outcome");
  std::int64_t first = 0;
  r.integer("first_token", first, true, 0, std::numeric_limits<pd::TokenId>::max());
  v.first_token = static_cast<pd::TokenId>(first);
  r.integer("prompt_tokens", v.prompt_tokens, false, 0);
  r.integer("cached_tokens", v.cached_tokens, false, 0);
  if (r.ok() && v.cached_tokens > v.prompt_tokens) {
    return makeError(ErrorCode::InvalidArgument, "prefill outcome: cached_tokens exceeds prompt_tokens");
  }
  r.number("queue_ms", v.queue_ms, false);
  r.number("compute_ms", v.compute_ms, false);
  r.number("transfer_ms", v.transfer_ms, false);
  if (!r.ok()) return r.status().error();
  return v;
}

std::string toJson(const WorkerStatus& v) {
  json::object o{{"role", v.role},
                 {"ready", v.ready},
                 {"busy", v.busy},
                 {"draining", v.draining},
                 {"model_hash", v.model_hash},
                 {"queued_requests", v.queued_requests},
                 {"queued_tokens", v.queued_tokens},
                 {"running_requests", v.running_requests},
                 {"free_blocks", v.free_blocks},
                 {"total_blocks", v.total_blocks},
                 {"block_size", v.block_size},
                 {"quarantined_blocks", v.quarantined_blocks},
                 {"drafts_proposed", v.drafts_proposed},
                 {"drafts_accepted", v.drafts_accepted},
                 {"kv_pool_memory", v.kv_pool_memory},
                 {"kv_cache_dtype", v.kv_cache_dtype},
                 {"kv_pool_bytes", v.kv_pool_bytes},
                 {"kv_transfer_path", v.kv_transfer_path}};
  if (v.prefix_cache_capacity > 0) {
    o["prefix_cache_blocks"] = v.prefix_cache_blocks;
    o["prefix_cache_capacity"] = v.prefix_cache_capacity;
  }
  if (v.local_prefill_max_tokens >= 0) o["local_prefill_max_tokens"] = v.local_prefill_max_tokens;
  return dump(o);
}

Result<WorkerStatus> parseWorkerStatus(std::string_view text) {
  auto object = parseObject(text, "worker status");
  if (!object.ok()) return object.error();
  WorkerStatus v;
  Reader r(*object, "worker status");
  r.str("role", v.role);
  if (r.ok() && v.role != "prefill" && v.role != "decode") r.fail("role", "must be \"prefill\" or \"decode\"");
  r.boolean("ready", v.ready, true);
  r.boolean("busy", v.busy, false);
  r.boolean("draining", v.draining, false);
  r.str("model_hash", v.model_hash, false);
  r.integer("queued_requests", v.queued_requests, false, 0);
  r.integer("queued_tokens", v.queued_tokens, false, 0);
  r.integer("running_requests", v.running_requests, false, 0);
  r.integer("free_blocks", v.free_blocks, false, 0);
  r.integer("total_blocks", v.total_blocks, false, 0);
  r.integer("block_size", v.block_size, false, 0);
  r.integer("quarantined_blocks", v.quarantined_blocks, false, 0);
  r.integer("drafts_proposed", v.drafts_proposed, false, 0);
  r.integer("drafts_accepted", v.drafts_accepted, false, 0);
  r.str("kv_pool_memory", v.kv_pool_memory, false, 32);
  r.str("kv_cache_dtype", v.kv_cache_dtype, false, 16);
  r.integer("kv_pool_bytes", v.kv_pool_bytes, false, 0);
  r.str("kv_transfer_path", v.kv_transfer_path, false, 16);
  r.integer("prefix_cache_blocks", v.prefix_cache_blocks, false, 0);
  r.integer("prefix_cache_capacity", v.prefix_cache_capacity, false, 0);
  r.integer("local_prefill_max_tokens", v.local_prefill_max_tokens, false, 0);
  if (!r.ok()) return r.status().error();
  return v;
}

std::string toJson(const KvEvents& v) {
  json::array blocks;
  blocks.reserve(v.blocks.size());
  for (const std::uint64_t b : v.blocks) blocks.emplace_back(hash64Hex(b));
  json::array events;
  events.reserve(v.events.size());
  for (const KvEvent& e : v.events) {
    events.emplace_back(
        json::object{{"seq", e.seq}, {"op", e.stored ? "stored" : "removed"}, {"block", hash64Hex(e.block)}});
  }
  return dump(json::object{{"instance_id", v.instance_id},
                           {"model_hash", hash64Hex(v.model_hash)},
                           {"block_size", v.block_size},
                           {"seq", v.seq},
                           {"snapshot", v.snapshot},
                           {"blocks", std::move(blocks)},
                           {"events", std::move(events)},
                           {"more", v.more}});
}

Result<KvEvents> parseKvEvents(std::string_view text) {
  auto object = parseObject(text, "kv events");
  if (!object.ok()) return object.error();
  KvEvents v;
  Reader r(*object, "kv events");
  r.str("instance_id", v.instance_id);
  if (r.ok() && v.instance_id.empty()) r.fail("instance_id", "must not be empty");
  std::string model_hash;
  r.str("model_hash", model_hash);
  if (r.ok()) {
    const auto h = parseHash64Hex(model_hash);
    if (!h) r.fail("model_hash", "must be 16 hex digits");
    v.model_hash = h.value_or(0);
  }
  r.integer("block_size", v.block_size, true, 1, std::int64_t{1} << 20);
  r.unsignedInt("seq", v.seq, true);
  r.boolean("snapshot", v.snapshot, true);
  r.boolean("more", v.more, false);
  const json::array* blocks = r.array("blocks", false);
  const json::array* events = r.array("events", false);
  if (!r.ok()) return r.status().error();
  const std::size_t n = (blocks ? blocks->size() : 0) + (events ? events->size() : 0);
  if (n > kMaxKvEventBlocks) return makeError(ErrorCode::InvalidArgument, "kv events: too many blocks");
  const auto key = [](const json::value& value) -> std::optional<std::uint64_t> {
    const auto* s = value.if_string();
    return s ? parseHash64Hex(*s) : std::nullopt;
  };
  if (blocks) {
    v.blocks.reserve(blocks->size());
    for (const auto& b : *blocks) {
      const auto k = key(b);
      if (!k) return makeError(ErrorCode::InvalidArgument, "kv events.blocks must hold 16-hex-digit keys");
      v.blocks.push_back(*k);
    }
  }
  if (events) {
    v.events.reserve(events->size());
    for (const auto& e : *events) {
      const auto* o = e.if_object();
      if (o == nullptr) return makeError(ErrorCode::InvalidArgument, "kv events.events must hold objects");
      KvEvent ev;
      Reader er(*o, "kv events.events[]");
      er.unsignedInt("seq", ev.seq, true);
      std::string op;
      std::string block;
      er.str("op", op);
      er.str("block", block);
      if (!er.ok()) return er.status().error();
      if (op != "stored" && op != "removed") {
        return makeError(ErrorCode::InvalidArgument, "kv events.events[].op must be \"stored\" or \"removed\"");
      }
      ev.stored = op == "stored";
      const auto k = parseHash64Hex(block);
      if (!k) return makeError(ErrorCode::InvalidArgument, "kv events.events[].block must be 16 hex digits");
      ev.block = *k;
      if (!v.events.empty() && ev.seq != v.events.back().seq + 1) {
        return makeError(ErrorCode::InvalidArgument, "kv events.events are not consecutive");
      }
      v.events.push_back(ev);
    }
  }
  if (v.snapshot && !v.events.empty()) {
    return makeError(ErrorCode::InvalidArgument, "kv events: a snapshot carries no events");
  }
  if (!v.snapshot && !v.blocks.empty()) {
    return makeError(ErrorCode::InvalidArgument, "kv events: only a snapshot carries blocks");
  }
  if (!v.events.empty() && v.events.back().seq != v.seq) {
    return makeError(ErrorCode::InvalidArgument, "kv events: the last event is not seq");
  }
  return v;
}

std::string errorJson(const Error& error) {
  return dump(json::object{{"error", json::object{{"code", errorCodeName(error.code)}, {"message", error.message}}}});
}

Error parseErrorJson(int status, std::string_view text) {
  const auto corrupt = [status] {
    return makeError(ErrorCode::Corrupt, "worker answered HTTP " + std::to_string(status) + " without an error body");
  };
  auto object = parseObject(text, "error");
  if (!object.ok()) return corrupt();
  const auto* e = object->if_contains("error");
  if (e == nullptr || !e->is_object()) return corrupt();
  const auto* code = e->as_object().if_contains("code");
  const auto* message = e->as_object().if_contains("message");
  if (code == nullptr || !code->is_string()) return corrupt();
  auto parsed = parseErrorCode(code->as_string());
  if (!parsed) return corrupt();
  std::string text_message;
  if (message != nullptr && message->is_string()) text_message = std::string(message->as_string());
  return makeError(*parsed, std::move(text_message));
}

namespace {

// The one table between error codes and HTTP statuses, both directions. Several codes share a
// status; the first row of a status is the code that status reads back as.
struct StatusRow {
  ErrorCode code;
  int status;
};
constexpr std::array<StatusRow, 12> kStatusTable = {{
    {ErrorCode::InvalidArgument, 400},
    {ErrorCode::ResourceExhausted, 400},
    {ErrorCode::Unsupported, 400},
    {ErrorCode::NotFound, 404},
    {ErrorCode::Unauthenticated, 401},
    {ErrorCode::Cancelled, 409},
    {ErrorCode::Internal, 500},
    {ErrorCode::PeerFailed, 502},
    {ErrorCode::Corrupt, 502},
    {ErrorCode::Io, 502},
    {ErrorCode::Overloaded, 503},
    {ErrorCode::Timeout, 504},
}};

}  // namespace

int httpStatusFor(ErrorCode code) {
  for (const StatusRow& row : kStatusTable) {
    if (row.code == code) return row.status;
  }
  return 500;
}

ErrorCode errorCodeForHttpStatus(int status) {
  for (const StatusRow& row : kStatusTable) {
    if (row.status == status) return row.code;
  }
  return status >= 400 && status < 500 ? ErrorCode::InvalidArgument : ErrorCode::Internal;
}

std::optional<ErrorCode> parseErrorCode(std::string_view name) {
  constexpr std::array kAll = {ErrorCode::InvalidArgument,   ErrorCode::NotFound,    ErrorCode::Io,
                               ErrorCode::Corrupt,           ErrorCode::Unsupported, ErrorCode::Timeout,
                               ErrorCode::PeerFailed,        ErrorCode::Cancelled,   ErrorCode::Overloaded,
                               ErrorCode::ResourceExhausted, ErrorCode::Internal,    ErrorCode::Unauthenticated};
  for (auto code : kAll) {
    if (errorCodeName(code) == name) return code;
  }
  return std::nullopt;
}

namespace {
constexpr std::string_view kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int sextet(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}
}  // namespace

std::string base64Encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const auto n = (static_cast<std::uint32_t>(static_cast<std::uint8_t>(bytes[i])) << 16) |
                   (static_cast<std::uint32_t>(static_cast<std::uint8_t>(bytes[i + 1])) << 8) |
                   static_cast<std::uint32_t>(static_cast<std::uint8_t>(bytes[i + 2]));
    out += kAlphabet[(n >> 18) & 63];
    out += kAlphabet[(n >> 12) & 63];
    out += kAlphabet[(n >> 6) & 63];
    out += kAlphabet[n & 63];
  }
  const std::size_t rest = bytes.size() - i;
  if (rest > 0) {
    std::uint32_t n = static_cast<std::uint32_t>(static_cast<std::uint8_t>(bytes[i])) << 16;
    if (rest == 2) n |= static_cast<std::uint32_t>(static_cast<std::uint8_t>(bytes[i + 1])) << 8;
    out += kAlphabet[(n >> 18) & 63];
    out += kAlphabet[(n >> 12) & 63];
    out += rest == 2 ? kAlphabet[(n >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

Result<std::string> base64Decode(std::string_view text) {
  if (text.size() % 4 != 0) return makeError(ErrorCode::InvalidArgument, "base64 length is not a multiple of 4");
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (std::size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    const int pad = last ? (text[i + 3] == '=' ? (text[i + 2] == '=' ? 2 : 1) : 0) : 0;
    std::uint32_t n = 0;
    for (std::size_t k = 0; k < 4; ++k) {
      const char c = text[i + k];
      int s = 0;
      if (k >= 4 - static_cast<std::size_t>(pad)) {
        s = 0;  // padding
      } else {
        s = sextet(c);
        if (s < 0) return makeError(ErrorCode::InvalidArgument, "base64 has a character outside its alphabet");
      }
      n = (n << 6) | static_cast<std::uint32_t>(s);
    }
    out += static_cast<char>((n >> 16) & 0xFF);
    if (pad < 2) out += static_cast<char>((n >> 8) & 0xFF);
    if (pad < 1) out += static_cast<char>(n & 0xFF);
    // Canonical form: the bits dropped by padding must be zero.
    if ((pad == 1 && (n & 0xFF) != 0) || (pad == 2 && (n & 0xFFFF) != 0)) {
      return makeError(ErrorCode::InvalidArgument, "base64 padding bits are not zero");
    }
  }
  return out;
}

}  // namespace pd::worker_api
