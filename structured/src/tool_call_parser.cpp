#include "pd/structured/tool_call_parser.h"

#include <algorithm>
#include <initializer_list>

namespace pd::structured {
namespace {

constexpr std::string_view kCallsBegin = "<｜tool▁calls▁begin｜>";
constexpr std::string_view kCallsEnd = "<｜tool▁calls▁end｜>";
constexpr std::string_view kCallBegin = "<｜tool▁call▁begin｜>";
constexpr std::string_view kCallEnd = "<｜tool▁call▁end｜>";
constexpr std::string_view kToolSep = "<｜tool▁sep｜>";
constexpr std::string_view kFenceOpen = "```json\n";
constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";

// The longest proper prefix of `marker` that `text` ends with: text that may be the start of it.
std::size_t partialSuffix(std::string_view text, std::string_view marker) {
  for (std::size_t k = std::min(text.size(), marker.size() - 1); k > 0; --k) {
    if (text.substr(text.size() - k) == marker.substr(0, k)) return k;
  }
  return 0;
}

bool isSpace(char c) {
  return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

std::string trim(std::string_view s) {
  while (!s.empty() && isSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && isSpace(s.back())) s.remove_suffix(1);
  return std::string(s);
}

}  // namespace

std::string_view toolCallFormatName(ToolCallFormat format) {
  return format == ToolCallFormat::DeepSeekV3 ? "deepseek_v3" : "deepseek_v31";
}

std::optional<ToolCallFormat> detectToolCallFormat(std::string_view chat_template) {
  // V3 writes the call's type before the separator and the name after; V3.1 the name before.
  if (chat_template.find("'<｜tool▁sep｜>' + tool['function']['name']") != std::string_view::npos) {
    return ToolCallFormat::DeepSeekV3;
  }
  if (chat_template.find("tool['function']['name'] + '<｜tool▁sep｜>'") != std::string_view::npos) {
    return ToolCallFormat::DeepSeekV31;
  }
  return std::nullopt;
}

void ToolParseResult::add(const ToolParseDelta& delta) {
  content += delta.content;
  for (const auto& d : delta.tool_calls) {
    if (d.index >= tool_calls.size()) tool_calls.resize(d.index + 1);
    ToolCall& call = tool_calls[d.index];
    if (!d.id.empty()) call.id = d.id;
    if (!d.name.empty()) call.name = d.name;
    call.arguments += d.arguments;
  }
}

ToolCallParser::ToolCallParser(ToolCallFormat format, std::string id_prefix)
    : format_(format), id_prefix_(std::move(id_prefix)) {}

ToolParseDelta ToolCallParser::feed(std::string_view text) {
  pending_ += text;
  return drain(false);
}

ToolParseDelta ToolCallParser::finish() {
  return drain(true);
}

ToolParseResult ToolCallParser::parseAll(ToolCallFormat format, std::string id_prefix, std::string_view text) {
  ToolCallParser parser(format, std::move(id_prefix));
  ToolParseResult result;
  result.add(parser.feed(text));
  result.add(parser.finish());
  return result;
}

ToolParseDelta ToolCallParser::drain(bool final) {
  ToolParseDelta out;
  auto arguments_of = [&](std::string text) {
    if (text.empty()) return;
    if (!out.tool_calls.empty() && out.tool_calls.back().index == calls_ - 1) {
      out.tool_calls.back().arguments += text;
    } else {
      out.tool_calls.push_back(ToolCallDelta{calls_ - 1, {}, {}, std::move(text)});
    }
  };
  for (;;) {
    switch (state_) {
      case State::Content: {
        const auto at = pending_.find(kCallsBegin);
        if (at != std::string::npos) {
          out.content += pending_.substr(0, at);
          pending_.erase(0, at + kCallsBegin.size());
          state_ = State::BetweenCalls;
          continue;
        }
        const std::size_t hold = final ? 0 : partialSuffix(pending_, kCallsBegin);
        out.content += pending_.substr(0, pending_.size() - hold);
        pending_.erase(0, pending_.size() - hold);
        return out;
      }
      case State::BetweenCalls: {
        std::size_t skip = 0;
        while (skip < pending_.size() && isSpace(pending_[skip])) ++skip;
        pending_.erase(0, skip);
        if (pending_.empty()) return out;
        if (pending_.starts_with(kCallBegin)) {
          pending_.erase(0, kCallBegin.size());
          ++calls_;
          state_ = format_ == ToolCallFormat::DeepSeekV3 ? State::Type : State::Name;
          continue;
        }
        if (pending_.starts_with(kCallsEnd)) {
          pending_.erase(0, kCallsEnd.size());
          state_ = State::AfterCalls;
          continue;
        }
        if (!final && (kCallBegin.starts_with(pending_) || kCallsEnd.starts_with(pending_))) return out;
        // Not a marker: content, up to where the next marker could start.
        std::size_t next = pending_.find('<', 1);
        if (next == std::string::npos) next = pending_.size();
        out.content += pending_.substr(0, next);
        pending_.erase(0, next);
        continue;
      }
      case State::Type: {
        const auto at = pending_.find(kToolSep);
        if (at == std::string::npos) {
          if (final) pending_.clear();
          return out;
        }
        pending_.erase(0, at + kToolSep.size());
        state_ = State::Name;
        continue;
      }
      case State::Name: {
        const std::string_view end = format_ == ToolCallFormat::DeepSeekV3 ? std::string_view("\n") : kToolSep;
        const auto at = pending_.find(end);
        if (at == std::string::npos) {
          if (final) pending_.clear();  // a call cut off inside its name is no call
          return out;
        }
        out.tool_calls.push_back(
            ToolCallDelta{calls_ - 1, id_prefix_ + std::to_string(calls_ - 1), trim(pending_.substr(0, at)), {}});
        pending_.erase(0, at + end.size());
        state_ = format_ == ToolCallFormat::DeepSeekV3 ? State::Fence : State::Arguments;
        continue;
      }
      case State::Fence:
        if (pending_.starts_with(kFenceOpen)) {
          pending_.erase(0, kFenceOpen.size());
        } else if (!final && kFenceOpen.starts_with(pending_)) {
          return out;
        }
        state_ = State::Arguments;  // no fence: the arguments start right here
        continue;
      case State::Arguments: {
        const auto at = pending_.find(kCallEnd);
        if (at != std::string::npos) {
          std::string_view args(pending_.data(), at);
          if (format_ == ToolCallFormat::DeepSeekV3) {
            for (const std::string_view fence : {std::string_view("\n```"), std::string_view("```")}) {
              if (args.ends_with(fence)) {
                args.remove_suffix(fence.size());
                break;
              }
            }
          }
          arguments_of(std::string(args));
          pending_.erase(0, at + kCallEnd.size());
          state_ = State::BetweenCalls;
          continue;
        }
        std::size_t hold = 0;
        if (!final) {
          hold = partialSuffix(pending_, kCallEnd);
          if (format_ == ToolCallFormat::DeepSeekV3) {
            // The closing fence before the end marker is not part of the arguments.
            for (const std::string_view end :
                 {std::string_view("\n```<｜tool▁call▁end｜>"), std::string_view("```<｜tool▁call▁end｜>")}) {
              hold = std::max(hold, partialSuffix(pending_, end));
            }
          }
        }
        arguments_of(pending_.substr(0, pending_.size() - hold));
        pending_.erase(0, pending_.size() - hold);
        return out;
      }
      case State::AfterCalls:
        out.content += pending_;
        pending_.clear();
        return out;
    }
  }
}

ReasoningParser::ReasoningParser(bool prompt_opened) : state_(prompt_opened ? State::Reasoning : State::Start) {}

ReasoningDelta ReasoningParser::feed(std::string_view text) {
  pending_ += text;
  return drain(false);
}

ReasoningDelta ReasoningParser::finish() {
  return drain(true);
}

ReasoningDelta ReasoningParser::parseAll(bool prompt_opened, std::string_view text) {
  ReasoningParser parser(prompt_opened);
  ReasoningDelta all = parser.feed(text);
  const ReasoningDelta last = parser.finish();
  all.reasoning += last.reasoning;
  all.content += last.content;
  return all;
}

ReasoningDelta ReasoningParser::drain(bool final) {
  ReasoningDelta out;
  for (;;) {
    switch (state_) {
      case State::Start: {
        std::size_t skip = 0;
        while (skip < pending_.size() && isSpace(pending_[skip])) ++skip;
        const std::string_view rest = std::string_view(pending_).substr(skip);
        if (rest.starts_with(kThinkOpen)) {
          pending_.erase(0, skip + kThinkOpen.size());
          state_ = State::Reasoning;
          continue;
        }
        if (!final && kThinkOpen.starts_with(rest)) return out;  // maybe "<think>" still coming
        state_ = State::Content;
        continue;
      }
      case State::Reasoning: {
        const auto at = pending_.find(kThinkClose);
        if (at != std::string::npos) {
          out.reasoning += pending_.substr(0, at);
          pending_.erase(0, at + kThinkClose.size());
          state_ = State::ContentStart;
          continue;
        }
        const std::size_t hold = final ? 0 : partialSuffix(pending_, kThinkClose);
        out.reasoning += pending_.substr(0, pending_.size() - hold);
        pending_.erase(0, pending_.size() - hold);
        return out;
      }
      case State::ContentStart: {
        std::size_t skip = 0;
        while (skip < pending_.size() && pending_[skip] == '\n') ++skip;
        pending_.erase(0, skip);
        if (pending_.empty()) return out;
        state_ = State::Content;
        continue;
      }
      case State::Content:
        out.content += pending_;
        pending_.clear();
        return out;
    }
  }
}

ReasoningStyle detectReasoning(std::string_view chat_template) {
  ReasoningStyle style;
  style.uses_think = chat_template.find(kThinkOpen) != std::string_view::npos ||
                     chat_template.find(kThinkClose) != std::string_view::npos;
  // R1 (and V3.1 in thinking mode) end the generation prompt with "<｜Assistant｜><think>\n".
  style.prompt_opens_think = chat_template.find("<｜Assistant｜><think>") != std::string_view::npos;
  return style;
}

}  // namespace pd::structured
