// pdserve tokenize | detokenize | chat-template: JSONL filters (stdin -> stdout) for debugging
// prompts with the same tokenizer and chat template the router uses.
//
// One output line per non-blank input line, in order. A line that cannot be processed (bad
// JSON, a missing field, text that is not UTF-8, an id outside the vocabulary, a template error)
// gets {"error": "..."} on stdout, the same message on stderr, and the command exits 2 after the
// last line. Blank lines are skipped. The filters are tools/model_tools/text_filters.h.
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "cli.h"
#include "model_tools/text_filters.h"

namespace pd::cli {
namespace {

// Loads the filter, then filters stdin onto stdout.
int runFilter(const tools::TextFilterConfig& options) {
  auto filter = tools::TextFilter::create(options);
  if (!filter.ok()) return reportFailure(filter.error());
  return filter->run(std::cin, stdout, stderr);
}

}  // namespace

int runTokenize(const std::vector<std::string>& args) {
  tools::TextFilterConfig options;
  options.kind = tools::TextFilterKind::Tokenize;
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
  return runFilter(options);
}

int runDetokenize(const std::vector<std::string>& args) {
  tools::TextFilterConfig options;
  options.kind = tools::TextFilterKind::Detokenize;
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
  return runFilter(options);
}

int runChatTemplate(const std::vector<std::string>& args) {
  tools::TextFilterConfig options;
  options.kind = tools::TextFilterKind::ChatTemplate;
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
  return runFilter(options);
}

}  // namespace pd::cli
