// The JSONL filters of pdserve tokenize / detokenize / chat-template (text_filters.h).
#include "model_tools/text_filters.h"

#include <boost/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "pd/common/config.h"
#include "pd/tokenizer/chat_template.h"
#include "pd/tokenizer/tokenizer.h"

namespace pd::tools {
namespace {

using tokenizer::TokenId;
using tokenizer::Tokenizer;

std::filesystem::path defaultTokenizerDir() {
  return config::defaultCacheDir() / "tokenizers" / "deepseek-v3";
}

// The tokenizer of --tokenizer DIR, or the fetched DeepSeek-V3 one.
Result<Tokenizer> loadTokenizer(const TextFilterConfig& options) {
  const auto dir = options.tokenizer_dir.empty() ? defaultTokenizerDir() : options.tokenizer_dir;
  auto tok = Tokenizer::load(dir);
  if (!tok.ok() && tok.error().code == ErrorCode::NotFound) {
    Error error = std::move(tok).error();
    error.message += " (run scripts/fetch-tokenizer.sh, or pass --tokenizer DIR)";
    return error;
  }
  return tok;
}

boost::json::array toJsonIds(const std::vector<TokenId>& ids) {
  boost::json::array out;
  out.reserve(ids.size());
  for (const TokenId id : ids) out.push_back(id);
  return out;
}

Result<std::vector<TokenId>> encodeText(const Tokenizer& tok, std::string_view text, bool add_bos) {
  PD_ASSIGN_OR_RETURN(auto ids, tok.encode(text));
  if (!add_bos) return ids;
  const std::optional<TokenId> bos = tok.bosId();
  if (!bos) return makeError(ErrorCode::InvalidArgument, "--add-bos: the tokenizer has no bos_token");
  std::vector<TokenId> with_bos;
  with_bos.reserve(ids.size() + 1);
  with_bos.push_back(*bos);
  for (const TokenId id : ids) with_bos.push_back(id);
  return with_bos;
}

const char* commandName(TextFilterKind kind) {
  switch (kind) {
    case TextFilterKind::Tokenize:
      return "tokenize";
    case TextFilterKind::Detokenize:
      return "detokenize";
    case TextFilterKind::ChatTemplate:
      return "chat-template";
  }
  return "?";
}

}  // namespace

struct TextFilter::State {
  TextFilterConfig config;
  Tokenizer tok;
  std::optional<chat::ChatTemplate> chat_template;

  Result<boost::json::object> tokenize(const boost::json::object& in) const {
    const auto* text = in.if_contains("text");
    if (text == nullptr || !text->is_string()) {
      return makeError(ErrorCode::InvalidArgument, "expected {\"text\": string}");
    }
    PD_ASSIGN_OR_RETURN(auto ids, encodeText(tok, text->as_string(), config.add_bos));
    return boost::json::object{{"ids", toJsonIds(ids)}};
  }

  Result<boost::json::object> detokenize(const boost::json::object& in) const {
    const auto* ids_json = in.if_contains("ids");
    if (ids_json == nullptr || !ids_json->is_array()) {
      return makeError(ErrorCode::InvalidArgument, "expected {\"ids\": [integer, ...]}");
    }
    std::vector<TokenId> ids;
    ids.reserve(ids_json->as_array().size());
    for (const auto& v : ids_json->as_array()) {
      if (!v.is_int64() || v.as_int64() < 0 || v.as_int64() > 0xFFFFFFFFll ||
          !tok.isKnownId(static_cast<TokenId>(v.as_int64()))) {
        return makeError(ErrorCode::InvalidArgument, "id " + boost::json::serialize(v) +
                                                         " is not in the vocabulary (0.." +
                                                         std::to_string(tok.vocabSize() - 1) + ")");
      }
      ids.push_back(static_cast<TokenId>(v.as_int64()));
    }
    return boost::json::object{{"text", tok.decode(ids, config.skip_special)}};
  }

  Result<boost::json::object> chatTemplate(const boost::json::object& in) const {
    const auto* messages = in.if_contains("messages");
    if (messages == nullptr || !messages->is_array()) {
      return makeError(ErrorCode::InvalidArgument, "expected {\"messages\": [...]}");
    }
    const auto* agp = in.if_contains("add_generation_prompt");
    if (agp != nullptr && !agp->is_bool() && !agp->is_null()) {
      return makeError(ErrorCode::InvalidArgument, "add_generation_prompt must be a boolean");
    }
    const auto* tools = in.if_contains("tools");
    const auto* kwargs = in.if_contains("chat_template_kwargs");
    if (kwargs != nullptr && !kwargs->is_object() && !kwargs->is_null()) {
      return makeError(ErrorCode::InvalidArgument, "chat_template_kwargs must be an object");
    }
    const std::string messages_json = boost::json::serialize(*messages);
    const std::string tools_json = tools != nullptr ? boost::json::serialize(*tools) : std::string();
    const std::string kwargs_json = kwargs != nullptr && kwargs->is_object() ? boost::json::serialize(*kwargs) : "";
    PD_ASSIGN_OR_RETURN(auto rendered, chat_template->render(chat::ChatRequest{
                                           messages_json, tools_json,
                                           agp != nullptr && agp->is_bool() && agp->as_bool(), kwargs_json}));
    PD_ASSIGN_OR_RETURN(auto ids, tok.encode(rendered));
    return boost::json::object{{"rendered", rendered}, {"ids", toJsonIds(ids)}};
  }
};

Result<TextFilter> TextFilter::create(const TextFilterConfig& cfg) {
  PD_ASSIGN_OR_RETURN(Tokenizer tok, loadTokenizer(cfg));
  std::optional<chat::ChatTemplate> tmpl;
  if (cfg.kind == TextFilterKind::ChatTemplate) {
    PD_ASSIGN_OR_RETURN(chat::ChatTemplate t, chat::ChatTemplate::fromTokenizer(tok));
    tmpl.emplace(std::move(t));
  }
  return TextFilter(std::make_unique<State>(State{cfg, std::move(tok), std::move(tmpl)}));
}

TextFilter::TextFilter(std::unique_ptr<State> state) : state_(std::move(state)) {}
TextFilter::~TextFilter() = default;
TextFilter::TextFilter(TextFilter&&) noexcept = default;
TextFilter& TextFilter::operator=(TextFilter&&) noexcept = default;

Result<std::string> TextFilter::answer(std::string_view line) const {
  boost::system::error_code ec;
  const boost::json::value input = boost::json::parse(line, ec);
  if (ec) return makeError(ErrorCode::InvalidArgument, "invalid JSON: " + ec.message());
  if (!input.is_object()) return makeError(ErrorCode::InvalidArgument, "expected a JSON object");
  const boost::json::object& in = input.as_object();
  Result<boost::json::object> out = state_->config.kind == TextFilterKind::Tokenize     ? state_->tokenize(in)
                                    : state_->config.kind == TextFilterKind::Detokenize ? state_->detokenize(in)
                                                                                        : state_->chatTemplate(in);
  if (!out.ok()) return out.error();
  return boost::json::serialize(*out);
}

int TextFilter::run(std::istream& in, std::FILE* out, std::FILE* err) const {
  std::string line;
  std::size_t line_no = 0;
  bool failed = false;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    Result<std::string> answered = answer(line);
    std::string text;
    if (answered.ok()) {
      text = std::move(answered).value();
    } else {
      failed = true;
      std::fprintf(err, "pdserve %s: line %zu: %s\n", commandName(state_->config.kind), line_no,
                   answered.error().message.c_str());
      text = boost::json::serialize(boost::json::object{{"error", answered.error().message}});
    }
    text.push_back('\n');
    std::fwrite(text.data(), 1, text.size(), out);
  }
  std::fflush(out);
  return failed ? 2 : 0;
}

}  // namespace pd::tools
