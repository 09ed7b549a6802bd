// The default CompletionBackend::startChoices: one generation per choice.
#include "pd/router/completion_backend.h"

#include <fmt/format.h>

#include <random>
#include <utility>

#include "pd/common/choices.h"

namespace pd::router {
namespace {

/// Aborts every choice's generation.
class ChoicesControl final : public GenerationControl {
 public:
  explicit ChoicesControl(std::vector<std::unique_ptr<GenerationControl>> controls) : controls_(std::move(controls)) {}
  void abort() override {
    for (auto& c : controls_) c->abort();
  }

 private:
  std::vector<std::unique_ptr<GenerationControl>> controls_;
};

}  // namespace

Result<std::unique_ptr<GenerationControl>> CompletionBackend::startChoices(
    GenerationRequest request, std::vector<std::shared_ptr<TokenSink>> sinks) {
  if (sinks.empty() || static_cast<std::int64_t>(sinks.size()) > pd::kMaxChoices) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("{} choices", sinks.size()));
  }
  if (sinks.size() == 1) return start(std::move(request), std::move(sinks.front()));
  std::uint64_t seed = 0;
  if (request.seed) {
    seed = static_cast<std::uint64_t>(*request.seed);
  } else {
    std::random_device device;
    seed = (static_cast<std::uint64_t>(device()) << 32U) ^ device();
  }
  std::vector<std::unique_ptr<GenerationControl>> controls;
  for (std::size_t i = 0; i < sinks.size(); ++i) {
    GenerationRequest r = request;
    if (i > 0) r.request_id = fmt::format("{}-c{}", request.request_id, i);
    r.seed = static_cast<std::int64_t>(pd::choiceSeed(seed, static_cast<std::int64_t>(i)));
    auto started = start(std::move(r), std::move(sinks[i]));
    if (!started.ok()) {
      for (auto& c : controls) c->abort();
      return started.error();
    }
    controls.push_back(std::move(started).value());
  }
  return std::unique_ptr<GenerationControl>(std::make_unique<ChoicesControl>(std::move(controls)));
}

}  // namespace pd::router
