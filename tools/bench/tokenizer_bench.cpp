// pd_tokenizer_bench: single-thread encode throughput of pd::tokenizer on a mixed corpus, and the
// corpus writer shared with the reference run (tools/bench/tokenizer_reference.mjs). Run both
// through tools/bench/tokenizer_bench.sh, which prints the two MB/s and their ratio.
//
//   pd_tokenizer_bench write-corpus --golden FILE --prose DIR --sources DIR... --tokenizer DIR --out FILE
//   pd_tokenizer_bench run --tokenizer DIR --corpus FILE [--passes N]
//
// The corpus (JSONL {"category", "text"}, documents of about 2 KB) has four parts:
//   multilingual  the golden texts: natural sentences in 23 categories (scripts, numbers, emoji...)
//   prose         English prose: the license texts in --prose (Debian's /usr/share/common-licenses)
//   code          C++, CMake, shell and Markdown files of --sources (this repository)
//   vocab-mix     decoded random vocabulary ids (seeded): every script the vocabulary covers, and
//                 pieces that are rarely whole tokens (the slow path of any BPE)
#include <algorithm>
#include <boost/json.hpp>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "pd/tokenizer/tokenizer.h"

namespace {

namespace fs = std::filesystem;
using pd::tokenizer::TokenId;
using pd::tokenizer::Tokenizer;

constexpr std::size_t kDocBytes = 2048;  // documents are cut near this size: a typical prompt turn
constexpr std::uint32_t kSeed = 20250611;

struct Args {
  std::string command;
  std::string tokenizer;
  std::string golden;
  std::string prose;
  std::vector<std::string> sources;
  std::string corpus;
  std::string out;
  int passes = 5;
};

bool parseArgs(int argc, char** argv, Args& args) {
  if (argc < 2) return false;
  args.command = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string flag = argv[i];
    const auto value = [&](std::string& into) {
      if (i + 1 >= argc) return false;
      into = argv[++i];
      return true;
    };
    bool ok = true;
    if (flag == "--tokenizer")
      ok = value(args.tokenizer);
    else if (flag == "--golden")
      ok = value(args.golden);
    else if (flag == "--prose")
      ok = value(args.prose);
    else if (flag == "--corpus")
      ok = value(args.corpus);
    else if (flag == "--out")
      ok = value(args.out);
    else if (flag == "--passes") {
      std::string n;
      ok = value(n);
      int passes = 0;
      ok = ok && std::from_chars(n.data(), n.data() + n.size(), passes).ec == std::errc();
      args.passes = ok ? std::max(1, passes) : 0;
    } else if (flag == "--sources") {
      while (i + 1 < argc && std::strncmp(argv[i + 1], "--", 2) != 0) args.sources.emplace_back(argv[++i]);
    } else {
      ok = false;
    }
    if (!ok) return false;
  }
  return true;
}

std::string readFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Document {
  std::string category;
  std::string text;
};

// Cuts text into documents of about kDocBytes at line ends.
void addDocuments(const std::string& category, const std::string& text, std::vector<Document>& docs) {
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = std::min(text.size(), pos + kDocBytes);
    if (end < text.size()) {
      const std::size_t nl = text.rfind('\n', end);
      if (nl != std::string::npos && nl > pos) end = nl + 1;
    }
    docs.push_back({category, text.substr(pos, end - pos)});
    pos = end;
  }
}

std::string readTree(const std::vector<std::string>& dirs, const std::vector<std::string>& extensions) {
  std::vector<fs::path> files;
  for (const auto& dir : dirs) {
    if (!fs::is_directory(dir)) continue;
    for (const auto& entry : fs::recursive_directory_iterator(dir)) {
      const auto ext = entry.path().extension().string();
      if (entry.is_regular_file() &&
          (extensions.empty() || std::find(extensions.begin(), extensions.end(), ext) != extensions.end())) {
        files.push_back(entry.path());
      }
    }
  }
  std::sort(files.begin(), files.end());
  std::string text;
  for (const auto& f : files) text += readFile(f);
  return text;
}

int writeCorpus(const Args& args) {
  auto tok = Tokenizer::load(args.tokenizer);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.error().toString().c_str());
    return 1;
  }
  std::vector<Document> docs;
  std::string golden;
  std::istringstream lines(readFile(args.golden));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    golden += std::string(boost::json::parse(line).at("text").as_string()) + "\n";
  }
  addDocuments("multilingual", golden, docs);
  addDocuments("prose", readTree({args.prose}, {}), docs);
  addDocuments("code", readTree(args.sources, {".cpp", ".h", ".cmake", ".txt", ".sh", ".md"}), docs);
  std::mt19937 rng(kSeed);  // NOLINT(bugprone-random-generator-seed): the same corpus in every run
  std::string mixed;
  for (int d = 0; d < 500; ++d) {
    std::vector<TokenId> ids(256);
    for (auto& id : ids) id = 3 + static_cast<TokenId>(rng() % 127997);
    mixed += tok->decode(ids) + "\n";
  }
  addDocuments("vocab-mix", mixed, docs);
  std::ofstream out(args.out, std::ios::binary);
  std::map<std::string, std::size_t> bytes;
  for (const auto& doc : docs) {
    out << boost::json::serialize(boost::json::object{{"category", doc.category}, {"text", doc.text}}) << "\n";
    bytes[doc.category] += doc.text.size();
  }
  std::printf("corpus %s: %zu documents;", args.out.c_str(), docs.size());
  for (const auto& [category, n] : bytes) std::printf(" %s %.2f MB", category.c_str(), static_cast<double>(n) / 1e6);
  std::printf("\n");
  return 0;
}

int run(const Args& args) {
  const auto load_start = std::chrono::steady_clock::now();
  auto tok = Tokenizer::load(args.tokenizer);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.error().toString().c_str());
    return 1;
  }
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
  std::vector<Document> docs;
  std::map<std::string, double> bytes;
  double total_bytes = 0;
  std::istringstream lines(readFile(args.corpus));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    const auto v = boost::json::parse(line);
    docs.push_back({std::string(v.at("category").as_string()), std::string(v.at("text").as_string())});
    bytes[docs.back().category] += static_cast<double>(docs.back().text.size());
    total_bytes += static_cast<double>(docs.back().text.size());
  }
  // Warm-up pass (page faults, caches), then timed passes; the best is reported, per category
  // and for the whole corpus.
  std::size_t tokens = 0;
  std::uint64_t checksum = 0;
  for (const auto& doc : docs) {
    const auto ids = tok->encode(doc.text).value();
    tokens += ids.size();
    for (const TokenId id : ids) checksum = checksum * 31 + id;
  }
  std::map<std::string, double> best;
  double best_total = 1e30;
  for (int p = 0; p < args.passes; ++p) {
    std::map<std::string, double> seconds;
    double total = 0;
    for (const auto& doc : docs) {
      const auto start = std::chrono::steady_clock::now();
      const auto ids = tok->encode(doc.text);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (!ids.ok()) return 1;
      seconds[doc.category] += s;
      total += s;
    }
    best_total = std::min(best_total, total);
    for (const auto& [category, s] : seconds) {
      best[category] = best.count(category) != 0 ? std::min(best[category], s) : s;
    }
  }
  std::printf("pdserve: %.2f MB/s total;", total_bytes / 1e6 / best_total);
  for (const auto& [category, s] : best) std::printf(" %s %.2f MB/s;", category.c_str(), bytes[category] / 1e6 / s);
  std::printf(" (%.2f MB, %zu docs, %zu tokens, checksum %llu, best of %d passes %.3f s, load %.2f s)\n",
              total_bytes / 1e6, docs.size(), tokens, static_cast<unsigned long long>(checksum), args.passes,
              best_total, load_s);
  return 0;
}

int dispatch(int argc, char** argv) {
  Args args;
  if (!parseArgs(argc, argv, args) || (args.command != "write-corpus" && args.command != "run")) {
    std::fprintf(stderr,
                 "usage: pd_tokenizer_bench write-corpus --golden FILE --prose DIR --sources DIR... --tokenizer DIR "
                 "--out FILE\n"
                 "       pd_tokenizer_bench run --tokenizer DIR --corpus FILE [--passes N]\n");
    return 2;
  }
  return args.command == "run" ? run(args) : writeCorpus(args);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return dispatch(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pd_tokenizer_bench: %s\n", e.what());
    return 1;
  }
}
