#include "pretokenizer.h"

#include <array>
#include <boost/json.hpp>
#include <string>

#include "unicode_class.h"

namespace pd::tokenizer::detail {
namespace {

// Character flags: the Unicode classes (bits 0-5, unicode_class.h) plus the literal sets the patterns
// name.
constexpr std::uint16_t kL = kLetter;
constexpr std::uint16_t kM = kMark;
constexpr std::uint16_t kN = kNumber;
constexpr std::uint16_t kP = kPunctuation;
constexpr std::uint16_t kS = kSymbol;
constexpr std::uint16_t kWs = kWhiteSpace;
constexpr std::uint16_t kCrLf = 64;          // \r or \n
constexpr std::uint16_t kSpace = 128;        // ' '
constexpr std::uint16_t kAsciiPunct = 256;   // [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]
constexpr std::uint16_t kAsciiLetter = 512;  // [A-Za-z]
constexpr std::uint16_t kCjk = 1024;         // [一-龥぀-ゟ゠-ヿ]

constexpr std::string_view kNumberGroupsRegex = "\\p{N}{1,3}";
constexpr std::string_view kCjkRunsRegex = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+";
constexpr std::string_view kDeepSeekWordsRegex =
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+";

std::uint16_t flagsOf(char32_t cp) {
  std::uint16_t f = charClasses(cp);
  if (cp == '\r' || cp == '\n') f |= kCrLf;
  if (cp == ' ') f |= kSpace;
  if (cp < 0x80 && (f & (kP | kS)) != 0) f |= kAsciiPunct;
  if ((cp >= 'A' && cp <= 'Z') || (cp >= 'a' && cp <= 'z')) f |= kAsciiLetter;
  if ((cp >= 0x4E00 && cp <= 0x9FA5) || (cp >= 0x3040 && cp <= 0x30FF)) f |= kCjk;
  return f;
}

const std::array<std::uint16_t, 128>& asciiFlags() {
  static const std::array<std::uint16_t, 128> table = [] {
    std::array<std::uint16_t, 128> t{};
    for (char32_t cp = 0; cp < 128; ++cp) t[cp] = flagsOf(cp);
    return t;
  }();
  return table;
}

// Runs the splits on code point ranges; `flags` and `offsets` describe the whole text.
class Splitter {
 public:
  Splitter(const std::vector<SplitPattern>& splits, const std::uint16_t* flags, const std::uint32_t* offsets,
           std::vector<Piece>& out)
      : splits_(splits), f_(flags), offsets_(offsets), out_(out) {}

  void run(std::size_t level, std::uint32_t b, std::uint32_t e) {
    if (level == splits_.size()) {
      out_.push_back(Piece{offsets_[b], offsets_[e]});
      return;
    }
    // Isolated: both the matches and the stretches between them become pieces.
    std::uint32_t last = b;
    std::uint32_t i = b;
    while (i < e) {
      const std::uint32_t m = match(splits_[level], i, e);
      if (m == i) {
        ++i;
        continue;
      }
      if (i > last) run(level + 1, last, i);
      run(level + 1, i, m);
      last = m;
      i = m;
    }
    if (e > last) run(level + 1, last, e);
  }

 private:
  // End of the match starting at code point i (within [i, e)), or i when nothing matches there.
  std::uint32_t match(SplitPattern pattern, std::uint32_t i, std::uint32_t e) const {
    switch (pattern) {
      case SplitPattern::NumberGroups: {
        std::uint32_t j = i;
        while (j < e && j - i < 3 && (f_[j] & kN) != 0) ++j;
        return j;
      }
      case SplitPattern::CjkRuns: {
        std::uint32_t j = i;
        while (j < e && (f_[j] & kCjk) != 0) ++j;
        return j;
      }
      case SplitPattern::DeepSeekWords:
        return matchWord(i, e);
    }
    return i;
  }

  std::uint32_t runOf(std::uint32_t j, std::uint32_t e, std::uint16_t mask) const {
    while (j < e && (f_[j] & mask) != 0) ++j;
    return j;
  }

  std::uint32_t matchWord(std::uint32_t i, std::uint32_t e) const {
    const std::uint16_t c = f_[i];
    const bool has_next = i + 1 < e;
    const std::uint16_t next = has_next ? f_[i + 1] : 0;
    // [!"#...~][A-Za-z]+
    if ((c & kAsciiPunct) != 0 && (next & kAsciiLetter) != 0) return runOf(i + 2, e, kAsciiLetter);
    // [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
    if ((c & (kCrLf | kL | kP | kS)) == 0) {
      if ((next & (kL | kM)) != 0) return runOf(i + 2, e, kL | kM);
      if ((c & kM) != 0) return i + 1;  // the optional part backs off; the mark matches alone
    } else if ((c & kL) != 0) {
      return runOf(i + 1, e, kL | kM);
    }
    // ` ?[\p{P}\p{S}]+[\r\n]*`
    if ((c & kSpace) != 0 && (next & (kP | kS)) != 0) return runOf(runOf(i + 2, e, kP | kS), e, kCrLf);
    if ((c & (kP | kS)) != 0) return runOf(runOf(i + 1, e, kP | kS), e, kCrLf);
    if ((c & kWs) == 0) return i;
    const std::uint32_t j = runOf(i + 1, e, kWs);
    // \s*[\r\n]+ : \s* backs off to the last line break of the run.
    for (std::uint32_t k = j; k > i; --k) {
      if ((f_[k - 1] & kCrLf) != 0) return k;
    }
    // \s+(?!\S) : the whole run at the end, else all but its last character.
    if (j == e) return j;
    if (j - 1 > i) return j - 1;
    // \s+
    return j;
  }

  const std::vector<SplitPattern>& splits_;
  const std::uint16_t* f_;
  const std::uint32_t* offsets_;
  std::vector<Piece>& out_;
};

Result<SplitPattern> parseSplit(const boost::json::object& split) {
  const auto* pattern = split.if_contains("pattern");
  const auto* regex = pattern != nullptr && pattern->is_object() ? pattern->as_object().if_contains("Regex") : nullptr;
  if (regex == nullptr || !regex->is_string()) {
    return makeError(ErrorCode::Unsupported, "pre_tokenizer Split: only {\"Regex\": ...} patterns are supported");
  }
  const auto* behavior = split.if_contains("behavior");
  if (behavior == nullptr || !behavior->is_string() || behavior->as_string() != "Isolated") {
    return makeError(ErrorCode::Unsupported, "pre_tokenizer Split: only behavior \"Isolated\" is supported");
  }
  const auto* invert = split.if_contains("invert");
  if (invert != nullptr && !(invert->is_bool() && !invert->as_bool())) {
    return makeError(ErrorCode::Unsupported, "pre_tokenizer Split: invert must be false");
  }
  const std::string_view text = regex->as_string();
  if (text == kNumberGroupsRegex) return SplitPattern::NumberGroups;
  if (text == kCjkRunsRegex) return SplitPattern::CjkRuns;
  if (text == kDeepSeekWordsRegex) return SplitPattern::DeepSeekWords;
  return makeError(ErrorCode::Unsupported, "pre_tokenizer Split pattern '" + std::string(text) +
                                               "' is not one this build implements (those of DeepSeek-V3)");
}

}  // namespace

Result<PreTokenizer> PreTokenizer::fromJson(const boost::json::value& pre_tokenizer) {
  if (!pre_tokenizer.is_object()) return makeError(ErrorCode::Unsupported, "pre_tokenizer must be an object");
  const auto& obj = pre_tokenizer.as_object();
  std::vector<const boost::json::object*> steps;
  const auto* type = obj.if_contains("type");
  if (type != nullptr && type->is_string() && type->as_string() == "Sequence") {
    const auto* list = obj.if_contains("pretokenizers");
    if (list == nullptr || !list->is_array()) {
      return makeError(ErrorCode::Corrupt, "pre_tokenizer Sequence without a pretokenizers array");
    }
    for (const auto& step : list->as_array()) {
      if (!step.is_object()) return makeError(ErrorCode::Corrupt, "pre_tokenizer step is not an object");
      steps.push_back(&step.as_object());
    }
  } else {
    steps.push_back(&obj);
  }
  std::vector<SplitPattern> splits;
  bool byte_level = false;
  for (const auto* step : steps) {
    const auto* step_type = step->if_contains("type");
    const std::string_view name =
        step_type != nullptr && step_type->is_string() ? std::string_view(step_type->as_string()) : "";
    if (byte_level) {
      return makeError(ErrorCode::Unsupported, "pre_tokenizer: only ByteLevel may be the last step");
    }
    if (name == "Split") {
      PD_ASSIGN_OR_RETURN(auto pattern, parseSplit(*step));
      splits.push_back(pattern);
    } else if (name == "ByteLevel") {
      const auto* prefix = step->if_contains("add_prefix_space");
      const auto* use_regex = step->if_contains("use_regex");
      if ((prefix != nullptr && !(prefix->is_bool() && !prefix->as_bool())) || use_regex == nullptr ||
          !(use_regex->is_bool() && !use_regex->as_bool())) {
        return makeError(ErrorCode::Unsupported,
                         "pre_tokenizer ByteLevel: only add_prefix_space=false, use_regex=false is supported");
      }
      byte_level = true;
    } else {
      return makeError(ErrorCode::Unsupported, "pre_tokenizer type '" + std::string(name) + "' is not supported");
    }
  }
  if (!byte_level) {
    return makeError(ErrorCode::Unsupported, "pre_tokenizer: a final ByteLevel step is required (byte-level BPE)");
  }
  return PreTokenizer(std::move(splits));
}

void PreTokenizer::split(std::string_view text, PreTokenizerScratch& scratch, std::vector<Piece>& out) const {
  if (text.empty()) return;
  auto& flags = scratch.flags;
  auto& offsets = scratch.offsets;
  flags.clear();
  offsets.clear();
  flags.reserve(text.size());
  offsets.reserve(text.size() + 1);
  const auto& ascii = asciiFlags();
  std::size_t pos = 0;
  while (pos < text.size()) {
    offsets.push_back(static_cast<std::uint32_t>(pos));
    const auto byte = static_cast<unsigned char>(text[pos]);
    if (byte < 0x80) {
      flags.push_back(ascii[byte]);
      ++pos;
    } else {
      flags.push_back(flagsOf(decodeUtf8(text, pos)));
    }
  }
  offsets.push_back(static_cast<std::uint32_t>(text.size()));
  Splitter splitter(splits_, flags.data(), offsets.data(), out);
  splitter.run(0, 0, static_cast<std::uint32_t>(flags.size()));
}

}  // namespace pd::tokenizer::detail
