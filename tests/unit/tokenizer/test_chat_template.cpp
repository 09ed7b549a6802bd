// Chat template rendering: the golden DeepSeek-V3 cases (rendered by @huggingface/jinja and
// checked with Python jinja2) and the Jinja subset's semantics on small templates.
#include <gtest/gtest.h>

#include "pd/tokenizer/chat_template.h"
#include "tokenizer_test_support.h"

namespace pd::chat {
namespace {

using tokenizer::testing::idsOf;
using tokenizer::testing::readJsonl;
using tokenizer::testing::str;

int failureCount() {
  return ::testing::UnitTest::GetInstance()->current_test_info()->result()->total_part_count();
}

TEST(ChatTemplateGolden, DeepSeekV3Cases) {
  PD_REQUIRE_TOKENIZER(tok);
  auto tmpl = ChatTemplate::fromTokenizer(tok);
  ASSERT_TRUE(tmpl.ok()) << tmpl.error().toString();
  const auto cases = readJsonl("chat_cases.jsonl");
  ASSERT_EQ(cases.size(), 28u);
  int passed = 0;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    SCOPED_TRACE("chat_cases.jsonl line " + std::to_string(i + 1) + " (" + str(c.at("category")) + ")");
    const int before = failureCount();
    const std::string messages = boost::json::serialize(c.at("messages"));
    const std::string tools = boost::json::serialize(c.at("tools"));
    auto rendered = tmpl.value().render(ChatRequest{messages, tools, c.at("add_generation_prompt").as_bool(), ""});
    ASSERT_TRUE(rendered.ok()) << rendered.error().toString();
    EXPECT_EQ(rendered.value(), str(c.at("rendered")));
    auto ids = tok.encode(rendered.value());
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(ids.value(), idsOf(c.at("ids")));
    if (failureCount() == before) ++passed;
  }
  EXPECT_EQ(passed, 28);
  std::printf("chat_cases.jsonl: %d of %zu cases pass\n", passed, cases.size());
}

// Renders `source` with messages/extra context; fails the test on errors.
std::string render(std::string_view source, std::string_view messages = "[]", std::string_view extra = "",
                   bool add_generation_prompt = false) {
  auto tmpl = ChatTemplate::create(source, SpecialTokens{"<s>", "</s>", "<pad>"});
  if (!tmpl.ok()) {
    ADD_FAILURE() << tmpl.error().toString();
    return "<create failed>";
  }
  auto out = tmpl.value().render(ChatRequest{messages, "", add_generation_prompt, extra});
  if (!out.ok()) {
    ADD_FAILURE() << out.error().toString();
    return "<render failed>";
  }
  return out.value();
}

Error createError(std::string_view source) {
  auto tmpl = ChatTemplate::create(source, SpecialTokens{});
  if (tmpl.ok()) return Error{ErrorCode::Internal, "created"};
  return tmpl.error();
}

Error renderError(std::string_view source, std::string_view messages, std::string_view extra = "") {
  auto tmpl = ChatTemplate::create(source, SpecialTokens{});
  if (!tmpl.ok()) return tmpl.error();
  auto out = tmpl.value().render(ChatRequest{messages, "", false, extra});
  if (out.ok()) return Error{ErrorCode::Internal, "rendered: " + out.value()};
  return out.error();
}

TEST(JinjaSubset, WhitespaceControlAsTransformers) {
  // trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before it.
  EXPECT_EQ(render("{% if true %}\n  yes\n  {% endif %}\nend"), "  yes\nend");
  EXPECT_EQ(render("a  {%- if true -%}  b  {%- endif -%}  c"), "abc");
  EXPECT_EQ(render("x {{- ' y ' -}} z"), "x y z");
  EXPECT_EQ(render("{{ 'v' }}\n"), "v");  // one trailing newline of the source is dropped
  EXPECT_EQ(render("{{ 'v' }}\n\n"), "v\n");
  EXPECT_EQ(render("  {%+ if true %}k{% endif %}"), "  k");  // + keeps the indentation
  EXPECT_EQ(render("a {# note #}\n  {# x #}b"), "a b");
  EXPECT_EQ(render("{% for x in [1, 2] %}\n{{ x }}\n{% endfor %}"), "1\n2\n");
}

TEST(JinjaSubset, ExpressionsFollowPython) {
  EXPECT_EQ(render("{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 7 / 2 }}"),
            "7 3 -4 1 2 1024 3.5");
  EXPECT_EQ(render("{{ 1.0 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1.5e-7 }} {{ true }} {{ none }} {{ undefined_var }}|"),
            "1.0 0.30000000000000004 1e+20 1.5e-07 True None |");
  EXPECT_EQ(render("{{ 'a' ~ 1 ~ none }} {{ 'ab' * 3 }} {{ [1, 'x', none, true] }} {{ {'k': 'v'} }}"),
            "a1None ababab [1, 'x', None, True] {'k': 'v'}");
  EXPECT_EQ(render("{{ 'yes' if 1 < 2 else 'no' }} {{ 'x' if false }}| {{ 0 or 'fallback' }} {{ 1 and 2 }}"),
            "yes | fallback 2");
  EXPECT_EQ(render("{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }}"),
            "True True True True");
  EXPECT_EQ(render("{{ 'héllo'[1] }} {{ 'héllo'[-1] }} {{ 'héllo'[1:3] }} {{ [1, 2, 3][::-1] }} {{ 'abc'[5] }}|"),
            "é o él [3, 2, 1] |");
}

TEST(JinjaSubset, StringAndDictMethods) {
  EXPECT_EQ(
      render("{{ 'a</think>b</think>c'.split('</think>')[-1] }} {{ 'a</think>b</think>c'.split('</think>', 1)[1] }}"),
      "c b</think>c");
  EXPECT_EQ(render("{{ '  a  b '.split() }} {{ ' x y  z '.split(none, 1) }} {{ 'a,b,c'.rsplit(',', 1) }}"),
            "['a', 'b'] ['x', 'y  z '] ['a,b', 'c']");
  EXPECT_EQ(
      render(
          "[{{ '\\n hi \\t'.strip() }}] [{{ 'xxhixx'.strip('x') }}] [{{ '  hi'.lstrip() }}] [{{ 'hi  '.rstrip() }}]"),
      "[hi] [hi] [hi] [hi]");
  EXPECT_EQ(render("{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'bc')) }} {{ 'aaa'.replace('a', 'b', 2) }}"),
            "True True bba");
  EXPECT_EQ(
      render("{{ 'Hello'.upper() }} {{ 'Hello'.lower() }} {{ 'hello world'.title() }} {{ ', '.join(['a', 'b']) }}"),
      "HELLO hello Hello World a, b");
  EXPECT_EQ(render("{% set d = {'a': 1, 'b': 2} %}{{ d.get('a') }} {{ d.get('z', 9) }} {{ d.get('z') }} "
                   "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}"),
            "1 9 None a=1;b=2;");
}

TEST(JinjaSubset, FiltersAndTests) {
  EXPECT_EQ(render("{{ {'name': 'f', 'args': {'x': [1, 2.5, true, none, 'é\"']}} | tojson }}"),
            "{\"name\": \"f\", \"args\": {\"x\": [1, 2.5, true, null, \"é\\\"\"]}}");
  EXPECT_EQ(render("{{ {'a': [1]} | tojson(indent=2) }}"), "{\n  \"a\": [\n    1\n  ]\n}");
  EXPECT_EQ(render("{{ [3, 1, 2] | sort | join(',') }} {{ 'abc' | length }} {{ ' x ' | trim }} {{ 'x' | upper }}"),
            "1,2,3 3 x X");
  EXPECT_EQ(
      render("{{ missing | default('d') }} {{ '' | default('e', true) }} {{ [1, 2] | first }} {{ [1, 2] | last }}"),
      "d e 1 2");
  EXPECT_EQ(render("{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | join('+') }}",
                   R"([{"role":"user","content":"a"},{"role":"system","content":"s"},{"role":"user","content":"b"}])"),
            "a+b");
  EXPECT_EQ(render("{{ messages | rejectattr('role', 'eq', 'user') | list | length }}",
                   R"([{"role":"user"},{"role":"system"}])"),
            "1");
  EXPECT_EQ(render("{{ x is defined }} {{ none is none }} {{ 1 is not none }} {{ 'a' is string }} {{ 3 is odd }} "
                   "{{ {} is mapping }} {{ 4 is divisibleby 2 }} {{ 'a' is in 'abc' }}"),
            "False True True True True True True True");
}

TEST(JinjaSubset, StatementsAndScopes) {
  // A `set` inside a loop does not leak out of it; a namespace carries state across iterations.
  EXPECT_EQ(render("{% set x = 1 %}{% for i in range(3) %}{% set x = i %}{% endfor %}{{ x }}"), "1");
  EXPECT_EQ(
      render("{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"),
      "6");
  EXPECT_EQ(render("{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ ',' if not loop.last }}{% endfor %}",
                   R"([{},{},{}])"),
            "1/3,2/3,3/3");
  EXPECT_EQ(render("{% for x in [] %}a{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for x in [1, 2, 3, 4] if x is even %}{{ x }}{% endfor %}"), "24");
  EXPECT_EQ(render("{% for x in range(10) %}{% if x == 3 %}{% break %}{% endif %}{% if x == 1 %}{% continue %}{% endif "
                   "%}{{ x }}{% endfor %}"),
            "02");
  EXPECT_EQ(render("{% macro tag(name, v='d') %}<{{ name }}:{{ v }}>{% endmacro %}{{ tag('a') }}{{ tag('b', v='x') }}"),
            "<a:d><b:x>");
  EXPECT_EQ(render("{% set block %}in {{ 'side' }}{% endset %}[{{ block }}]"), "[in side]");
  EXPECT_EQ(render("{% if a %}A{% elif b %}B{% else %}C{% endif %}", "[]", R"({"b": true})"), "B");
  EXPECT_EQ(render("{% generation %}g{% endgeneration %}"), "g");
  EXPECT_EQ(render("{{ bos_token }}{{ eos_token }}{{ pad_token }}{{ add_generation_prompt }}", "[]", "", true),
            "<s></s><pad>True");
}

// R1-style and V3.1-style DeepSeek templates (written here, same constructs as the released ones).
TEST(JinjaSubset, DeepSeekR1StyleTemplate) {
  const std::string r1 =
      "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}\n"
      "{%- set ns = namespace(system_prompt='') -%}\n"
      "{%- for message in messages -%}\n"
      "  {%- if message['role'] == 'system' -%}{% set ns.system_prompt = message['content'] %}{%- endif -%}\n"
      "{%- endfor -%}\n"
      "{{ bos_token }}{{ ns.system_prompt }}\n"
      "{%- for message in messages -%}\n"
      "  {%- if message['role'] == 'user' -%}{{ '<｜User｜>' + message['content'] }}\n"
      "  {%- elif message['role'] == 'assistant' and message['content'] is not none -%}\n"
      "    {%- set content = message['content'] -%}\n"
      "    {%- if '</think>' in content -%}{% set content = content.split('</think>')[-1] %}{%- endif -%}\n"
      "    {{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}\n"
      "  {%- endif -%}\n"
      "{%- endfor -%}\n"
      "{%- if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}\n";
  const std::string messages =
      R"([{"role":"system","content":"S"},{"role":"user","content":"Q"},)"
      R"({"role":"assistant","content":"<think>hmm</think>A"},{"role":"user","content":"Q2"}])";
  EXPECT_EQ(render(r1, messages, "", true),
            "<s>S<｜User｜>Q<｜Assistant｜>A<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜><think>\n");
}

TEST(JinjaSubset, DeepSeekV31StyleTemplate) {
  const std::string v31 =
      "{%- if not thinking is defined -%}{%- set thinking = false -%}{%- endif -%}\n"
      "{%- set ns = namespace(is_last_user=false) -%}{{ bos_token }}\n"
      "{%- for message in messages -%}\n"
      "  {%- if message['role'] == 'user' -%}{%- set ns.is_last_user = true -%}{{ '<｜User｜>' + message['content'] "
      "}}\n"
      "  {%- elif message['role'] == 'assistant' -%}\n"
      "    {%- if ns.is_last_user -%}{{ '<｜Assistant｜></think>' }}{%- endif -%}\n"
      "    {%- set ns.is_last_user = false -%}\n"
      "    {%- set content = message['content'] -%}\n"
      "    {%- if '</think>' in content -%}{%- set content = content.split('</think>', 1)[1] -%}{%- endif -%}\n"
      "    {{ content + '<｜end▁of▁sentence｜>' }}\n"
      "  {%- endif -%}\n"
      "{%- endfor -%}\n"
      "{%- if add_generation_prompt and ns.is_last_user -%}{{ '<｜Assistant｜>' }}"
      "{{ '<think>' if thinking else '</think>' }}{%- endif %}";
  const std::string messages =
      R"([{"role":"user","content":"Q"},{"role":"assistant","content":"r</think>A</think>B"},{"role":"user","content":"Q2"}])";
  EXPECT_EQ(render(v31, messages, R"({"thinking": true})", true),
            "<s><｜User｜>Q<｜Assistant｜></think>A</think>B<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜><think>");
  EXPECT_EQ(render(v31, R"([{"role":"user","content":"Q"}])", "", true), "<s><｜User｜>Q<｜Assistant｜></think>");
}

TEST(JinjaSubset, UnsupportedConstructsFailAtLoad) {
  struct Case {
    std::string_view source;
    std::string_view mentions;
  };
  const Case cases[] = {
      {"{% include 'x.jinja' %}", "statement 'include'"},
      {"{% raw %}x{% endraw %}", "statement 'raw'"},
      {"{{ x | indent(2) }}", "filter 'indent'"},
      {"{{ x is sameas_or_what }}", "test 'sameas_or_what'"},
      {"{{ lookup_tool(x) }}", "function 'lookup_tool'"},
      {"{{ x.format(1) }}", "method 'format'"},
      {"{% for x in y recursive %}{% endfor %}", "recursive"},
      {"{% if x %}never closed", "endif"},
      {"{% endfor %}", "statement 'endfor'"},
      {"{% break %}", "outside of a for loop"},
      {"{{ 'unterminated }}", "unterminated string"},
      {"{{ 1 < 2 < 3 }}", "chained comparisons"},
      {"{{ messages | selectattr('role', 'nosuchtest', 'x') | list }}", "test 'nosuchtest'"},
      {"{{ messages | map('nosuchfilter') | list }}", "filter 'nosuchfilter'"},
  };
  for (const auto& c : cases) {
    const Error error = createError(c.source);
    EXPECT_EQ(error.code, ErrorCode::InvalidArgument) << c.source << ": " << error.message;
    EXPECT_NE(error.message.find(c.mentions), std::string::npos) << c.source << ": " << error.message;
    EXPECT_NE(error.message.find("chat template 1:"), std::string::npos) << error.message;
  }
  EXPECT_NE(createError("ok\n\n  {{ x | nope }}").message.find("chat template 3:"), std::string::npos);
}

TEST(JinjaSubset, DataErrorsFailAtRender) {
  const std::string concat = "{% for m in messages %}{{ '<u>' + m['content'] }}{% endfor %}";
  const Error null_content = renderError(concat, R"([{"role":"user","content":null}])");
  EXPECT_EQ(null_content.code, ErrorCode::InvalidArgument);
  EXPECT_NE(null_content.message.find("unsupported operand types for +: 'str' and 'none'"), std::string::npos)
      << null_content.message;
  const Error missing = renderError(concat, R"([{"role":"user"}])");
  EXPECT_NE(missing.message.find("is undefined"), std::string::npos) << missing.message;
  const Error raised = renderError("{{ raise_exception('roles must alternate') }}", "[]");
  EXPECT_NE(raised.message.find("roles must alternate"), std::string::npos) << raised.message;
  EXPECT_EQ(renderError("{{ 1 }}", "{\"not\": \"a list\"}").code, ErrorCode::InvalidArgument);
  EXPECT_EQ(renderError("{{ 1 }}", "[bad json").code, ErrorCode::InvalidArgument);
  const Error runaway =
      renderError("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "[]");
  EXPECT_NE(runaway.message.find("loop iterations"), std::string::npos) << runaway.message;
}

TEST(ChatTemplate, EmptyConversationRendersBosOnly) {
  PD_REQUIRE_TOKENIZER(tok);
  auto tmpl = ChatTemplate::fromTokenizer(tok);
  ASSERT_TRUE(tmpl.ok());
  auto out = tmpl.value().render(ChatRequest{"[]", "", false, ""});
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out.value(), "<｜begin▁of▁sentence｜>");
  out = tmpl.value().render(ChatRequest{"[]", "", true, ""});
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out.value(), "<｜begin▁of▁sentence｜><｜Assistant｜>");
}

}  // namespace
}  // namespace pd::chat
