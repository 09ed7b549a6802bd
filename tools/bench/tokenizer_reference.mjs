// Single-thread encode throughput of the reference, npm tokenizers@0.23.2 (Hugging Face's Rust
// library), on the corpus written by pd_tokenizer_bench. Documents are encoded one at a time,
// awaiting each, so one thread works at a time; same checksum as pd_tokenizer_bench when the ids
// agree. Run through tools/bench/tokenizer_bench.sh.
//
//   node tokenizer_reference.mjs NODE_MODULES_DIR TOKENIZER_DIR CORPUS [PASSES]
import fs from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';

const [nodeModules, tokenizerDir, corpusPath, passesArg] = process.argv.slice(2);
if (!corpusPath) {
  console.error('usage: node tokenizer_reference.mjs NODE_MODULES_DIR TOKENIZER_DIR CORPUS [PASSES]');
  process.exit(2);
}
const require = createRequire(path.join(path.resolve(nodeModules), 'noop.js'));
const { Tokenizer } = require('tokenizers');
const version = require('tokenizers/package.json').version;

const loadStart = process.hrtime.bigint();
const tok = Tokenizer.fromFile(path.join(tokenizerDir, 'tokenizer.json'));
const loadS = Number(process.hrtime.bigint() - loadStart) / 1e9;
const docs = fs.readFileSync(corpusPath, 'utf8').split('\n').filter((l) => l.length > 0).map((l) => JSON.parse(l));
const bytes = new Map();
let totalBytes = 0;
for (const d of docs) {
  const n = Buffer.byteLength(d.text, 'utf8');
  bytes.set(d.category, (bytes.get(d.category) ?? 0) + n);
  totalBytes += n;
}
const passes = Math.max(1, Number(passesArg ?? 5));

// Warm-up pass, then timed passes; the best is reported, per category and for the whole corpus.
let tokens = 0;
let checksum = 0n;
const mask = (1n << 64n) - 1n;
for (const doc of docs) {
  const ids = (await tok.encode(doc.text, null, { addSpecialTokens: false })).getIds();
  tokens += ids.length;
  for (const id of ids) checksum = (checksum * 31n + BigInt(id)) & mask;
}
const best = new Map();
let bestTotal = Infinity;
for (let p = 0; p < passes; ++p) {
  const seconds = new Map();
  let total = 0;
  for (const doc of docs) {
    const start = process.hrtime.bigint();
    await tok.encode(doc.text, null, { addSpecialTokens: false });
    const s = Number(process.hrtime.bigint() - start) / 1e9;
    seconds.set(doc.category, (seconds.get(doc.category) ?? 0) + s);
    total += s;
  }
  bestTotal = Math.min(bestTotal, total);
  for (const [category, s] of seconds) best.set(category, Math.min(best.get(category) ?? Infinity, s));
}
let line = `reference tokenizers@${version}: ${(totalBytes / 1e6 / bestTotal).toFixed(2)} MB/s total;`;
for (const category of [...best.keys()].sort()) {
  line += ` ${category} ${(bytes.get(category) / 1e6 / best.get(category)).toFixed(2)} MB/s;`;
}
line += ` (${(totalBytes / 1e6).toFixed(2)} MB, ${docs.length} docs, ${tokens} tokens, checksum ${checksum}, ` +
        `best of ${passes} passes ${bestTotal.toFixed(3)} s, load ${loadS.toFixed(2)} s)`;
console.log(line);
