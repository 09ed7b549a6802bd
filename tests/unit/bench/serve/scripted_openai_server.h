#pragma once
// A scripted OpenAI-compatible server for the bench serve tests: a real pd::http::Server that
// answers /v1/completions and /v1/chat/completions with server-sent events on a fixed timetable
// (first chunk after ttft_ms, then one chunk every gap_ms carrying chunk_tokens[i] tokens, then
// a usage chunk and [DONE]), /v1/models, and /metrics with MTP counters that grow per answered
// request. The request's "prompt" (completions) or first message (chat) picks a behaviour:
//   "http500"     -> 500 with an OpenAI error body
//   "cut"         -> two chunks, then the connection is cut (no terminating chunk)
//   "error-event" -> one chunk, then data: {"error": ...} and [DONE]
//   "no-done"     -> every chunk, then the stream ends without [DONE]
//   "no-usage"    -> normal, but no usage chunk (the client must count tokens itself)
//   anything else -> normal.
// Thread rules: construct and destroy on the test thread; handlers hand each request to its own
// thread (joined by the destructor), since handlers must not block.

#include <gtest/gtest.h>

#include <atomic>
#include <boost/json.hpp>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pd/common/http_server.h"

namespace pd::test {

struct Script {
  int ttft_ms = 40;
  int gap_ms = 15;
  std::vector<int> chunk_tokens{1, 2, 1, 3, 1};  // 8 tokens in 5 chunks
  int prompt_tokens = 7;
  // Per answered (normal) request, added to the /metrics counters.
  int mtp_proposed = 4;
  int mtp_accepted = 3;
  int decode_steps = 5;
};

class ScriptedOpenAiServer {
 public:
  explicit ScriptedOpenAiServer(Script script) : script_(std::move(script)) {
    std::vector<http::Route> routes;
    for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
      const bool chat = std::string_view(path) == "/v1/chat/completions";
      routes.push_back({"POST", path, [this, chat](http::Request req, http::Exchange ex) {
                          std::lock_guard lock(mutex_);
                          bodies_.push_back(req.body);
                          threads_.emplace_back([this, chat, body = std::move(req.body), ex]() mutable {
                            answer(chat, body, std::move(ex));
                          });
                        }});
    }
    routes.push_back(
        {"GET", "/v1/models", [](http::Request, http::Exchange ex) {
           ex.respond(http::Response::withBody(
               200, "application/json", R"({"object":"list","data":[{"id":"scripted-model","object":"model"}]})"));
         }});
    routes.push_back(
        {"GET", "/metrics", [this](http::Request, http::Exchange ex) {
           const auto n = static_cast<long long>(answered_.load());
           std::string text;
           text += "# HELP pdserve_decode_mtp_drafts_proposed_total MTP draft tokens proposed.\n";
           text += "# TYPE pdserve_decode_mtp_drafts_proposed_total counter\n";
           text += "pdserve_decode_mtp_drafts_proposed_total " + std::to_string(n * script_.mtp_proposed) + "\n";
           text += "pdserve_decode_mtp_drafts_accepted_total " + std::to_string(n * script_.mtp_accepted) + "\n";
           text += "pdserve_decode_steps_total " + std::to_string(n * script_.decode_steps) + "\n";
           // Split over two label sets: the reader must add them up.
           const long long tokens = n * totalTokens();
           text += "pdserve_decode_generated_tokens_total{worker=\"a\"} " + std::to_string(tokens / 2) + "\n";
           text += "pdserve_decode_generated_tokens_total{worker=\"b\"} " + std::to_string(tokens - tokens / 2) + "\n";
           ex.respond(http::Response::withBody(200, "text/plain; version=0.0.4", text));
         }});
    http::ServerOptions options;
    options.io_threads = 2;
    auto server = http::Server::start(options, std::move(routes));
    EXPECT_TRUE(server.ok()) << (server.ok() ? "" : server.error().toString());
    if (server.ok()) server_ = std::move(*server);
  }
  ScriptedOpenAiServer(const ScriptedOpenAiServer&) = delete;
  ScriptedOpenAiServer& operator=(const ScriptedOpenAiServer&) = delete;
  ~ScriptedOpenAiServer() {
    if (server_) server_->stop();
    std::vector<std::thread> threads;
    {
      std::lock_guard lock(mutex_);
      threads.swap(threads_);
    }
    for (auto& t : threads) t.join();
  }

  [[nodiscard]] std::uint16_t port() const { return server_ ? server_->port() : 0; }
  [[nodiscard]] std::string url() const { return "http://127.0.0.1:" + std::to_string(port()); }
  [[nodiscard]] int totalTokens() const {
    int n = 0;
    for (int t : script_.chunk_tokens) n += t;
    return n;
  }
  [[nodiscard]] const Script& script() const { return script_; }
  /// Every completion or chat body received, in arrival order.
  [[nodiscard]] std::vector<std::string> bodies() const {
    std::lock_guard lock(mutex_);
    return bodies_;
  }
  /// Requests answered normally so far (what /metrics counts).
  [[nodiscard]] int answered() const { return answered_.load(); }

 private:
  static std::string sse(const boost::json::value& v) { return "data: " + boost::json::serialize(v) + "\n\n"; }

  boost::json::object chunk(bool chat, int tokens, int first_id) const {
    boost::json::array ids;
    std::string text;
    for (int i = 0; i < tokens; ++i) {
      ids.push_back(first_id + i);
      text += "x";
    }
    boost::json::object choice{{"index", 0}, {"token_ids", ids}, {"finish_reason", nullptr}};
    if (chat) {
      choice["delta"] = boost::json::object{{"content", text}};
    } else {
      choice["text"] = text;
    }
    return {{"id", "cmpl-1"},
            {"object", chat ? "chat.completion.chunk" : "text_completion"},
            {"model", "scripted-model"},
            {"choices", boost::json::array{choice}},
            {"usage", nullptr}};
  }

  void answer(bool chat, const std::string& body, http::Exchange ex) {
    std::string behaviour;
    boost::system::error_code ec;
    const auto v = boost::json::parse(body, ec);
    if (!ec && v.is_object()) {
      const auto& o = v.as_object();
      if (const auto* p = o.if_contains("prompt"); p != nullptr && p->is_string()) behaviour = p->as_string();
      if (const auto* m = o.if_contains("messages"); m != nullptr && m->is_array() && !m->as_array().empty()) {
        const auto& first = m->as_array().front();
        if (first.is_object()) {
          if (const auto* c = first.as_object().if_contains("content"); c != nullptr && c->is_string()) {
            behaviour = c->as_string();
          }
        }
      }
    }
    using std::chrono::milliseconds;
    std::this_thread::sleep_for(milliseconds(script_.ttft_ms));
    if (behaviour == "http500") {
      ex.respond(http::Response::withBody(
          500, "application/json",
          R"({"error":{"message":"scripted failure","type":"server_error","param":null,"code":"internal_error"}})"));
      return;
    }
    ex.beginStream(200, {{"Content-Type", "text/event-stream"}});
    int id = 1000;
    for (std::size_t i = 0; i < script_.chunk_tokens.size(); ++i) {
      if (i > 0) std::this_thread::sleep_for(milliseconds(script_.gap_ms));
      ex.write(sse(chunk(chat, script_.chunk_tokens[i], id)));
      id += script_.chunk_tokens[i];
      if (behaviour == "cut" && i == 1) return;  // drops the last Exchange copy mid-stream
      if (behaviour == "error-event" && i == 0) {
        ex.write(sse(boost::json::object{
            {"error", boost::json::object{{"message", "scripted mid-stream failure"}, {"type", "server_error"}}}}));
        ex.write("data: [DONE]\n\n");
        ex.end();
        return;
      }
    }
    if (behaviour != "no-usage") {
      const int n = totalTokens();
      ex.write(sse(boost::json::object{{"id", "cmpl-1"},
                                       {"choices", boost::json::array{}},
                                       {"usage", boost::json::object{{"prompt_tokens", script_.prompt_tokens},
                                                                     {"completion_tokens", n},
                                                                     {"total_tokens", script_.prompt_tokens + n}}}}));
    }
    if (behaviour != "no-done") ex.write("data: [DONE]\n\n");
    answered_.fetch_add(1);
    ex.end();
  }

  Script script_;
  std::atomic<int> answered_{0};
  mutable std::mutex mutex_;
  std::vector<std::string> bodies_;  // guarded by mutex_
  std::vector<std::thread> threads_;
  std::unique_ptr<http::Server> server_;  // last: stopped first, before the threads are joined
};

}  // namespace pd::test
