// The official OpenAI Node SDK (npm `openai`, pinned and sha256-checked by
// scripts/fetch-openai-sdk.sh) against a real `pdserve up` (router + prefill + decode processes)
// serving models/tiny-dsv3 with an API key: models, chat and completions with and without
// streaming (the streamed text equals the whole one), logprobs in both shapes, seed
// reproducibility, n = 3 choices (whole, streamed, completions), and errors surfacing as the SDK's typed exceptions (BadRequestError,
// AuthenticationError, NotFoundError). The SDK's retries are off, so every error is the router's
// first answer.
//
// The cases of a `feature` (tool calls, structured outputs through the SDK's own parse helper, R1
// reasoning) run on a second cluster: a random-weight `make-model` checkpoint with the real
// DeepSeek-V3 tokenizer (its tool-call tokens and template) whose generation prompt opens
// `<think>` as R1's does, served with --router.reasoning_parser=deepseek_r1.
//
// Usage: node openai_sdk.mjs --pdserve BIN --sdk DIR --model DIR --tokenizer DIR
// Exit: 0 pass, 1 fail, 2 usage, 77 skip (node older than 20, which the SDK does not support).
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import readline from 'node:readline';
import { pathToFileURL } from 'node:url';

const argv = process.argv.slice(2);
const arg = (name) => {
  const i = argv.indexOf(name);
  return i >= 0 ? argv[i + 1] : undefined;
};
const pdserve = arg('--pdserve');
const sdkDir = arg('--sdk');
const modelDir = arg('--model');
const tokenizerDir = arg('--tokenizer');
if (!pdserve || !sdkDir || !modelDir || !tokenizerDir) {
  console.error('usage: openai_sdk.mjs --pdserve BIN --sdk DIR --model DIR');
  process.exit(2);
}
if (Number(process.versions.node.split('.')[0]) < 20) {
  console.log(`SKIP: node ${process.versions.node} is older than 20, the OpenAI SDK's oldest supported runtime`);
  process.exit(77);
}
const sdkEntry = join(sdkDir, 'node_modules', 'openai', 'index.mjs');
if (!existsSync(sdkEntry)) {
  console.error(`no OpenAI SDK at ${sdkEntry}: run scripts/fetch-openai-sdk.sh ${sdkDir}`);
  process.exit(2);
}
const { default: OpenAI } = await import(pathToFileURL(sdkEntry).href);

const MODEL = 'pdserve-default';
const tmp = mkdtempSync(join(tmpdir(), 'pd-openai-sdk-'));
let failures = 0;
const check = (ok, msg) => {
  if (!ok) {
    failures++;
    console.error('FAIL: ' + msg);
  }
};
const eq = (a, b, msg) => check(JSON.stringify(a) === JSON.stringify(b), `${msg}: ${JSON.stringify(a)} != ${JSON.stringify(b)}`);

// Resolves with the first capture of `re` in a stream's lines, or rejects at the deadline.
function waitLine(stream, re, ms, what) {
  return new Promise((resolve, reject) => {
    const rl = readline.createInterface({ input: stream });
    const timer = setTimeout(() => reject(new Error(`no ${what} within ${ms} ms`)), ms);
    rl.on('line', (line) => {
      const m = re.exec(line);
      if (m) {
        clearTimeout(timer);
        resolve(m[1]);
      }
    });
    rl.on('close', () => reject(new Error(`${what}: the process closed its output`)));
  });
}

// Polls until `probe` resolves truthy, or throws at the deadline.
async function waitUntil(probe, ms, what) {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    if (await probe().catch(() => false)) return;
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`${what}: not true within ${ms} ms`);
}

// Runs `fn`, which must throw an instance of `type` with `status`; returns the error.
async function expectError(what, type, status, fn) {
  try {
    await fn();
    check(false, `${what}: no error`);
  } catch (e) {
    check(e instanceof type, `${what}: ${e?.constructor?.name} is not ${type.name}: ${e?.message}`);
    check(e?.status === status, `${what}: status ${e?.status}, want ${status}`);
    return e;
  }
  return undefined;
}

const user = (content) => [{ role: 'user', content }];

// ---- The cases. Each takes the client and throws or calls check(). --------------------------------
const cases = [];
const test = (name, fn, feature) => cases.push({ name, fn, feature });

test('models', async (client) => {
  const models = [];
  for await (const m of client.models.list()) models.push(m.id);
  eq(models, [MODEL], 'models.list');
});

test('chat and streaming chat agree', async (client) => {
  const params = { model: MODEL, messages: user('Tell me about the sea.'), max_tokens: 24, temperature: 0 };
  const whole = await client.chat.completions.create(params);
  check(whole.id.startsWith('chatcmpl-'), `chat id ${whole.id}`);
  eq(whole.object, 'chat.completion', 'chat object');
  eq(whole.choices.length, 1, 'one choice');
  const choice = whole.choices[0];
  eq(choice.message.role, 'assistant', 'role');
  check(typeof choice.message.content === 'string' && choice.message.content.length > 0, 'chat content is text');
  check(['stop', 'length'].includes(choice.finish_reason), `finish_reason ${choice.finish_reason}`);
  check(whole.usage.prompt_tokens > 0 && whole.usage.completion_tokens > 0, 'usage counts');
  eq(whole.usage.total_tokens, whole.usage.prompt_tokens + whole.usage.completion_tokens, 'total_tokens');

  const stream = await client.chat.completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
  let text = '';
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    eq(chunk.object, 'chat.completion.chunk', 'chunk object');
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.delta.content ?? '';
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  eq(text, choice.message.content, 'streamed text equals the whole text');
  eq(finish, choice.finish_reason, 'streamed finish_reason');
  eq(usage, whole.usage, 'streamed usage');
});

test('completions and streaming completions agree', async (client) => {
  const params = { model: MODEL, prompt: 'The sky is', max_tokens: 12, temperature: 0 };
  const whole = await client.completions.create(params);
  eq(whole.object, 'text_completion', 'completion object');
  check(whole.choices[0].text.length > 0, 'completion text');
  let text = '';
  for await (const chunk of await client.completions.create({ ...params, stream: true })) {
    text += chunk.choices[0]?.text ?? '';
  }
  eq(text, whole.choices[0].text, 'streamed completion equals the whole one');
});

test('chat logprobs', async (client) => {
  const r = await client.chat.completions.create({
    model: MODEL, messages: user('Say something.'), max_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 3,
  });
  const content = r.choices[0].logprobs?.content ?? [];
  eq(content.length, r.usage.completion_tokens, 'one logprob entry per token');
  for (const e of content) {
    check(typeof e.token === 'string' && Array.isArray(e.bytes), 'entry token and bytes');
    check(e.logprob <= 0, `logprob ${e.logprob} <= 0`);
    eq(e.top_logprobs.length, 3, 'three alternatives');
    for (let i = 1; i < e.top_logprobs.length; i++) {
      check(e.top_logprobs[i - 1].logprob >= e.top_logprobs[i].logprob, 'alternatives best first');
    }
    // Greedy: the chosen token is the most likely one.
    check(Math.abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6, 'greedy picks the top alternative');
  }
  // Streaming carries the same entries.
  const streamed = [];
  for await (const chunk of await client.chat.completions.create({
    model: MODEL, messages: user('Say something.'), max_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 3,
    stream: true,
  })) {
    for (const c of chunk.choices) streamed.push(...(c.logprobs?.content ?? []));
  }
  eq(streamed, content, 'streamed logprobs');
});

test('completions logprobs', async (client) => {
  const r = await client.completions.create({ model: MODEL, prompt: 'Once upon', max_tokens: 6, temperature: 0, logprobs: 2 });
  const lp = r.choices[0].logprobs;
  eq(lp.tokens.length, r.usage.completion_tokens, 'tokens');
  eq(lp.token_logprobs.length, lp.tokens.length, 'token_logprobs');
  eq(lp.top_logprobs.length, lp.tokens.length, 'top_logprobs');
  eq(lp.text_offset.length, lp.tokens.length, 'text_offset');
  check(lp.token_logprobs.every((v) => v <= 0), 'logprobs <= 0');
  check(lp.top_logprobs.every((o) => Object.keys(o).length >= 1 && Object.keys(o).length <= 2), 'two alternatives');
});

test('a seed repeats a sampled answer', async (client) => {
  const ask = (seed) => client.chat.completions.create({
    model: MODEL, messages: user('Write a few words.'), max_tokens: 16, temperature: 1.5, seed,
  }).then((r) => r.choices[0].message.content);
  const a = await ask(42);
  eq(await ask(42), a, 'same seed, same answer');
  const others = await Promise.all([43, 44, 45].map(ask));
  check(others.some((o) => o !== a), 'other seeds give another answer');
});

test('n = 3 choices, whole and streamed', async (client) => {
  const params = { model: MODEL, messages: user('Write a few words.'), max_tokens: 10, temperature: 1.2, seed: 11, n: 3 };
  const whole = await client.chat.completions.create(params);
  eq(whole.choices.map((c) => c.index), [0, 1, 2], 'one choice per index');
  check(whole.choices.every((c) => typeof c.message.content === 'string'), 'every choice has content');
  check(whole.choices.every((c) => ['stop', 'length'].includes(c.finish_reason)), 'every choice has a finish_reason');
  const one = await client.chat.completions.create({ ...params, n: 1 });
  eq(whole.choices[0].message.content, one.choices[0].message.content, 'choice 0 is the n = 1 answer');
  eq((await client.chat.completions.create(params)).choices.map((c) => c.message.content),
    whole.choices.map((c) => c.message.content), 'a seed repeats every choice');
  const texts = ['', '', ''];
  const finishes = [0, 0, 0];
  let usage = null;
  const stream = await client.chat.completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      texts[c.index] += c.delta?.content ?? '';
      if (c.finish_reason) finishes[c.index] += 1;
    }
  }
  eq(texts, whole.choices.map((c) => c.message.content), 'streamed choices equal the whole ones');
  eq(finishes, [1, 1, 1], 'one finish per choice');
  eq(usage?.prompt_tokens, whole.usage.prompt_tokens, 'usage counts the prompt once');
  eq(usage?.completion_tokens, whole.usage.completion_tokens, 'streamed usage sums the choices');
  const completions = await client.completions.create({ model: MODEL, prompt: 'The sea', max_tokens: 6, temperature: 0, n: 3 });
  eq(completions.choices.map((c) => c.index), [0, 1, 2], 'completions: one choice per index');
  check(completions.choices.every((c) => c.text === completions.choices[0].text), 'greedy choices are equal');
  await expectError('n over router.max_n', OpenAI.BadRequestError, 400, () =>
    client.chat.completions.create({ ...params, n: 17 }));
});

test('logit_bias, max_completion_tokens, stop and user', async (client) => {
  // +100 on one token makes every token that token (return_token_ids, vLLM's extension, shows them).
  const forced = await client.chat.completions.create({
    model: MODEL, messages: user('Hi'), max_completion_tokens: 5, max_tokens: 50, temperature: 0,
    logit_bias: { 500: 100 }, user: 'sdk-test-user', return_token_ids: true,
  });
  eq(forced.usage.completion_tokens, 5, 'max_completion_tokens wins over max_tokens');
  eq(forced.choices[0].token_ids, [500, 500, 500, 500, 500], 'logit_bias forces the token');
  eq(forced.choices[0].finish_reason, 'length', 'finish_reason length');
  const whole = await client.completions.create({ model: MODEL, prompt: 'The sea', max_tokens: 12, temperature: 0 });
  const text = whole.choices[0].text;
  const stop = text.slice(3, 5);
  const cut = await client.completions.create({ model: MODEL, prompt: 'The sea', max_tokens: 12, temperature: 0, stop });
  eq(cut.choices[0].text, text.slice(0, text.indexOf(stop)), 'the text ends before the stop string');
  eq(cut.choices[0].finish_reason, 'stop', 'stop string finish_reason');
});

test('errors are the SDK\'s typed exceptions', async (client, { baseURL }) => {
  const e = await expectError('unknown parameter', OpenAI.BadRequestError, 400, () =>
    client.chat.completions.create({ model: MODEL, messages: user('x'), bogus_parameter: 1 }));
  check(e?.message.includes('bogus_parameter'), `the 400 names the parameter: ${e?.message}`);
  eq(e?.type, 'invalid_request_error', 'error type');
  eq(e?.param, 'bogus_parameter', 'error param');
  await expectError('temperature out of range', OpenAI.BadRequestError, 400, () =>
    client.chat.completions.create({ model: MODEL, messages: user('x'), temperature: 7 }));
  await expectError('streaming with a bad parameter', OpenAI.BadRequestError, 400, () =>
    client.chat.completions.create({ model: MODEL, messages: user('x'), top_logprobs: 2, stream: true }));
  await expectError('completions refuse chat parameters', OpenAI.BadRequestError, 400, () =>
    client.completions.create({ model: MODEL, prompt: 'x', messages: [] }));
  const nf = await expectError('unknown model', OpenAI.NotFoundError, 404, () =>
    client.chat.completions.create({ model: 'no-such-model', messages: user('x') }));
  eq(nf?.code, 'model_not_found', 'unknown model code');
  eq(nf?.param, 'model', 'unknown model param');
  const badKey = new OpenAI({ baseURL, apiKey: 'sk-wrong', maxRetries: 0 });
  await expectError('wrong API key', OpenAI.AuthenticationError, 401, () =>
    badKey.chat.completions.create({ model: MODEL, messages: user('x') }));
});

// ---- Features served on the second cluster (DeepSeek-V3 tokenizer, R1 template). ---------------------
const weather = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'The weather in a city.',
    parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 12 } }, required: ['city'],
                  additionalProperties: false },
  },
};

test('tool calls: required and named, then a round trip through a tool message', async (client) => {
  for (const tool_choice of ['required', { type: 'function', function: { name: 'get_weather' } }]) {
    const r = await client.chat.completions.create({
      model: MODEL, messages: user('What is the weather in Paris?'), tools: [weather], tool_choice,
      parallel_tool_calls: false, max_tokens: 160,
    });
    const msg = r.choices[0].message;
    eq(r.choices[0].finish_reason, 'tool_calls', 'finish_reason tool_calls');
    check(msg.tool_calls?.length >= 1, 'a tool call');
    const call = msg.tool_calls[0];
    eq(call.type, 'function', 'call type');
    eq(call.function.name, 'get_weather', 'call name');
    check(typeof call.id === 'string' && call.id.length > 0, 'call id');
    const args = JSON.parse(call.function.arguments);
    check(typeof args.city === 'string', 'arguments follow the schema');
    const next = await client.chat.completions.create({
      model: MODEL, tools: [weather], max_tokens: 16,
      messages: [...user('What is the weather in Paris?'), msg,
                 { role: 'tool', tool_call_id: call.id, content: '{"sky":"clear"}' }],
    });
    check(['stop', 'length', 'tool_calls'].includes(next.choices[0].finish_reason), 'the round trip answers');
  }
  // Streaming: the SDK's stream helper assembles the incremental arguments.
  const stream = client.chat.completions.stream({
    model: MODEL, messages: user('Weather in Rome?'), tools: [weather], tool_choice: 'required',
    parallel_tool_calls: false, max_tokens: 160,
  });
  const final = await stream.finalChatCompletion();
  const call = final.choices[0].message.tool_calls?.[0];
  eq(call?.function?.name, 'get_weather', 'streamed call name');
  check(typeof JSON.parse(call?.function?.arguments ?? 'null')?.city === 'string', 'streamed arguments');
}, 'tools');

test('structured output: json_schema through the SDK\'s parse helper', async (client) => {
  const schema = {
    type: 'object',
    properties: { name: { type: 'string', maxLength: 12 }, age: { type: 'integer' },
                  tags: { type: 'array', items: { type: 'string', maxLength: 8 }, maxItems: 3 } },
    required: ['name', 'age', 'tags'],
    additionalProperties: false,
  };
  const r = await client.chat.completions.parse({
    model: MODEL, messages: user('Describe a person.'), max_tokens: 200,
    response_format: { type: 'json_schema', json_schema: { name: 'person', schema, strict: true } },
  });
  const parsed = r.choices[0].message.parsed;
  check(parsed && typeof parsed.name === 'string' && Number.isInteger(parsed.age) && Array.isArray(parsed.tags) &&
        parsed.tags.length <= 3, `parsed follows the schema: ${JSON.stringify(parsed)}`);
}, 'json_schema');

test('reasoning: reasoning_content apart from content', async (client) => {
  // The prompt opens <think>: what the model writes up to </think> (or all of it) is reasoning.
  const r = await client.chat.completions.create({ model: MODEL, messages: user('Think, then answer.'), max_tokens: 32 });
  const msg = r.choices[0].message;
  check(typeof msg.reasoning_content === 'string', 'reasoning_content is text');
  check(Number.isInteger(r.usage.completion_tokens_details?.reasoning_tokens), 'reasoning_tokens counted');
}, 'reasoning');

// ---- The clusters. ----------------------------------------------------------------------------------
async function runCluster(label, model, extraArgs, selected) {
  const key = 'sk-openai-sdk-test-' + process.pid;
  writeFileSync(join(tmp, 'keys'), key + '\n', { mode: 0o600 });
  const up = spawn(pdserve, ['up', '--router.port=0', '--log.level=warn', `--model.path=${model}`,
                             `--model.cache_dir=${join(tmp, 'cache-' + label)}`,
                             `--router.api_keys_file=${join(tmp, 'keys')}`, ...extraArgs],
                   { stdio: ['ignore', 'pipe', 'inherit'] });
  const exited = new Promise((resolve) => up.on('exit', (code, signal) => resolve(code ?? signal)));
  try {
    const router = await waitLine(up.stdout, /^PDSERVE_READY role=up url=(\S+)/, 300000, 'PDSERVE_READY from pdserve up');
    up.stdout.resume();
    // up is READY once the router listens; it routes once its polls put the workers in rotation.
    await waitUntil(async () => (await fetch(router + '/ready')).status === 200, 120000, 'the router\'s /ready');
    const baseURL = router + '/v1';
    const client = new OpenAI({ baseURL, apiKey: key, maxRetries: 0, timeout: 120000 });
    for (const c of selected) {
      const before = failures;
      try {
        await c.fn(client, { baseURL });
      } catch (e) {
        check(false, `${c.name}: ${e?.stack ?? e}`);
      }
      console.log(`${failures === before ? 'ok' : 'FAILED'} (${label}): ${c.name}`);
    }
  } finally {
    up.kill('SIGTERM');
    const status = await exited;
    check(status === 0, `pdserve up (${label}) exited with ${status}`);
  }
}

// A random-weight checkpoint with the real DeepSeek-V3 tokenizer; its template's generation prompt
// opens `<think>` (R1's).
async function makeR1Model() {
  const dir = join(tmp, 'r1');
  const make = spawn(pdserve, ['make-model', dir, '--preset', 'default', '--tokenizer', tokenizerDir],
                     { stdio: ['ignore', 'inherit', 'inherit'] });
  const code = await new Promise((resolve) => make.on('exit', (c, sig) => resolve(c ?? sig)));
  if (code !== 0) throw new Error(`pdserve make-model exited with ${code}`);
  const cfgPath = join(dir, 'tokenizer_config.json');
  const cfg = JSON.parse(readFileSync(cfgPath, 'utf8'));
  const tail = "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}";
  if (!cfg.chat_template.includes(tail)) throw new Error('the DeepSeek-V3 template changed: no generation prompt to patch');
  cfg.chat_template = cfg.chat_template.replace(
    tail, "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}");
  writeFileSync(cfgPath, JSON.stringify(cfg));
  return dir;
}

async function main() {
  await runCluster('tiny-dsv3', modelDir, [], cases.filter((c) => !c.feature));
  const r1 = await makeR1Model();
  await runCluster('r1-template', r1, ['--router.reasoning_parser=deepseek_r1', '--router.tool_parser=deepseek_v3'],
                   cases.filter((c) => c.feature));
}

try {
  await main();
} catch (e) {
  check(false, e?.stack ?? String(e));
} finally {
  rmSync(tmp, { recursive: true, force: true });
}
console.log(failures === 0 ? 'PASS' : `${failures} check(s) failed`);
process.exit(failures === 0 ? 0 : 1);
