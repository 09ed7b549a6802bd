// Request bodies and arrival times of `pdserve bench serve` (workload.h).
#include "bench/serve/workload.h"

#include <fmt/format.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cmath>
#include <fstream>
#include <sstream>

namespace pd::bench {
namespace {

// SplitMix64: a small, well-mixed generator whose stream is the same on every platform
// (std:: distributions are not).
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  std::uint64_t below(std::uint64_t n) { return n == 0 ? 0 : next() % n; }
};

std::string randomWord(SplitMix64& rng) {
  static constexpr std::string_view kConsonants = "bcdfghjklmnprstvwz";
  static constexpr std::string_view kVowels = "aeiou";
  std::string word;
  const auto syllables = 1 + rng.below(2);
  for (std::uint64_t i = 0; i < syllables; ++i) {
    word += kConsonants[rng.below(kConsonants.size())];
    word += kVowels[rng.below(kVowels.size())];
  }
  return word;
}

boost::json::object baseBody(const WorkloadOptions& o, std::int64_t max_tokens) {
  boost::json::object body;
  body["model"] = o.model;
  body["max_tokens"] = max_tokens;
  body["temperature"] = o.temperature;
  body["stream"] = true;
  body["stream_options"] = boost::json::object{{"include_usage", true}};
  if (o.ignore_eos) body["ignore_eos"] = true;
  if (o.return_token_ids) body["return_token_ids"] = true;
  return body;
}

}  // namespace

const char* endpointPath(Endpoint endpoint) {
  return endpoint == Endpoint::Chat ? "/v1/chat/completions" : "/v1/completions";
}

std::vector<std::int64_t> randomTokenIds(std::uint64_t seed, std::int64_t count, std::int64_t min, std::int64_t max) {
  SplitMix64 rng{seed};
  std::vector<std::int64_t> ids(static_cast<std::size_t>(std::max<std::int64_t>(count, 0)));
  for (auto& id : ids) id = min + static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(max - min)));
  return ids;
}

double unitInterval(std::uint64_t bits) {
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

Result<std::vector<double>> parsePositiveNumbers(const std::string& text, const std::string& flag) {
  std::vector<double> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    auto comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    const std::string item = text.substr(pos, comma - pos);
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    if (item.empty() || end != item.c_str() + item.size() || !std::isfinite(v) || !(v > 0)) {
      return makeError(
          ErrorCode::InvalidArgument,
          fmt::format("--{}: '{}' is not a positive number (expected a comma-separated list)", flag, item));
    }
    out.push_back(v);
    pos = comma + 1;
  }
  return out;
}

Result<ServedModel> parseModelList(const std::string& body) {
  boost::system::error_code ec;
  const auto v = boost::json::parse(body, ec);
  if (!ec && v.is_object()) {
    if (const auto* data = v.as_object().if_contains("data"); data != nullptr && data->is_array()) {
      for (const auto& m : data->as_array()) {
        if (!m.is_object()) continue;
        const auto& o = m.as_object();
        const auto* id = o.if_contains("id");
        if (id == nullptr || !id->is_string()) continue;
        ServedModel out;
        out.id = std::string(id->as_string());
        const auto positive = [&](const char* key) -> std::int64_t {
          const auto* f = o.if_contains(key);
          if (f == nullptr || !f->is_int64()) return 0;
          return std::max<std::int64_t>(f->as_int64(), 0);
        };
        out.max_model_len = positive("max_model_len");
        out.vocab_size = positive("vocab_size");
        return out;
      }
    }
  }
  return makeError(ErrorCode::PeerFailed, "GET /v1/models listed no model");
}

Result<std::vector<std::string>> fitWorkload(WorkloadOptions& o, std::int64_t vocab_size, std::int64_t max_model_len) {
  std::vector<std::string> notes;
  if (vocab_size > 0 && o.token_id_max > vocab_size) {
    notes.push_back(fmt::format("token ids below {} (the vocabulary), not {}", vocab_size, o.token_id_max));
    o.token_id_max = vocab_size;
    if (o.token_id_min >= o.token_id_max) {
      notes.push_back(fmt::format("token ids from 0, not {}", o.token_id_min));
      o.token_id_min = 0;
    }
  }
  if (max_model_len > 0 && o.input_tokens + o.output_tokens > max_model_len) {
    if (max_model_len < 2) {
      return makeError(
          ErrorCode::InvalidArgument,
          fmt::format("the served context of {} tokens leaves no room for a prompt and an output", max_model_len));
    }
    const std::int64_t input = std::min(o.input_tokens, max_model_len - 1);
    const std::int64_t output = std::min(o.output_tokens, max_model_len - input);
    notes.push_back(fmt::format("{} prompt + {} output tokens (the context is {}), not {} + {}", input, output,
                                max_model_len, o.input_tokens, o.output_tokens));
    o.input_tokens = input;
    o.output_tokens = output;
  }
  return notes;
}

std::vector<RequestSpec> randomRequests(const WorkloadOptions& options, std::int64_t count) {
  std::vector<RequestSpec> out;
  out.reserve(static_cast<std::size_t>(std::max<std::int64_t>(count, 0)));
  const auto span = static_cast<std::uint64_t>(std::max<std::int64_t>(options.token_id_max - options.token_id_min, 1));
  for (std::int64_t i = 0; i < count; ++i) {
    SplitMix64 rng{options.seed * 0x2545F4914F6CDD1DULL + static_cast<std::uint64_t>(i)};
    rng.next();
    auto body = baseBody(options, options.output_tokens);
    if (options.endpoint == Endpoint::Completions) {
      boost::json::array ids;
      ids.reserve(static_cast<std::size_t>(options.input_tokens));
      for (std::int64_t t = 0; t < options.input_tokens; ++t) {
        ids.push_back(options.token_id_min + static_cast<std::int64_t>(rng.below(span)));
      }
      body["prompt"] = std::move(ids);
    } else {
      std::string text;
      for (std::int64_t t = 0; t < options.input_tokens; ++t) {
        if (t > 0) text += ' ';
        text += randomWord(rng);
      }
      body["messages"] = boost::json::array{boost::json::object{{"role", "user"}, {"content", text}}};
    }
    out.push_back({boost::json::serialize(body), options.input_tokens, options.output_tokens});
  }
  return out;
}

Result<std::vector<RequestSpec>> parsePromptLines(const std::string& text, const std::string& name,
                                                  const WorkloadOptions& options) {
  std::vector<RequestSpec> out;
  std::istringstream in(text);
  std::string line;
  std::int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", name, line_no);
    boost::system::error_code ec;
    const boost::json::value v = boost::json::parse(line, ec);
    if (ec) return makeError(ErrorCode::InvalidArgument, fmt::format("{}: not JSON ({})", where, ec.message()));
    if (!v.is_object()) return makeError(ErrorCode::InvalidArgument, where + ": must be a JSON object");
    const auto& o = v.as_object();
    std::int64_t max_tokens = options.output_tokens;
    if (const auto* m = o.if_contains("max_tokens")) {
      if (!m->is_int64() || m->as_int64() < 1) {
        return makeError(ErrorCode::InvalidArgument, where + ": \"max_tokens\" must be an integer >= 1");
      }
      max_tokens = m->as_int64();
    }
    auto body = baseBody(options, max_tokens);
    std::int64_t prompt_tokens = 0;
    const auto* prompt = o.if_contains("prompt");
    const auto* messages = o.if_contains("messages");
    if ((prompt == nullptr) == (messages == nullptr)) {
      return makeError(ErrorCode::InvalidArgument, where + ": needs exactly one of \"prompt\" or \"messages\"");
    }
    if (messages != nullptr) {
      if (options.endpoint != Endpoint::Chat) {
        return makeError(ErrorCode::InvalidArgument, where + ": \"messages\" need --endpoint chat");
      }
      if (!messages->is_array() || messages->as_array().empty()) {
        return makeError(ErrorCode::InvalidArgument, where + ": \"messages\" must be a non-empty array");
      }
      body["messages"] = *messages;
    } else if (prompt->is_string()) {
      if (options.endpoint == Endpoint::Chat) {
        body["messages"] = boost::json::array{boost::json::object{{"role", "user"}, {"content", prompt->as_string()}}};
      } else {
        body["prompt"] = *prompt;
      }
    } else if (prompt->is_array() && options.endpoint == Endpoint::Completions) {
      for (const auto& id : prompt->as_array()) {
        if (!id.is_int64()) {
          return makeError(ErrorCode::InvalidArgument, where + ": a \"prompt\" array must hold token ids");
        }
      }
      prompt_tokens = static_cast<std::int64_t>(prompt->as_array().size());
      body["prompt"] = *prompt;
    } else {
      return makeError(ErrorCode::InvalidArgument,
                       where + ": \"prompt\" must be a string (or, for completions, an array of token ids)");
    }
    out.push_back({boost::json::serialize(body), prompt_tokens, max_tokens});
  }
  if (out.empty()) return makeError(ErrorCode::InvalidArgument, name + ": no prompts");
  return out;
}

Result<std::vector<RequestSpec>> loadPromptFile(const std::filesystem::path& path, const WorkloadOptions& options) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return makeError(ErrorCode::NotFound, fmt::format("{}: cannot open the prompt file", path.string()));
  std::ostringstream text;
  text << in.rdbuf();
  return parsePromptLines(text.str(), path.string(), options);
}

std::vector<double> poissonArrivals(double rate, std::int64_t count, std::uint64_t seed) {
  std::vector<double> out;
  if (!(rate > 0) || count <= 0) return out;
  out.reserve(static_cast<std::size_t>(count));
  SplitMix64 rng{seed ^ 0xA0761D6478BD642FULL};
  double t = 0;
  for (std::int64_t i = 0; i < count; ++i) {
    // Inverse transform of the exponential distribution; 1 − u is in (0, 1], so the log is finite.
    t += -std::log(1.0 - unitInterval(rng.next())) / rate;
    out.push_back(t);
  }
  return out;
}

}  // namespace pd::bench
