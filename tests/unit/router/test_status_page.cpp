// The status page's routes over real HTTP: HTML and script from the binary, with a policy that
// keeps the page to its own origin, and a script that writes text, never markup.
#include <gtest/gtest.h>

#include <chrono>

#include "pd/common/http_client.h"
#include "pd/common/http_server.h"
#include "pd/router/status_page.h"

namespace pd::router {
namespace {

TEST(StatusPage, ServesThePageAndItsScriptWithASameOriginPolicy) {
  auto server = http::Server::start({}, statusPageRoutes());
  ASSERT_TRUE(server.ok());
  http::Client client("127.0.0.1", (*server)->port());
  auto page = client.send({"GET", "/", {}, {}}, std::chrono::seconds{10});
  ASSERT_TRUE(page.ok());
  EXPECT_EQ(page->status, 200);
  EXPECT_EQ(page->header("Content-Type"), "text/html; charset=utf-8");
  EXPECT_NE(page->header("Content-Security-Policy").find("script-src 'self'"), std::string::npos);
  EXPECT_NE(page->body.find("<script src=\"/status.js\"></script>"), std::string::npos);
  auto script = client.send({"GET", "/status.js", {}, {}}, std::chrono::seconds{10});
  ASSERT_TRUE(script.ok());
  EXPECT_EQ(script->header("Content-Type"), "text/javascript; charset=utf-8");
  EXPECT_EQ(script->body, statusPageScript());
}

TEST(StatusPage, LoadsNothingFromElsewhereAndWritesNoMarkup) {
  for (std::string_view text : {statusPageHtml(), statusPageScript()}) {
    EXPECT_EQ(text.find("http://"), std::string_view::npos);
    EXPECT_EQ(text.find("https://"), std::string_view::npos);
  }
  // Worker names, model output and errors reach the DOM as text only.
  EXPECT_EQ(statusPageScript().find("innerHTML"), std::string_view::npos);
  EXPECT_EQ(statusPageScript().find("insertAdjacentHTML"), std::string_view::npos);
  EXPECT_EQ(statusPageScript().find("eval("), std::string_view::npos);
  // It reads only this router's endpoints.
  for (std::string_view path : {"'/metrics'", "'/v1/models'", "'/v1/chat/completions'"}) {
    EXPECT_NE(statusPageScript().find(path), std::string_view::npos) << path;
  }
}

}  // namespace
}  // namespace pd::router
