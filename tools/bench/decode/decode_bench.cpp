// The run of `pdserve bench decode` (decode_bench.h): a metered CPU engine under a DecodeEngine,
// the batch sweep, the MTP runs with the bench-only draft override and with the model's own drafts.
// Thread rules: main thread only (the engine's own pool does the compute).
#include "bench/decode/decode_bench.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "bench/common/bench_util.h"
#include "pd/common/json_text.h"
#include "pd/common/kv_format.h"
#include "pd/decode/decode_engine.h"
#include "pd/decode/drafter.h"
#include "pd/decode/kv_pool.h"
#include "pd/engine/engine.h"
#include "pd/engine/kernels.h"
#include "pd/engine/model_config.h"
#include "pd/engine/model_factory.h"
#include "pd/engine/thread_pool.h"
#include "pd/structured/grammar.h"
#include "pd/structured/token_vocabulary.h"
#include "pd/structured/worker_grammars.h"
#include "pd/tokenizer/chat_template.h"
#include "pd/tokenizer/tokenizer.h"
#include "pd/trace/tracer.h"

namespace pd::bench {
namespace {

namespace fs = std::filesystem;
using decode::DecodeEngine;
using decode::DecodeEngineOptions;
using decode::DecodeRequest;
using decode::KvPool;

// The CPU engine with its forward calls timed and their read bytes summed (main model and MTP
// layer separately), so that a DecodeEngine step can be split into draft, verify and the rest.
class MeteredEngine : public model::Engine {
 public:
  struct Totals {
    double forward_seconds = 0.0;
    double mtp_seconds = 0.0;
    std::uint64_t bytes = 0;  // weights + KV read, main and MTP
    std::int64_t experts = 0;
  };
  explicit MeteredEngine(model::Engine& inner) : inner_(inner) {}
  const ModelConfig& config() const override { return inner_.config(); }
  model::EngineCapabilities capabilities() const override { return inner_.capabilities(); }
  Result<model::ForwardOutput> forward(std::span<const model::SequenceChunk> batch, const model::LatentCacheView& cache,
                                       const model::ForwardOptions& options) override {
    const auto t0 = BenchClock::now();
    auto out = inner_.forward(batch, cache, options);
    totals_.forward_seconds += secondsSince(t0);
    if (out.ok()) count(out->stats);
    return out;
  }
  Result<model::ForwardOutput> forwardMtp(std::span<const model::SequenceChunk> batch,
                                          const model::LatentCacheView& cache,
                                          const model::ForwardOptions& options) override {
    const auto t0 = BenchClock::now();
    auto out = inner_.forwardMtp(batch, cache, options);
    totals_.mtp_seconds += secondsSince(t0);
    if (out.ok()) count(out->stats);
    return out;
  }
  [[nodiscard]] Totals take() { return std::exchange(totals_, Totals{}); }

 private:
  void count(const model::ForwardStats& s) {
    totals_.bytes += s.weight_bytes + s.kv_bytes;
    totals_.experts += s.experts_used;
  }
  model::Engine& inner_;
  Totals totals_;
};

// BENCH-ONLY drafter: the MTP layer runs as in serving (its cost is measured), but what it
// proposes is `choose`'s pick (random weights accept almost no drafts of their own).
class ScriptedDrafter final : public decode::MtpDrafter {
 public:
  /// (request id, output index of the drafted token, the MTP layer's draft) -> token to propose.
  using Choose = std::function<std::int32_t(std::uint64_t, std::int64_t, std::int32_t)>;
  ScriptedDrafter(model::Engine& engine, KvPool& pool, Choose choose)
      : MtpDrafter(engine, pool), choose_(std::move(choose)) {}

 private:
  std::int32_t choose(std::uint64_t request_id, std::int64_t output_index, std::int32_t mtp_draft) override {
    return choose_(request_id, output_index, mtp_draft);
  }
  Choose choose_;
};

struct RunSpec {
  std::int64_t batch = 1;
  std::int64_t context = 256;
  std::int64_t max_tokens = 16;  // per request, the first token included
  std::int64_t warmup_steps = 2;
  std::int64_t drafts = 0;
  DType kv_dtype = DType::BF16;
  ScriptedDrafter::Choose draft_override;  // empty: the model's own drafts
  const trace::Tracer* tracer = nullptr;   // set: each request's sink does the decode worker's span work
  // Every request's output constraint (null: free text); such requests stop only on max_tokens.
  std::shared_ptr<const structured::Grammar> grammar;
};

// What the decode worker's stream sink does for tracing (decode_server.cpp: its sink and
// recordSpans), done by the bench's sink so that its cost lands in the timed steps as in the
// worker: a decode.request span per request, a clock read on each of the first token events, and
// at the last event the four phase spans and the request span handed to the exporter.
class TracedStream {
 public:
  TracedStream(const trace::Tracer& tracer, std::int64_t prompt_tokens)
      : tracer_(tracer),
        span_(tracer.startSpan("decode.request", std::nullopt, trace::SpanKind::Server)),
        prompt_tokens_(prompt_tokens),
        opened_(trace::Clock::now()),
        admitted_(opened_) {}

  void onEvent(const decode::TokenEvent& e) {
    if (!span_.recording()) return;
    if (!e.tokens.empty()) {
      const trace::TimePoint now = trace::Clock::now();
      if (token_events_ == 0) first_event_ = now;
      if (token_events_ == 1) second_event_ = now;
      if (token_events_ < 2) early_tokens_ += static_cast<std::int64_t>(e.tokens.size());
      ++token_events_;
    }
    if (!e.finish) return;
    const trace::TimePoint now = trace::Clock::now();
    const trace::SpanContext parent = span_.context();
    tracer_.record(parent, "decode.admission", opened_, admitted_);
    tracer_.record(parent, "decode.kv_wait", admitted_, token_events_ > 0 ? first_event_ : now);
    if (token_events_ > 1) tracer_.record(parent, "decode.first_step", first_event_, second_event_);
    if (token_events_ > 2) {
      const std::int64_t steps = token_events_ - 2;
      const std::int64_t tokens = e.completion_tokens - early_tokens_;
      tracer_.record(parent, "decode.steps", second_event_, now,
                     {{"pd.steps", steps},
                      {"pd.tokens", tokens},
                      {"pd.tokens_per_step", static_cast<double>(tokens) / static_cast<double>(steps)}});
    }
    span_.setAttribute("pd.request_id", std::string("bench"));
    span_.setAttribute("pd.prompt_tokens", prompt_tokens_);
    span_.setAttribute("pd.completion_tokens", e.completion_tokens);
    span_.setAttribute("pd.finish_reason", std::string(finishReasonName(*e.finish)));
    span_.end(now);
  }

 private:
  const trace::Tracer& tracer_;
  trace::Span span_;
  std::int64_t prompt_tokens_;
  trace::TimePoint opened_;
  trace::TimePoint admitted_;
  trace::TimePoint first_event_;
  trace::TimePoint second_event_;
  std::int64_t token_events_ = 0;
  std::int64_t early_tokens_ = 0;
};

// Steps `dec` until every request has produced spec.max_tokens tokens, timing the steps after
// spec.warmup_steps (`r` holds the requests' outputs, filled by their sinks).
Result<DecodeRun> timeSteps(DecodeEngine& dec, MeteredEngine& engine, const RunSpec& spec, int threads, DecodeRun r) {
  (void)engine.take();
  std::int64_t emitted_before = 0;
  for (std::int64_t step = 0; dec.hasWork(); ++step) {
    const decode::DecodeStats before = dec.stats();
    const auto t0 = BenchClock::now();
    const double c0 = processCpuSeconds();
    dec.step(decode::Clock::now());
    const double dt = secondsSince(t0);
    const double cpu = processCpuSeconds() - c0;
    const MeteredEngine::Totals m = engine.take();
    const decode::DecodeStats& after = dec.stats();
    if (after.steps == before.steps) {
      return makeError(ErrorCode::Internal, "a decode step produced nothing (did a request fail?)");
    }
    if (step < spec.warmup_steps) {  // page faults, workspace growth
      emitted_before = after.tokens_generated;
      continue;
    }
    r.step_seconds.push_back(dt);
    r.wall_seconds += dt;
    r.forward_seconds += m.forward_seconds;
    r.mtp_seconds += m.mtp_seconds;
    r.bytes += static_cast<double>(m.bytes);
    r.experts += static_cast<double>(m.experts);
    r.cpu_share += cpu / (dt * threads);
    r.grammar_seconds += after.grammar_seconds - before.grammar_seconds;
    r.sample_seconds += after.sample_seconds - before.sample_seconds;
    r.drafts_proposed += after.drafts_proposed - before.drafts_proposed;
    r.drafts_accepted += after.drafts_accepted - before.drafts_accepted;
    ++r.steps;
  }
  r.tokens = dec.stats().tokens_generated - emitted_before;
  if (r.steps < 1) {
    return makeError(ErrorCode::InvalidArgument, "no timed step: raise --steps (or lower the warm-up)");
  }
  r.cpu_share /= static_cast<double>(r.steps);
  for (const auto& out : r.outputs) {
    if (static_cast<std::int64_t>(out.size()) != spec.max_tokens) {
      return makeError(ErrorCode::Internal, "a request ended early");
    }
  }
  return r;
}

// [{"batch", "plain_step_ms", "schema_step_ms", "ratio"}] of the --schema runs.
std::string schemaRowsJson(const std::vector<std::pair<std::int64_t, std::array<double, 2>>>& rows) {
  std::string out = "[";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& [batch, t] = rows[i];
    out += fmt::format("{}{{\"batch\": {}, \"plain_step_ms\": {:.4f}, \"schema_step_ms\": {:.4f}, \"ratio\": {:.4f}}}",
                       i ? ", " : "", batch, t[0] * 1e3, t[1] * 1e3, t[1] / t[0]);
  }
  return out + "]";
}

// Distinct tokens per sequence of a run, averaged.
double distinctPerSequence(const DecodeRun& run) {
  double total = 0.0;
  for (std::vector<std::int32_t> out : run.outputs) {
    std::sort(out.begin(), out.end());
    total += static_cast<double>(std::unique(out.begin(), out.end()) - out.begin());
  }
  return run.outputs.empty() ? 0.0 : total / static_cast<double>(run.outputs.size());
}

// The lowest token a constrained output may start with (the first token comes with the KV).
std::int32_t firstAllowed(const std::shared_ptr<const structured::Grammar>& grammar) {
  std::vector<structured::MaskWord> mask(grammar->vocabulary().maskWords());
  structured::Matcher(grammar).fillMask(mask);
  for (std::size_t w = 0; w < mask.size(); ++w) {
    if (mask[w] != 0) return static_cast<std::int32_t>(w * 64 + static_cast<std::size_t>(__builtin_ctzll(mask[w])));
  }
  return 0;  // unreachable: a grammar allows a first token
}

// Admits `batch` requests whose prompt KV is random latents (a step's cost does not depend on
// their values) and whose first token and hidden state are random, then steps the engine until
// every request has produced max_tokens tokens (greedy, EOS ignored).
Result<DecodeRun> runDecode(MeteredEngine& engine, const RunSpec& spec, int threads, std::uint64_t seed) {
  const ModelConfig& cfg = engine.config();
  constexpr std::int64_t kBlock = 64;
  const std::int64_t per_seq = (spec.context + spec.max_tokens + spec.drafts + kBlock - 1) / kBlock + 1;
  PD_ASSIGN_OR_RETURN(KvPool pool, KvPool::create(cfg, spec.batch * per_seq, kBlock, spec.kv_dtype));
  DecodeEngineOptions o;
  o.num_speculative_tokens = spec.drafts;
  o.max_running_requests = spec.batch;
  DecodeEngine dec(
      engine, pool, o,
      spec.draft_override ? std::make_unique<ScriptedDrafter>(engine, pool, spec.draft_override) : nullptr);

  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::uniform_int_distribution<std::int32_t> token(2, static_cast<std::int32_t>(cfg.vocab_size - 1));
  DecodeRun r;
  r.batch = spec.batch;
  r.outputs.resize(static_cast<std::size_t>(spec.batch));
  std::vector<float> latent(static_cast<std::size_t>(cfg.latentDim()));
  for (std::int64_t i = 0; i < spec.batch; ++i) {
    DecodeRequest req;
    req.id = static_cast<std::uint64_t>(i + 1);
    req.prompt_tokens = spec.context;
    req.max_tokens = spec.max_tokens;
    req.ignore_eos = spec.grammar == nullptr;  // a constrained one cannot emit EOS before its value is complete
    req.grammar = spec.grammar;
    std::vector<std::int32_t>* out = &r.outputs[static_cast<std::size_t>(i)];
    std::shared_ptr<TracedStream> traced;
    if (spec.tracer != nullptr) traced = std::make_shared<TracedStream>(*spec.tracer, spec.context);
    req.sink = [out, traced](const decode::TokenEvent& e) {
      for (const auto& t : e.tokens) out->push_back(t.token);
      if (traced) traced->onEvent(e);
    };
    PD_ASSIGN_OR_RETURN(std::vector<std::int32_t> blocks, dec.admit(std::move(req)));
    for (std::int64_t l = 0; l < cfg.kvLayers(); ++l) {
      for (std::int64_t p = 0; p < spec.context; ++p) {
        for (float& v : latent) v = normal(rng);
        model::writeLatent(pool.view(), l, blocks, p, latent.data());
      }
    }
    kvtransfer::CompletionRecord rec;
    rec.num_tokens = static_cast<std::uint32_t>(spec.context);
    rec.first_token = token(rng);
    if (spec.grammar) rec.first_token = firstAllowed(spec.grammar);
    rec.hidden_state.resize(static_cast<std::size_t>(cfg.hidden_size));
    for (float& v : rec.hidden_state) v = normal(rng);
    PD_TRY(dec.onKvReady(static_cast<std::uint64_t>(i + 1), std::move(rec)));
  }
  return timeSteps(dec, engine, spec, threads, std::move(r));
}

// One batch-1 request per prompt, one after the other, results summed: the prompt's KV (main
// layers, then the MTP layer over the prompt shifted by one) is computed by the engine as a
// prefill worker computes it, then the request decodes with spec.drafts MTP drafts proposed by
// the model itself (no override).
Result<DecodeRun> runPrompts(MeteredEngine& engine, const std::vector<std::vector<std::int32_t>>& prompts,
                             const RunSpec& spec, int threads) {
  const ModelConfig& cfg = engine.config();
  constexpr std::int64_t kBlock = 64;
  DecodeRun total;
  total.batch = 1;
  double cpu_weighted = 0.0;
  for (const std::vector<std::int32_t>& prompt : prompts) {
    const auto n = static_cast<std::int64_t>(prompt.size());
    const std::int64_t per_seq = (n + spec.max_tokens + spec.drafts + kBlock - 1) / kBlock + 1;
    PD_ASSIGN_OR_RETURN(KvPool pool, KvPool::create(cfg, per_seq, kBlock, spec.kv_dtype));
    DecodeEngineOptions o;
    o.num_speculative_tokens = spec.drafts;
    o.max_running_requests = 1;
    DecodeEngine dec(engine, pool, o);
    DecodeRun r;
    r.batch = 1;
    r.outputs.resize(1);
    DecodeRequest req;
    req.id = 1;
    req.prompt_tokens = n;
    req.max_tokens = spec.max_tokens;
    req.ignore_eos = true;
    std::vector<std::int32_t>* out = &r.outputs[0];
    req.sink = [out](const decode::TokenEvent& e) {
      for (const auto& t : e.tokens) out->push_back(t.token);
    };
    PD_ASSIGN_OR_RETURN(std::vector<std::int32_t> blocks, dec.admit(std::move(req)));
    model::SequenceChunk chunk{prompt, 0, blocks};
    model::ForwardOptions fo;
    fo.logits = model::OutputRows::Last;
    fo.hidden = model::OutputRows::All;
    PD_ASSIGN_OR_RETURN(model::ForwardOutput pre, engine.forward(std::span(&chunk, 1), pool.view(), fo));
    const auto first =
        static_cast<std::int32_t>(std::max_element(pre.logits.begin(), pre.logits.end()) - pre.logits.begin());
    std::vector<std::int32_t> shifted(prompt.begin() + 1, prompt.end());
    shifted.push_back(first);
    model::SequenceChunk mtp_chunk{shifted, 0, blocks};
    mtp_chunk.prev_hidden = pre.hidden;
    model::ForwardOptions mo;
    mo.logits = model::OutputRows::None;
    PD_TRY(engine.forwardMtp(std::span(&mtp_chunk, 1), pool.view(), mo));
    kvtransfer::CompletionRecord rec;
    rec.num_tokens = static_cast<std::uint32_t>(n);
    rec.first_token = first;
    rec.hidden_state.assign(pre.hidden.end() - cfg.hidden_size, pre.hidden.end());
    PD_TRY(dec.onKvReady(1, std::move(rec)));
    PD_ASSIGN_OR_RETURN(DecodeRun one, timeSteps(dec, engine, spec, threads, std::move(r)));
    total.steps += one.steps;
    total.tokens += one.tokens;
    total.step_seconds.insert(total.step_seconds.end(), one.step_seconds.begin(), one.step_seconds.end());
    total.wall_seconds += one.wall_seconds;
    total.forward_seconds += one.forward_seconds;
    total.mtp_seconds += one.mtp_seconds;
    total.bytes += one.bytes;
    total.experts += one.experts;
    cpu_weighted += one.cpu_share * static_cast<double>(one.steps);
    total.drafts_proposed += one.drafts_proposed;
    total.drafts_accepted += one.drafts_accepted;
    total.outputs.push_back(std::move(one.outputs[0]));
  }
  if (total.steps > 0) total.cpu_share = cpu_weighted / static_cast<double>(total.steps);
  return total;
}

// Questions in the default model's domain (short definitions), rendered with the model's chat
// template: the prompts of the real-drafts MTP measurement.
constexpr std::array<std::string_view, 8> kMtpQuestions = {
    "What is a river?",   "What is a mountain?", "What does the word harbor mean?",  "Tell me about music.",
    "What is a teacher?", "What is bread?",      "What does the word journey mean?", "What is a garden?"};

// kMtpQuestions as token ids through the model folder's tokenizer and chat template; NotFound
// when the folder has no tokenizer or template.
Result<std::vector<std::vector<std::int32_t>>> questionPrompts(const fs::path& model_dir) {
  PD_ASSIGN_OR_RETURN(tokenizer::Tokenizer tok, tokenizer::Tokenizer::load(model_dir));
  PD_ASSIGN_OR_RETURN(chat::ChatTemplate tmpl, chat::ChatTemplate::fromTokenizer(tok));
  std::vector<std::vector<std::int32_t>> out;
  for (const std::string_view q : kMtpQuestions) {
    const std::string messages = fmt::format(R"([{{"role":"user","content":"{}"}}])", q);
    chat::ChatRequest req;
    req.messages_json = messages;
    req.add_generation_prompt = true;
    PD_ASSIGN_OR_RETURN(std::string text, tmpl.render(req));
    PD_ASSIGN_OR_RETURN(std::vector<tokenizer::TokenId> ids, tok.encode(text));
    out.emplace_back(ids.begin(), ids.end());
  }
  return out;
}

// The last-level cache of cpu0 in bytes (sysfs), 0 when unknown.
std::uint64_t lastLevelCacheBytes() {
  std::uint64_t best = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream f(fmt::format("/sys/devices/system/cpu/cpu0/cache/index{}/size", index));
    std::string text;
    if (!(f >> text) || text.empty()) continue;
    best = std::max(best, parseCacheSize(text));
  }
  return best;
}

// Bytes of the checkpoint's safetensors files.
std::uint64_t weightFileBytes(const fs::path& dir) {
  std::uint64_t total = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".safetensors") total += e.file_size(ec);
  }
  return total;
}

// A temporary folder removed on scope exit (the generated model).
struct TempDir {
  fs::path path;
  TempDir() = default;
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
};
}  // namespace

namespace {

struct TracingOverhead {
  std::int64_t batch = 0;
  std::int64_t runs = 0;
  double plain_step = 0.0;   // median over runs of each run's median step, seconds
  double traced_step = 0.0;  // likewise with tracing
  std::int64_t spans = 0;    // decode.request spans the exporter wrote
  [[nodiscard]] double ratio() const { return plain_step > 0 ? traced_step / plain_step : 0.0; }
};

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Result<TracingOverhead> tracingOverhead(MeteredEngine& engine, const DecodeBenchConfig& cfg, DType kv_dtype,
                                        int threads) {
  TracingOverhead out;
  out.batch =
      cfg.batches.empty() ? 1 : std::min<std::int64_t>(16, *std::max_element(cfg.batches.begin(), cfg.batches.end()));
  out.runs = 5;
  std::string dir_pattern = (fs::temp_directory_path() / "pdserve-bench-decode-trace-XXXXXX").string();
  if (::mkdtemp(dir_pattern.data()) == nullptr) return makeError(ErrorCode::Io, "cannot create a temp folder");
  TempDir dir;
  dir.path = dir_pattern;
  trace::TraceConfig tc;
  tc.file = (dir.path / "spans.jsonl").string();
  tc.sample_ratio = 1.0;
  std::vector<double> plain;
  std::vector<double> traced;
  {
    PD_ASSIGN_OR_RETURN(auto tracer, trace::Tracer::create(tc, "pdserve-bench-decode", nullptr));
    RunSpec spec;
    spec.batch = out.batch;
    spec.context = cfg.context;
    spec.max_tokens = 1 + 2 + std::max<std::int64_t>(cfg.steps, 16);
    spec.kv_dtype = kv_dtype;
    for (std::int64_t i = 0; i < out.runs; ++i) {
      spec.tracer = nullptr;
      PD_ASSIGN_OR_RETURN(auto a, runDecode(engine, spec, threads, 3000 + static_cast<std::uint64_t>(i)));
      spec.tracer = tracer.get();
      PD_ASSIGN_OR_RETURN(auto b, runDecode(engine, spec, threads, 3000 + static_cast<std::uint64_t>(i)));
      plain.push_back(a.medianStep());
      traced.push_back(b.medianStep());
    }
  }  // the tracer's destructor exports what is queued
  out.plain_step = median(plain);
  out.traced_step = median(traced);
  std::ifstream in(tc.file);
  for (std::string line; std::getline(in, line);) {
    const std::string_view needle = "\"name\":\"decode.request\"";
    for (auto pos = line.find(needle); pos != std::string::npos; pos = line.find(needle, pos + 1)) ++out.spans;
  }
  return out;
}

}  // namespace

Result<void> runDecodeBench(const DecodeBenchConfig& cfg) {
  fs::path model_dir = cfg.model;
  const std::string& preset = cfg.preset;
  const std::int64_t context = cfg.context;
  const std::int64_t steps = cfg.steps;
  const std::string& kv_dtype = cfg.kv_dtype;
  const std::int64_t mtp_tokens = cfg.mtp_tokens;
  const bool json = cfg.json;
  TempDir temp;
  if (model_dir == "default") {
    auto dir = ensureDefaultModel(cfg.cache_dir);
    if (!dir.ok()) return dir.error();
    model_dir = *dir;
  }
  if (model_dir.empty()) {
    auto preset_cfg = presetConfig(preset);
    if (!preset_cfg.ok()) return preset_cfg.error();
    temp.path = fs::temp_directory_path() / fmt::format("pdserve-bench-decode-{}", ::getpid());
    model_dir = temp.path;
    if (!json) std::printf("generating a '%s' model in %s ...\n", preset.c_str(), model_dir.string().c_str());
    std::fflush(stdout);
    MakeModelOptions mo;
    mo.overwrite = true;
    auto made = makeModel(*preset_cfg, model_dir, mo);
    if (!made.ok()) return made.error();
  }
  model::CpuEngineOptions eo;
  eo.threads = static_cast<int>(cfg.threads);
  eo.batch_invariant = cfg.batch_invariant;
  auto engine = model::createCpuEngine(model_dir, eo);
  if (!engine.ok()) return engine.error();
  const model::EngineCapabilities caps = (*engine)->capabilities();
  const bool has_mtp = caps.mtp;
  const DType pool_dtype = parseKvDType(kv_dtype).value_or(DType::BF16);
  MeteredEngine metered(**engine);

  const std::uint64_t l3 = lastLevelCacheBytes();
  const std::uint64_t weights = weightFileBytes(model_dir);
  const double over_l3 = l3 > 0 ? static_cast<double>(weights) / static_cast<double>(l3) : 0.0;
  double bandwidth = 0.0;
  {
    model::ThreadPool pool(caps.threads);
    bandwidth = measureReadBandwidth(pool, model::kernelTable(model::detectCpuIsa()),
                                     static_cast<std::size_t>(cfg.bandwidth_mb) << 20);
  }
  if (!json) {
    std::printf("model %s (%s weights, %.0f MB = %.1fx the %.0f MiB last-level cache), %s, %d threads\n",
                model_dir.string().c_str(), std::string(dtypeName(caps.weight_dtype)).c_str(),
                static_cast<double>(weights) / 1e6, over_l3, static_cast<double>(l3) / (1 << 20), caps.backend.c_str(),
                caps.threads);
    if (over_l3 > 0 && over_l3 < 8) std::printf("warning: the weights are less than 8x the last-level cache\n");
    std::printf("ceiling: read bandwidth %.2f GB/s; KV pool %s, context %lld\n", bandwidth / 1e9, kv_dtype.c_str(),
                static_cast<long long>(context));
  }

  // Batch sweep, MTP off.
  std::vector<DecodeRun> sweep;
  for (const std::int64_t b : cfg.batches) {
    RunSpec spec;
    spec.batch = b;
    spec.context = context;
    spec.max_tokens = 1 + 2 + steps;  // the first token comes with the KV
    spec.kv_dtype = pool_dtype;
    auto r = runDecode(metered, spec, caps.threads, 1000 + static_cast<std::uint64_t>(b));
    if (!r.ok()) return r.error();
    sweep.push_back(std::move(*r));
    const DecodeRun& x = sweep.back();
    const double step = x.medianStep();
    const double bytes = x.bytes / static_cast<double>(x.steps);
    if (!json) {
      std::printf(
          "decode batch %3lld: %8.2f ms/step  %9.2f tok/s  %8.1f MB/step  %6.2f GB/s  MBU %.3f  (%.0f experts/step, "
          "forward %.0f%% of the step, cpu share %.2f)\n",
          static_cast<long long>(b), step * 1e3, static_cast<double>(b) / step, bytes / 1e6, bytes / step / 1e9,
          decodeMbu(bytes, step, bandwidth), x.experts / static_cast<double>(x.steps),
          100.0 * x.forward_seconds / x.wall_seconds, x.cpu_share);
    }
  }

  // Tracing's cost on the decode step: the same batch with and without the decode worker's span
  // work in its sinks (trace sample ratio 1.0, spans to a file), alternating runs so both see the
  // same machine; the ratio of their median steps.
  std::string tracing_json = "null";
  if (cfg.tracing) {
    auto overhead = tracingOverhead(metered, cfg, pool_dtype, caps.threads);
    if (!overhead.ok()) return overhead.error();
    const TracingOverhead& t = *overhead;
    if (!json) {
      std::printf(
          "tracing 1.0 at batch %lld: median step %.3f ms traced vs %.3f ms off (%lld runs each), ratio %.4f; %lld "
          "decode.request spans exported\n",
          static_cast<long long>(t.batch), t.traced_step * 1e3, t.plain_step * 1e3, static_cast<long long>(t.runs),
          t.ratio(), static_cast<long long>(t.spans));
    }
    tracing_json = fmt::format(
        "{{\"batch\": {}, \"runs\": {}, \"plain_step_ms\": {:.4f}, \"traced_step_ms\": {:.4f}, "
        "\"traced_over_plain\": {:.4f}, \"decode_request_spans\": {}}}",
        t.batch, t.runs, t.plain_step * 1e3, t.traced_step * 1e3, t.ratio(), t.spans);
  }

  // The same batches with every sequence constrained to --schema, each right after a plain run
  // (the machine's speed drifts between runs): the grammar's share of a decode step.
  std::vector<std::pair<std::int64_t, std::array<double, 2>>> schema_rows;  // batch, {plain, schema} median s
  if (!cfg.schema.empty()) {
    const fs::path tok_dir = cfg.tokenizer.empty() ? model_dir : cfg.tokenizer;
    auto tok = tokenizer::Tokenizer::load(tok_dir);
    if (!tok.ok()) return tok.error();
    const auto vocab_size = static_cast<std::size_t>((*engine)->config().vocab_size);
    auto vocabulary = structured::TokenVocabulary::fromTokenizer(*tok, vocab_size);
    if (!vocabulary.ok()) return vocabulary.error();
    auto grammar = structured::Grammar::fromJsonSchema(cfg.schema, *vocabulary, structured::servingGrammarOptions());
    if (!grammar.ok()) return grammar.error();
    // Plain and constrained runs alternate (kRepeats pairs, the order flipping each time); the medians of their median
    // step times are compared (a loaded machine's speed drifts between runs).
    constexpr int kRepeats = 4;
    const auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    for (const std::int64_t b : cfg.batches) {
      RunSpec spec;
      spec.batch = b;
      spec.context = context;
      spec.max_tokens = 1 + 2 + steps;
      spec.kv_dtype = pool_dtype;
      std::vector<double> plain_steps;
      std::vector<double> schema_steps;
      double plain_experts = 0.0;
      double schema_experts = 0.0;
      std::vector<double> grammar_steps;        // grammar seconds per timed step, per constrained run
      std::vector<double> plain_sample_steps;   // sampler seconds per timed step, per plain run
      std::vector<double> schema_sample_steps;  // the same, per constrained run (masks applied)
      double plain_distinct = 0.0;              // distinct tokens per sequence (a greedy random model repeats)
      double schema_distinct = 0.0;
      for (int rep = 0; rep < kRepeats; ++rep) {
        // Which goes first alternates too: a run right after another is not always as fast.
        const auto run = [&](bool constrained_run) {
          RunSpec one = spec;
          one.grammar = constrained_run ? *grammar : nullptr;
          return runDecode(metered, one, caps.threads, 2000 + static_cast<std::uint64_t>(b));
        };
        auto first = run(rep % 2 == 1);
        if (!first.ok()) return first.error();
        auto second = run(rep % 2 == 0);
        if (!second.ok()) return second.error();
        auto& plain = rep % 2 == 0 ? first : second;
        auto& constrained = rep % 2 == 0 ? second : first;
        plain_steps.push_back(plain->medianStep());
        schema_steps.push_back(constrained->medianStep());
        grammar_steps.push_back(constrained->grammar_seconds / static_cast<double>(constrained->steps));
        plain_sample_steps.push_back(plain->sample_seconds / static_cast<double>(plain->steps));
        schema_sample_steps.push_back(constrained->sample_seconds / static_cast<double>(constrained->steps));
        plain_distinct = distinctPerSequence(*plain);
        schema_distinct = distinctPerSequence(*constrained);
        plain_experts = plain->experts / static_cast<double>(plain->steps);
        schema_experts = constrained->experts / static_cast<double>(constrained->steps);
      }
      const double p = median(plain_steps);
      const double c = median(schema_steps);
      schema_rows.push_back({b, {p, c}});
      if (!json) {
        std::printf(
            "decode batch %3lld with --schema: %8.2f ms/step vs %8.2f ms/step plain, ratio %.3f (median of %d "
            "alternating runs); grammar %.3f ms/step = %.2f%% of the constrained step; sampling %.3f vs %.3f ms/step "
            "plain; %.0f vs %.0f experts/step, %.1f vs %.1f distinct tokens per sequence\n",
            static_cast<long long>(b), c * 1e3, p * 1e3, c / p, kRepeats, median(grammar_steps) * 1e3,
            100.0 * median(grammar_steps) / c, median(schema_sample_steps) * 1e3, median(plain_sample_steps) * 1e3,
            schema_experts, plain_experts, schema_distinct, plain_distinct);
      }
    }
  }

  // MTP at batch 1: the plain greedy run gives the baseline and the continuation to propose.
  std::vector<MtpRow> mtp;
  double plain_tps = 0.0;
  double plain_forward_per_step = 0.0;
  if (has_mtp) {
    RunSpec base;
    base.batch = 1;
    base.context = context;
    base.max_tokens = mtp_tokens;
    base.kv_dtype = pool_dtype;
    const std::uint64_t seed = 7;
    auto plain = runDecode(metered, base, caps.threads, seed);
    if (!plain.ok()) return plain.error();
    plain_tps = static_cast<double>(plain->tokens) / plain->wall_seconds;
    plain_forward_per_step = plain->forward_seconds / static_cast<double>(plain->steps);
    const std::vector<std::int32_t> greedy = plain->outputs[0];
    if (!json) {
      std::printf("MTP at batch 1, %lld tokens: plain %.2f tok/s (%.2f ms/step, forward %.2f ms)\n",
                  static_cast<long long>(mtp_tokens), plain_tps, plain->wall_seconds / plain->steps * 1e3,
                  plain_forward_per_step * 1e3);
    }
    const auto vocab = static_cast<std::int32_t>((*engine)->config().vocab_size);
    for (const std::int64_t k : cfg.mtp_ks) {
      for (const double p : {0.0, 0.5, 0.7, 0.85, 0.9, 1.0}) {
        // BENCH-ONLY draft override: the known greedy token with probability p, else a wrong one.
        auto draws = std::make_shared<std::mt19937_64>(99);
        RunSpec spec = base;
        spec.drafts = k;
        spec.draft_override = [greedy, p, draws, vocab](std::uint64_t, std::int64_t index, std::int32_t) {
          if (index < 0 || index >= static_cast<std::int64_t>(greedy.size())) return std::int32_t{0};
          const std::int32_t right = greedy[static_cast<std::size_t>(index)];
          const bool hit = std::uniform_real_distribution<double>(0.0, 1.0)(*draws) < p;
          return hit ? right : static_cast<std::int32_t>((right + 1) % vocab);
        };
        // A plain run right before, as the baseline: the machine's speed drifts between runs.
        auto again = runDecode(metered, base, caps.threads, seed);
        if (!again.ok()) return again.error();
        auto run = runDecode(metered, spec, caps.threads, seed);
        if (!run.ok()) return run.error();
        if (run->outputs[0] != greedy) {
          return makeError(ErrorCode::Internal, "MTP changed the greedy tokens");
        }
        MtpRow row = mtpRow(*again, std::move(*run), k, p);
        if (!json) {
          std::printf(
              "MTP k=%lld p=%.2f: acceptance %.3f, %.2f accepted/step, %.2f tok/s, speedup %.2fx, relative cost %.2f, "
              "ideal %.2fx, measured/ideal %.3f\n",
              static_cast<long long>(k), p, row.acceptance(), row.gain.accepted_per_step, row.tokensPerSecond(),
              row.gain.measured_speedup, row.gain.relative_cost, row.gain.ideal_speedup, row.gain.over_ideal);
        }
        mtp.push_back(std::move(row));
      }
    }
  } else if (!json) {
    std::printf("MTP: skipped (the checkpoint has no MTP layer)\n");
  }

  // MTP with the model's own drafts (no override) on real prompts: the real acceptance and
  // speedup of a trained model, beside the ideal for that acceptance.
  std::vector<MtpRow> real;
  std::string real_skipped;
  auto prompts = has_mtp
                     ? questionPrompts(model_dir)
                     : Result<std::vector<std::vector<std::int32_t>>>(makeError(ErrorCode::NotFound, "no MTP layer"));
  if (!prompts.ok()) {
    real_skipped = prompts.error().toString();
    if (!json) std::printf("MTP with the model's own drafts: skipped (%s)\n", real_skipped.c_str());
  } else {
    RunSpec base;
    base.max_tokens = mtp_tokens;
    base.kv_dtype = pool_dtype;
    for (const std::int64_t k : cfg.mtp_ks) {
      auto plain = runPrompts(metered, *prompts, base, caps.threads);
      if (!plain.ok()) return plain.error();
      RunSpec spec = base;
      spec.drafts = k;
      auto run = runPrompts(metered, *prompts, spec, caps.threads);
      if (!run.ok()) return run.error();
      if (run->outputs != plain->outputs) {
        return makeError(ErrorCode::Internal, "MTP changed the greedy tokens of a prompt");
      }
      const double base_tps = static_cast<double>(plain->tokens) / plain->wall_seconds;
      MtpRow row = mtpRow(*plain, std::move(*run), k, -1.0);  // p < 0: the model's own drafts
      if (!json) {
        std::printf(
            "MTP k=%lld, the model's own drafts on %zu chat prompts x %lld tokens: acceptance %.3f, %.2f "
            "accepted/step, "
            "plain %.2f tok/s, MTP %.2f tok/s, speedup %.2fx, relative cost %.2f, ideal %.2fx, measured/ideal %.3f\n",
            static_cast<long long>(k), prompts->size(), static_cast<long long>(mtp_tokens), row.acceptance(),
            row.gain.accepted_per_step, base_tps, row.tokensPerSecond(), row.gain.measured_speedup,
            row.gain.relative_cost, row.gain.ideal_speedup, row.gain.over_ideal);
      }
      real.push_back(std::move(row));
    }
  }

  if (json) {
    std::string d = "[";
    double mbu1 = 0.0;
    for (std::size_t i = 0; i < sweep.size(); ++i) {
      const DecodeRun& x = sweep[i];
      if (x.batch == 1) mbu1 = decodeMbu(x.bytes / static_cast<double>(x.steps), x.medianStep(), bandwidth);
      d += (i ? ", " : "") + decodeRowJson(x, bandwidth);
    }
    d += "]";
    std::string m = "[";
    double over_ideal_085 = 0.0;
    double speedup_085 = 0.0;
    for (std::size_t i = 0; i < mtp.size(); ++i) {
      const MtpRow& r = mtp[i];
      if (r.k == 1 && r.p == 0.85) {
        over_ideal_085 = r.gain.over_ideal;
        speedup_085 = r.gain.measured_speedup;
      }
      m += (i ? ", " : "") + mtpRowJson(r);
    }
    m += "]";
    std::string rm = "[";
    for (std::size_t i = 0; i < real.size(); ++i) {
      rm += (i ? ", " : "") + mtpRowJson(real[i]);
    }
    rm += "]";
    const std::string line = fmt::format(
        "{{\"model\": {}, \"weight_dtype\": \"{}\", \"backend\": \"{}\", \"threads\": {}, \"weight_bytes\": {}, "
        "\"l3_bytes\": {}, \"weights_over_l3\": {:.2f}, \"read_bandwidth_gbs\": {:.3f}, \"kv_dtype\": \"{}\", "
        "\"context\": {}, \"decode\": {}, \"mbu_batch1\": {:.4f}, \"mtp_plain_tokens_per_s\": {:.3f}, \"mtp\": {}, "
        "\"mtp_speedup_at_p085\": {:.4f}, \"mtp_speedup_over_ideal\": {:.4f}, "
        "\"draft_override\": \"bench-only: proposes the greedy continuation with probability p\", "
        "\"mtp_real_prompts\": {}, \"mtp_real_tokens\": {}, \"mtp_real\": {}, \"mtp_real_skipped\": {}, "
        "\"tracing\": {}, \"schema\": {}}}",
        jsonString(model_dir.string()), dtypeName(caps.weight_dtype), caps.backend, caps.threads, weights, l3, over_l3,
        bandwidth / 1e9, kv_dtype, context, d, mbu1, plain_tps, m, speedup_085, over_ideal_085, kMtpQuestions.size(),
        mtp_tokens, rm, jsonString(real_skipped), tracing_json, schemaRowsJson(schema_rows));
    std::printf("%s\n", line.c_str());
  }
  return okStatus();
}

}  // namespace pd::bench
