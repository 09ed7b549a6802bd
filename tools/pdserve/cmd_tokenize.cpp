// pdserve tokenize | detokenize | chat-template: JSONL filters (stdin -> stdout) for debugging
// prompts with the same tokenizer and chat template the router uses.
//
// One output line per non-blank input line, in order. A line that cannot be processed (bad
// JSON, a missing field, text that is not UTF-8, an id outside the vocabulary, a template error)
// gets {"error": "..."} on stdout, the same message on stderr, and the command exits 2 after the
// last line. Blank lines are skipped.
#include <boost/json.hpp>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "cli.h"
#include "pd/tokenizer/chat_template.h"
#include "pd/tokenizer/tokenizer.h"

namespace pd::cli {
namespace {

using tokenizer::TokenId;
using tokenizer::Tokenizer;

struct TokenizerOptions {
  std::filesystem::path tokenizer_dir;
  bool add_bos = false;
  bool skip_special = false;
};

std::filesystem::path defaultTokenizerDir() {
  return config::defaultCacheDir() / "tokenizers" / "deepseek-v3";
}

// The tokenizer of --tokenizer DIR, or the fetched DeepSeek-V3 one.
Result<Tokenizer> loadTokenizer(const TokenizerOptions& options) {
  const auto dir = options.tokenizer_dir.empty() ? defaultTokenizerDir() : options.tokenizer_dir;
  auto tok = Tokenizer::load(dir);
  if (!tok.ok() && tok.error().code == ErrorCode::NotFound) {
    Error error = std::move(tok).error();
    error.message += " (run scripts/fetch-tokenizer.sh, or pass --tokenizer DIR)";
    return error;
  }
  return tok;
}

// Runs `handle` on every non-blank stdin line and prints its JSON answer. Returns the exit code.
template <class Handler>
int processLines(const char* command, Handler&& handle) {
  std::string line;
  std::size_t line_no = 0;
  bool failed = false;
  while (std::getline(std::cin, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    boost::system::error_code ec;
    const boost::json::value input = boost::json::parse(line, ec);
    Result<boost::json::object> answer =
        ec ? Result<boost::json::object>(makeError(ErrorCode::InvalidArgument, "invalid JSON: " + ec.message()))
        : !input.is_object()
            ? Result<boost::json::object>(makeError(ErrorCode::InvalidArgument, "expected a JSON object"))
            : handle(input.as_object());
    std::string out;
    if (answer.ok()) {
      out = boost::json::serialize(answer.value());
    } else {
      failed = true;
      std::fprintf(stderr, "pdserve %s: line %zu: %s\n", command, line_no, answer.error().message.c_str());
      out = boost::json::serialize(boost::json::object{{"error", answer.error().message}});
    }
    out.push_back('\n');
    std::fwrite(out.data(), 1, out.size(), stdout);
  }
  std::fflush(stdout);
  return failed ? 2 : 0;
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

}  // namespace

int runTokenize(const std::vector<std::string>& args) {
  TokenizerOptions options;
  config::OptionSet set("tokenize");
  set.add("tokenizer", &options.tokenizer_dir,
          "folder with tokenizer.json (+ tokenizer_config.json); empty: the fetched DeepSeek-V3 tokenizer")
      .add("add_bos", &options.add_bos, "prepend the BOS id (what transformers adds for DeepSeek-V3)");
  auto loaded = loadCommandOptions(
      "usage: pdserve tokenize [--tokenizer DIR] [--add-bos] < in.jsonl > out.jsonl\n"
      "Reads {\"text\": \"...\"} lines, writes {\"ids\": [...]} lines (Hugging Face-identical ids; added tokens\n"
      "such as <｜User｜> in the text become their ids).",
      {&set}, args);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  auto tok = loadTokenizer(options);
  if (!tok.ok()) return reportFailure(tok.error());
  return processLines("tokenize", [&](const boost::json::object& in) -> Result<boost::json::object> {
    const auto* text = in.if_contains("text");
    if (text == nullptr || !text->is_string()) {
      return makeError(ErrorCode::InvalidArgument, "expected {\"text\": string}");
    }
    PD_ASSIGN_OR_RETURN(auto ids, encodeText(tok.value(), text->as_string(), options.add_bos));
    return boost::json::object{{"ids", toJsonIds(ids)}};
  });
}

int runDetokenize(const std::vector<std::string>& args) {
  TokenizerOptions options;
  config::OptionSet set("detokenize");
  set.add("tokenizer", &options.tokenizer_dir,
          "folder with tokenizer.json (+ tokenizer_config.json); empty: the fetched DeepSeek-V3 tokenizer")
      .add("skip_special", &options.skip_special, "drop special tokens (BOS, EOS, pad, placeholders, <|EOT|>)");
  auto loaded = loadCommandOptions(
      "usage: pdserve detokenize [--tokenizer DIR] [--skip-special] < in.jsonl > out.jsonl\n"
      "Reads {\"ids\": [...]} lines, writes {\"text\": \"...\"} lines (one lossy UTF-8 decode of all bytes, as\n"
      "Hugging Face does: a character split across ids decodes whole, a dangling partial one as U+FFFD).",
      {&set}, args);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  auto tok = loadTokenizer(options);
  if (!tok.ok()) return reportFailure(tok.error());
  return processLines("detokenize", [&](const boost::json::object& in) -> Result<boost::json::object> {
    const auto* ids_json = in.if_contains("ids");
    if (ids_json == nullptr || !ids_json->is_array()) {
      return makeError(ErrorCode::InvalidArgument, "expected {\"ids\": [integer, ...]}");
    }
    std::vector<TokenId> ids;
    ids.reserve(ids_json->as_array().size());
    for (const auto& v : ids_json->as_array()) {
      if (!v.is_int64() || v.as_int64() < 0 || v.as_int64() > 0xFFFFFFFFll ||
          !tok->isKnownId(static_cast<TokenId>(v.as_int64()))) {
        return makeError(ErrorCode::InvalidArgument, "id " + boost::json::serialize(v) +
                                                         " is not in the vocabulary (0.." +
                                                         std::to_string(tok->vocabSize() - 1) + ")");
      }
      ids.push_back(static_cast<TokenId>(v.as_int64()));
    }
    return boost::json::object{{"text", tok->decode(ids, options.skip_special)}};
  });
}

int runChatTemplate(const std::vector<std::string>& args) {
  TokenizerOptions options;
  config::OptionSet set("chat_template");
  set.add("tokenizer", &options.tokenizer_dir,
          "folder with tokenizer.json + tokenizer_config.json (its chat_template); empty: the fetched DeepSeek-V3 one");
  auto loaded = loadCommandOptions(
      "usage: pdserve chat-template [--tokenizer DIR] < in.jsonl > out.jsonl\n"
      "Reads {\"messages\": [...], \"add_generation_prompt\": bool, \"tools\": [...]} lines (optional\n"
      "\"chat_template_kwargs\": {...} adds template variables), writes {\"rendered\": \"...\", \"ids\": [...]}:\n"
      "the prompt as transformers' apply_chat_template renders it, and its ids (no extra BOS: the template\n"
      "writes it).",
      {&set}, args);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  auto tok = loadTokenizer(options);
  if (!tok.ok()) return reportFailure(tok.error());
  auto tmpl = chat::ChatTemplate::fromTokenizer(tok.value());
  if (!tmpl.ok()) return reportFailure(tmpl.error());
  return processLines("chat-template", [&](const boost::json::object& in) -> Result<boost::json::object> {
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
    PD_ASSIGN_OR_RETURN(auto rendered, tmpl->render(chat::ChatRequest{
                                           messages_json, tools_json,
                                           agp != nullptr && agp->is_bool() && agp->as_bool(), kwargs_json}));
    PD_ASSIGN_OR_RETURN(auto ids, tok->encode(rendered));
    return boost::json::object{{"rendered", rendered}, {"ids", toJsonIds(ids)}};
  });
}

}  // namespace pd::cli
