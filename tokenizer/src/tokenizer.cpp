#include "pd/tokenizer/tokenizer.h"

#include <array>
#include <boost/json.hpp>
#include <fstream>
#include <sstream>

#include "added_tokens.h"
#include "bpe.h"
#include "pretokenizer.h"
#include "unicode_class.h"

namespace pd::tokenizer {

using detail::Id;
using detail::kNoId;

namespace {

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes
// for U+0100 onwards, in byte order.
std::array<char32_t, 256> byteToChar() {
  std::array<char32_t, 256> table{};
  char32_t extra = 256;
  for (unsigned b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    table[b] = printable ? b : extra++;
  }
  return table;
}

// Raw bytes of a byte-level vocabulary string; false if a character is outside the alphabet.
// Inverse of byteToChar: the byte a character stands for, or -1.
using CharToByte = std::array<std::int16_t, 512>;

bool byteLevelDecode(std::string_view token, const CharToByte& char_to_byte, std::string& out) {
  out.clear();
  if (detail::findInvalidUtf8(token) != std::string_view::npos) return false;
  std::size_t pos = 0;
  while (pos < token.size()) {
    const char32_t cp = detail::decodeUtf8(token, pos);
    if (cp >= char_to_byte.size() || char_to_byte[cp] < 0) return false;
    out.push_back(static_cast<char>(char_to_byte[cp]));
  }
  return true;
}

Result<std::string> readFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::error_code ec;
    const bool exists = std::filesystem::exists(path, ec);
    return makeError(exists ? ErrorCode::Io : ErrorCode::NotFound, path.string() + ": cannot open");
  }
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (!in.good() && !in.eof()) return makeError(ErrorCode::Io, path.string() + ": read failed");
  return std::move(buffer).str();
}

Result<boost::json::value> parseJson(std::string_view text, std::string_view what) {
  boost::system::error_code ec;
  boost::json::value value = boost::json::parse(text, ec);
  if (ec) return makeError(ErrorCode::Corrupt, std::string(what) + ": invalid JSON: " + ec.message());
  return value;
}

bool isFalseOrAbsent(const boost::json::object& obj, std::string_view key) {
  const auto* v = obj.if_contains(key);
  return v == nullptr || v->is_null() || (v->is_bool() && !v->as_bool());
}

bool isNullOrEmptyString(const boost::json::object& obj, std::string_view key) {
  const auto* v = obj.if_contains(key);
  return v == nullptr || v->is_null() || (v->is_string() && v->as_string().empty());
}

// A tokenizer_config.json token: "text" or {"content": "text", ...}.
std::string configToken(const boost::json::object& config, std::string_view key) {
  const auto* v = config.if_contains(key);
  if (v == nullptr) return {};
  if (v->is_string()) return std::string(v->as_string());
  if (v->is_object()) {
    const auto* content = v->as_object().if_contains("content");
    if (content != nullptr && content->is_string()) return std::string(content->as_string());
  }
  return {};
}

}  // namespace

class Tokenizer::Impl {
 public:
  static Result<std::unique_ptr<Impl>> build(std::string_view tokenizer_json, std::string_view config_json);

  Result<std::vector<TokenId>> encode(std::string_view text, bool add_special_tokens) const;
  std::string decode(std::span<const TokenId> ids, bool skip_special_tokens) const;
  Result<std::vector<std::string_view>> preTokenize(std::string_view text) const;
  /// Added tokens first, then the vocabulary (as Hugging Face's token_to_id).
  std::optional<TokenId> lookup(std::string_view token) const {
    Id id = added_ids.find(token);
    if (id == kNoId) id = vocab_ids.find(token);
    if (id == kNoId) return std::nullopt;
    return id;
  }

  struct Entry {
    std::string bytes;   // what decode emits
    std::string string;  // vocabulary string or added-token content
    bool known = false;
    bool special = false;
    bool added = false;  // an added token (matched before BPE), special or not
  };
  std::vector<Entry> entries;
  detail::WordTable vocab_ids;  // vocabulary string -> id
  detail::WordTable added_ids;  // added-token content -> id
  std::optional<TokenId> bos_id;
  std::optional<TokenId> eos_id;
  bool add_bos = false;
  bool add_eos = false;
  std::string bos_token;
  std::string eos_token;
  std::string pad_token;
  std::string chat_template;

 private:
  Impl(detail::PreTokenizer pre, detail::BpeModel bpe) : pre_tokenizer(std::move(pre)), model(std::move(bpe)) {}
  void encodeText(std::string_view text, std::vector<TokenId>& out) const;
  void encodeWithNormalizedTokens(std::string_view text, std::vector<TokenId>& out) const;

 public:
  detail::PreTokenizer pre_tokenizer;
  detail::BpeModel model;
  detail::AddedTokenMatcher raw_tokens;         // added tokens with normalized: false
  detail::AddedTokenMatcher normalized_tokens;  // added tokens with normalized: true
};

namespace {

struct Scratch {
  detail::PreTokenizerScratch pre;
  detail::BpeScratch bpe;
  std::vector<detail::Piece> pieces;
  std::vector<detail::Id> ids;  // one piece's BPE ids (< 2^20, so they fit a TokenId)
};

Scratch& threadScratch() {
  thread_local Scratch scratch;  // working buffers only; no state survives a call
  return scratch;
}

}  // namespace

Result<std::unique_ptr<Tokenizer::Impl>> Tokenizer::Impl::build(std::string_view tokenizer_json,
                                                                std::string_view config_json) {
  PD_ASSIGN_OR_RETURN(auto root_value, parseJson(tokenizer_json, "tokenizer.json"));
  if (!root_value.is_object()) return makeError(ErrorCode::Corrupt, "tokenizer.json: not an object");
  const auto& root = root_value.as_object();

  if (const auto* normalizer = root.if_contains("normalizer"); normalizer != nullptr && !normalizer->is_null()) {
    const auto& n = normalizer->as_object();
    const auto* list = n.if_contains("normalizers");
    const bool identity = n.contains("type") && n.at("type") == "Sequence" && list != nullptr && list->is_array() &&
                          list->as_array().empty();
    if (!identity) {
      return makeError(ErrorCode::Unsupported, "tokenizer.json: normalizer " + boost::json::serialize(*normalizer) +
                                                   " is not supported (only none / an empty Sequence)");
    }
  }
  const auto* pre_json = root.if_contains("pre_tokenizer");
  if (pre_json == nullptr || pre_json->is_null()) {
    return makeError(ErrorCode::Unsupported, "tokenizer.json: a pre_tokenizer is required");
  }
  PD_ASSIGN_OR_RETURN(auto pre, detail::PreTokenizer::fromJson(*pre_json));

  const auto* decoder = root.if_contains("decoder");
  if (decoder == nullptr || !decoder->is_object() || !decoder->as_object().contains("type") ||
      decoder->as_object().at("type") != "ByteLevel") {
    return makeError(ErrorCode::Unsupported, "tokenizer.json: only the ByteLevel decoder is supported");
  }
  if (const auto* post = root.if_contains("post_processor"); post != nullptr && !post->is_null()) {
    if (!post->is_object() || !post->as_object().contains("type") || post->as_object().at("type") != "ByteLevel") {
      return makeError(ErrorCode::Unsupported, "tokenizer.json: only a ByteLevel (or no) post_processor is supported");
    }
  }

  const auto* model_json = root.if_contains("model");
  if (model_json == nullptr || !model_json->is_object())
    return makeError(ErrorCode::Corrupt, "tokenizer.json: no model");
  const auto& model = model_json->as_object();
  if (!model.contains("type") || model.at("type") != "BPE") {
    return makeError(ErrorCode::Unsupported, "tokenizer.json: only BPE models are supported");
  }
  if (!isFalseOrAbsent(model, "byte_fallback") || !isFalseOrAbsent(model, "ignore_merges") ||
      !isFalseOrAbsent(model, "dropout") || !isNullOrEmptyString(model, "continuing_subword_prefix") ||
      !isNullOrEmptyString(model, "end_of_word_suffix")) {
    return makeError(ErrorCode::Unsupported,
                     "tokenizer.json: BPE options byte_fallback, ignore_merges, dropout, continuing_subword_prefix "
                     "and end_of_word_suffix are not supported");
  }
  const auto* vocab_json = model.if_contains("vocab");
  const auto* merges_json = model.if_contains("merges");
  if (vocab_json == nullptr || !vocab_json->is_object() || merges_json == nullptr || !merges_json->is_array()) {
    return makeError(ErrorCode::Corrupt, "tokenizer.json: model.vocab / model.merges missing");
  }
  const auto& vocab = vocab_json->as_object();

  // Vocabulary: ids, strings, and the raw bytes of each byte-level string.
  const std::array<char32_t, 256> to_char = byteToChar();
  CharToByte to_byte;
  to_byte.fill(-1);
  for (unsigned b = 0; b < 256; ++b) to_byte[to_char[b]] = static_cast<std::int16_t>(b);

  std::vector<Entry> entries;
  detail::WordTable vocab_ids;
  vocab_ids.reserve(vocab.size());
  std::vector<std::string> byte_level(vocab.size());
  std::string bytes;
  for (const auto& kv : vocab) {
    if (!kv.value().is_int64() || kv.value().as_int64() < 0 || kv.value().as_int64() >= (std::int64_t{1} << 31)) {
      return makeError(ErrorCode::Corrupt,
                       "tokenizer.json: bad id for vocabulary entry '" + std::string(kv.key()) + "'");
    }
    const auto id = static_cast<Id>(kv.value().as_int64());
    if (id >= entries.size()) entries.resize(id + 1);
    if (id >= byte_level.size()) byte_level.resize(id + 1);
    Entry& e = entries[id];
    if (e.known) return makeError(ErrorCode::Corrupt, "tokenizer.json: id " + std::to_string(id) + " used twice");
    e.known = true;
    e.string = std::string(kv.key());
    if (byteLevelDecode(kv.key(), to_byte, bytes)) {
      e.bytes = bytes;
      byte_level[id] = bytes;
    } else {
      e.bytes = e.string;  // the ByteLevel decoder passes such tokens through as UTF-8
    }
    vocab_ids.insert(e.string, id);
  }

  std::vector<detail::BpeModel::MergeRule> merges;
  std::string joined;
  merges.reserve(merges_json->as_array().size());
  for (const auto& m : merges_json->as_array()) {
    std::string_view left;
    std::string_view right;
    if (m.is_string()) {
      const std::string_view s = m.as_string();
      const std::size_t space = s.find(' ');
      if (space == std::string_view::npos || s.find(' ', space + 1) != std::string_view::npos) {
        return makeError(ErrorCode::Corrupt, "tokenizer.json: bad merge '" + std::string(s) + "'");
      }
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.as_array().size() == 2 && m.as_array()[0].is_string() && m.as_array()[1].is_string()) {
      left = m.as_array()[0].as_string();
      right = m.as_array()[1].as_string();
    } else {
      return makeError(ErrorCode::Corrupt, "tokenizer.json: bad merge " + boost::json::serialize(m));
    }
    joined.assign(left);
    joined.append(right);
    const Id l = vocab_ids.find(left);
    const Id r = vocab_ids.find(right);
    const Id lr = vocab_ids.find(joined);
    if (l == kNoId || r == kNoId || lr == kNoId) {
      return makeError(ErrorCode::Corrupt, "tokenizer.json: merge '" + std::string(left) + " " + std::string(right) +
                                               "' names a token missing from the vocabulary");
    }
    merges.push_back({l, r, lr});
  }
  PD_ASSIGN_OR_RETURN(auto bpe, detail::BpeModel::create(byte_level, merges));

  auto impl = std::unique_ptr<Impl>(new Impl(std::move(pre), std::move(bpe)));

  // Added tokens: matched before pre-tokenization; decode to their content.
  std::vector<std::pair<std::string, Id>> added;
  if (const auto* added_json = root.if_contains("added_tokens"); added_json != nullptr && added_json->is_array()) {
    for (const auto& t : added_json->as_array()) {
      if (!t.is_object()) return makeError(ErrorCode::Corrupt, "tokenizer.json: added token is not an object");
      const auto& tok = t.as_object();
      const auto* id_json = tok.if_contains("id");
      const auto* content_json = tok.if_contains("content");
      if (id_json == nullptr || !id_json->is_int64() || id_json->as_int64() < 0 ||
          id_json->as_int64() >= (std::int64_t{1} << 31) || content_json == nullptr || !content_json->is_string() ||
          content_json->as_string().empty()) {
        return makeError(ErrorCode::Corrupt, "tokenizer.json: bad added token " + boost::json::serialize(t));
      }
      if (!isFalseOrAbsent(tok, "lstrip") || !isFalseOrAbsent(tok, "rstrip") || !isFalseOrAbsent(tok, "single_word")) {
        return makeError(ErrorCode::Unsupported, "tokenizer.json: added token " + boost::json::serialize(t) +
                                                     ": lstrip / rstrip / single_word are not supported");
      }
      const auto id = static_cast<Id>(id_json->as_int64());
      const std::string content(content_json->as_string());
      if (detail::findInvalidUtf8(content) != std::string::npos) {
        return makeError(ErrorCode::Corrupt, "tokenizer.json: added token content is not UTF-8");
      }
      if (id >= entries.size()) entries.resize(id + 1);
      Entry& e = entries[id];
      e.known = true;
      e.string = content;
      // The ByteLevel decoder maps a token through the byte alphabet when it can, else keeps it.
      e.bytes = byteLevelDecode(content, to_byte, bytes) ? bytes : content;
      const auto* special = tok.if_contains("special");
      e.special = special != nullptr && special->is_bool() && special->as_bool();
      e.added = true;
      added.emplace_back(content, id);
      const auto* normalized = tok.if_contains("normalized");
      const bool is_normalized = normalized != nullptr && normalized->is_bool() && normalized->as_bool();
      (is_normalized ? impl->normalized_tokens : impl->raw_tokens).add(content, id);
    }
  }
  impl->entries = std::move(entries);
  impl->vocab_ids = std::move(vocab_ids);
  impl->added_ids.reserve(added.size());
  for (const auto& [content, id] : added) impl->added_ids.insert(content, id);

  if (!config_json.empty()) {
    PD_ASSIGN_OR_RETURN(auto config_value, parseJson(config_json, "tokenizer_config.json"));
    if (!config_value.is_object()) return makeError(ErrorCode::Corrupt, "tokenizer_config.json: not an object");
    const auto& config = config_value.as_object();
    impl->bos_token = configToken(config, "bos_token");
    impl->eos_token = configToken(config, "eos_token");
    impl->pad_token = configToken(config, "pad_token");
    impl->add_bos = !isFalseOrAbsent(config, "add_bos_token");
    impl->add_eos = !isFalseOrAbsent(config, "add_eos_token");
    const auto lookup = [&](const std::string& token, std::string_view what) -> Result<std::optional<TokenId>> {
      if (token.empty()) return std::optional<TokenId>{};
      const auto id = impl->lookup(token);
      if (!id) {
        return makeError(ErrorCode::Corrupt, "tokenizer_config.json: " + std::string(what) + " '" + token +
                                                 "' is not a token of tokenizer.json");
      }
      return id;
    };
    PD_ASSIGN_OR_RETURN(impl->bos_id, lookup(impl->bos_token, "bos_token"));
    PD_ASSIGN_OR_RETURN(impl->eos_id, lookup(impl->eos_token, "eos_token"));
    if (impl->add_bos && !impl->bos_id) {
      return makeError(ErrorCode::Corrupt, "tokenizer_config.json: add_bos_token without a bos_token");
    }
    if (impl->add_eos && !impl->eos_id) {
      return makeError(ErrorCode::Corrupt, "tokenizer_config.json: add_eos_token without an eos_token");
    }
    if (const auto* tmpl = config.if_contains("chat_template"); tmpl != nullptr) {
      if (tmpl->is_string()) {
        impl->chat_template = std::string(tmpl->as_string());
      } else if (tmpl->is_array()) {
        // [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]: the default one.
        for (const auto& named : tmpl->as_array()) {
          if (!named.is_object()) continue;
          const auto* name = named.as_object().if_contains("name");
          const auto* text = named.as_object().if_contains("template");
          if (name != nullptr && *name == "default" && text != nullptr && text->is_string()) {
            impl->chat_template = std::string(text->as_string());
          }
        }
      }
    }
  }
  return impl;
}

void Tokenizer::Impl::encodeText(std::string_view text, std::vector<TokenId>& out) const {
  Scratch& scratch = threadScratch();
  scratch.pieces.clear();
  pre_tokenizer.split(text, scratch.pre, scratch.pieces);
  for (const auto& piece : scratch.pieces) {
    scratch.ids.clear();
    model.encode(text.substr(piece.begin, piece.end - piece.begin), scratch.bpe, scratch.ids);
    for (const detail::Id id : scratch.ids) out.push_back(static_cast<TokenId>(id));
  }
}

void Tokenizer::Impl::encodeWithNormalizedTokens(std::string_view text, std::vector<TokenId>& out) const {
  std::size_t pos = 0;
  while (pos < text.size()) {
    const auto match = normalized_tokens.find(text, pos);
    if (match.begin > pos) encodeText(text.substr(pos, match.begin - pos), out);
    if (match.id == kNoId) break;
    out.push_back(match.id);
    pos = match.end;
  }
}

Result<std::vector<TokenId>> Tokenizer::Impl::encode(std::string_view text, bool add_special_tokens) const {
  if (text.size() > 0xFFFFFFF0u) return makeError(ErrorCode::InvalidArgument, "text is longer than 4 GiB");
  if (const std::size_t bad = detail::findInvalidUtf8(text); bad != std::string_view::npos) {
    return makeError(ErrorCode::InvalidArgument, "text is not valid UTF-8 (byte offset " + std::to_string(bad) + ")");
  }
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 4);
  if (add_special_tokens && add_bos) out.push_back(*bos_id);
  // Hugging Face splits off the non-normalized added tokens first, then the normalized ones in
  // what is left (the normalizer is the identity here).
  std::size_t pos = 0;
  while (pos < text.size()) {
    const auto match = raw_tokens.find(text, pos);
    if (match.begin > pos) encodeWithNormalizedTokens(text.substr(pos, match.begin - pos), out);
    if (match.id == kNoId) break;
    out.push_back(match.id);
    pos = match.end;
  }
  if (add_special_tokens && add_eos) out.push_back(*eos_id);
  return out;
}

std::string Tokenizer::Impl::decode(std::span<const TokenId> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const TokenId id : ids) {
    if (id < 0 || static_cast<std::size_t>(id) >= entries.size() || !entries[static_cast<std::size_t>(id)].known)
      continue;
    const Entry& e = entries[static_cast<std::size_t>(id)];
    if (skip_special_tokens && e.special) continue;
    bytes.append(e.bytes);
  }
  if (detail::findInvalidUtf8(bytes) == std::string::npos) return bytes;
  std::string text;
  text.reserve(bytes.size() + 16);
  detail::appendLossyUtf8(text, bytes);
  return text;
}

Result<std::vector<std::string_view>> Tokenizer::Impl::preTokenize(std::string_view text) const {
  if (text.size() > 0xFFFFFFF0u) return makeError(ErrorCode::InvalidArgument, "text is longer than 4 GiB");
  if (const std::size_t bad = detail::findInvalidUtf8(text); bad != std::string_view::npos) {
    return makeError(ErrorCode::InvalidArgument, "text is not valid UTF-8 (byte offset " + std::to_string(bad) + ")");
  }
  detail::PreTokenizerScratch scratch;
  std::vector<detail::Piece> pieces;
  pre_tokenizer.split(text, scratch, pieces);
  std::vector<std::string_view> out;
  out.reserve(pieces.size());
  for (const auto& p : pieces) out.push_back(text.substr(p.begin, p.end - p.begin));
  return out;
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Result<Tokenizer> Tokenizer::fromJson(std::string_view tokenizer_json, std::string_view tokenizer_config_json) {
  PD_ASSIGN_OR_RETURN(auto impl, Impl::build(tokenizer_json, tokenizer_config_json));
  return Tokenizer(std::move(impl));
}

Result<Tokenizer> Tokenizer::load(const std::filesystem::path& dir) {
  PD_ASSIGN_OR_RETURN(auto tokenizer_json, readFile(dir / "tokenizer.json"));
  std::string config_json;
  const auto config_path = dir / "tokenizer_config.json";
  std::error_code ec;
  if (std::filesystem::exists(config_path, ec)) {
    PD_ASSIGN_OR_RETURN(config_json, readFile(config_path));
  }
  auto result = Impl::build(tokenizer_json, config_json);
  if (!result.ok()) {
    Error error = std::move(result).error();
    error.message = dir.string() + ": " + error.message;
    return error;
  }
  return Tokenizer(std::move(result).value());
}

Result<std::vector<TokenId>> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  return impl_->encode(text, add_special_tokens);
}

std::string Tokenizer::decode(std::span<const TokenId> ids, bool skip_special_tokens) const {
  return impl_->decode(ids, skip_special_tokens);
}

Result<std::vector<std::string_view>> Tokenizer::preTokenize(std::string_view text) const {
  return impl_->preTokenize(text);
}

std::optional<std::string_view> Tokenizer::tokenBytes(TokenId id) const {
  if (!isKnownId(id)) return std::nullopt;
  return std::string_view(impl_->entries[id].bytes);
}

std::optional<std::string_view> Tokenizer::tokenString(TokenId id) const {
  if (!isKnownId(id)) return std::nullopt;
  return std::string_view(impl_->entries[id].string);
}

std::optional<TokenId> Tokenizer::tokenToId(std::string_view token) const {
  return impl_->lookup(token);
}

bool Tokenizer::isKnownId(TokenId id) const {
  return id >= 0 && static_cast<std::size_t>(id) < impl_->entries.size() &&
         impl_->entries[static_cast<std::size_t>(id)].known;
}
bool Tokenizer::isAddedToken(TokenId id) const {
  return isKnownId(id) && impl_->entries[id].added;
}
bool Tokenizer::isSpecial(TokenId id) const {
  return isKnownId(id) && impl_->entries[id].special;
}
std::size_t Tokenizer::vocabSize() const {
  return impl_->entries.size();
}
std::optional<TokenId> Tokenizer::bosId() const {
  return impl_->bos_id;
}
std::optional<TokenId> Tokenizer::eosId() const {
  return impl_->eos_id;
}
const std::string& Tokenizer::bosToken() const {
  return impl_->bos_token;
}
const std::string& Tokenizer::eosToken() const {
  return impl_->eos_token;
}
const std::string& Tokenizer::padToken() const {
  return impl_->pad_token;
}
const std::string& Tokenizer::chatTemplateSource() const {
  return impl_->chat_template;
}

}  // namespace pd::tokenizer
