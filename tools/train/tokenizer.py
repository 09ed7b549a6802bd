"""A byte-level BPE tokenizer in the Hugging Face tokenizer.json format, trained here.

The pre-tokenizer is DeepSeek-V3's (the three Split regexes then ByteLevel, copied by value), so
the project's tokenizer (tokenizer/src/) loads the file unchanged. Python side: `regex`
(Debian python3-regex) runs the same patterns; BPE applies merges by rank like Hugging Face.

  python3 tokenizer.py train --corpus /work/train-data/corpus/train.jsonl --vocab 4096 --out DIR
  python3 tokenizer.py encode --tokenizer DIR < lines.jsonl   ({"text"} -> {"ids"})

Added tokens (ids 0-3): BOS, EOS (special), and the chat markers <｜User｜>, <｜Assistant｜>.
Single-threaded; no global state except the module-level pattern objects.
"""

import argparse
import collections
import heapq
import json
import os
import sys

import regex

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
SPECIALS = [(BOS, True), (EOS, True), (USER, False), (ASSISTANT, False)]

PATTERNS = [
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]
_COMPILED = [regex.compile(p) for p in PATTERNS]
_SPECIAL_RE = regex.compile("|".join(regex.escape(s) for s, _ in SPECIALS))

CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


def bytes_to_unicode():
    """GPT-2's byte <-> printable character map used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


B2U = bytes_to_unicode()
U2B = {v: k for k, v in B2U.items()}


def split_isolated(pieces, pat):
    out = []
    for p in pieces:
        pos = 0
        for m in pat.finditer(p):
            if m.start() > pos:
                out.append(p[pos:m.start()])
            out.append(m.group())
            pos = m.end()
        if pos < len(p):
            out.append(p[pos:])
    return out


def pretokenize(text):
    pieces = [text]
    for pat in _COMPILED:
        pieces = split_isolated(pieces, pat)
    return pieces


def split_specials(text):
    """[(is_special, str)] in order."""
    out = []
    pos = 0
    for m in _SPECIAL_RE.finditer(text):
        if m.start() > pos:
            out.append((False, text[pos:m.start()]))
        out.append((True, m.group()))
        pos = m.end()
    if pos < len(text):
        out.append((False, text[pos:]))
    return out


def train(texts, vocab_size, min_freq=2):
    words = collections.Counter()
    for t in texts:
        for special, seg in split_specials(t):
            if not special:
                for p in pretokenize(seg):
                    words[p.encode("utf-8")] += 1
    n_base = len(SPECIALS) + 256
    seqs = []
    freqs = []
    for w, c in sorted(words.items()):
        seqs.append([len(SPECIALS) + b for b in w])
        freqs.append(c)
    pair_count = collections.defaultdict(int)
    where = collections.defaultdict(set)
    for i, s in enumerate(seqs):
        for a, b in zip(s, s[1:]):
            pair_count[(a, b)] += freqs[i]
            where[(a, b)].add(i)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    merges = []
    token_bytes = [b""] * len(SPECIALS) + [bytes([b]) for b in range(256)]
    while len(token_bytes) < vocab_size and heap:
        negc, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -negc or -negc <= 0:
            continue
        if -negc < min_freq:
            break
        new_id = len(token_bytes)
        token_bytes.append(token_bytes[pair[0]] + token_bytes[pair[1]])
        merges.append(pair)
        touched = set()
        for i in list(where[pair]):
            s = seqs[i]
            f = freqs[i]
            for a, b in zip(s, s[1:]):
                pair_count[(a, b)] -= f
                touched.add((a, b))
            out = []
            j = 0
            while j < len(s):
                if j + 1 < len(s) and s[j] == pair[0] and s[j + 1] == pair[1]:
                    out.append(new_id)
                    j += 2
                else:
                    out.append(s[j])
                    j += 1
            seqs[i] = out
            for a, b in zip(out, out[1:]):
                pair_count[(a, b)] += f
                where[(a, b)].add(i)
                touched.add((a, b))
        del where[pair]
        pair_count.pop(pair, None)
        for p in touched:
            c = pair_count.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_count.pop(p, None)
    return token_bytes, merges, n_base


class Tokenizer:
    def __init__(self, token_bytes, merges):
        self.token_bytes = token_bytes
        self.merges = merges
        self.rank = {p: r for r, p in enumerate(merges)}
        self.merged = {p: len(SPECIALS) + 256 + r for r, p in enumerate(merges)}
        self.special_ids = {s: i for i, (s, _) in enumerate(SPECIALS)}
        self.cache = {}

    @staticmethod
    def load(d):
        with open(os.path.join(d, "tokenizer.json"), encoding="utf-8") as f:
            tj = json.load(f)
        vocab = tj["model"]["vocab"]
        n = max(vocab.values()) + 1
        token_bytes = [b""] * n
        for s, i in vocab.items():
            if i >= len(SPECIALS):
                token_bytes[i] = bytes(U2B[ch] for ch in s)
        ids = {s: i for s, i in vocab.items()}
        merges = []
        for m in tj["model"]["merges"]:
            a, b = m.split(" ") if isinstance(m, str) else m
            merges.append((ids[a], ids[b]))
        return Tokenizer(token_bytes, merges)

    def bpe(self, piece):
        ids = self.cache.get(piece)
        if ids is not None:
            return ids
        s = [len(SPECIALS) + b for b in piece.encode("utf-8")]
        while len(s) > 1:
            best = None
            for a, b in zip(s, s[1:]):
                r = self.rank.get((a, b))
                if r is not None and (best is None or r < best[0]):
                    best = (r, (a, b))
            if best is None:
                break
            pair = best[1]
            new = self.merged[pair]
            out = []
            j = 0
            while j < len(s):
                if j + 1 < len(s) and s[j] == pair[0] and s[j + 1] == pair[1]:
                    out.append(new)
                    j += 2
                else:
                    out.append(s[j])
                    j += 1
            s = out
        if len(self.cache) < 200000:
            self.cache[piece] = s
        return s

    def encode(self, text, add_bos=False):
        ids = [0] if add_bos else []
        for special, seg in split_specials(text):
            if special:
                ids.append(self.special_ids[seg])
            else:
                for p in pretokenize(seg):
                    ids.extend(self.bpe(p))
        return ids

    def decode(self, ids, skip_special=False):
        out = b""
        for i in ids:
            if i < len(SPECIALS):
                if not (skip_special and SPECIALS[i][1]):
                    out += SPECIALS[i][0].encode("utf-8")
            elif i < len(self.token_bytes):
                out += self.token_bytes[i]
        return out.decode("utf-8", errors="replace")

    def save(self, d, model_max_length):
        os.makedirs(d, exist_ok=True)
        vocab = {}
        for i, (s, _) in enumerate(SPECIALS):
            vocab[s] = i
        for i in range(len(SPECIALS), len(self.token_bytes)):
            vocab["".join(B2U[b] for b in self.token_bytes[i])] = i
        tu = lambda i: "".join(B2U[b] for b in self.token_bytes[i])
        tj = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": sp} for i, (s, sp) in enumerate(SPECIALS)],
            "normalizer": {"type": "Sequence", "normalizers": []},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False} for p in PATTERNS
            ] + [{"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
            "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                               "use_regex": True},
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "vocab": vocab, "merges": [f"{tu(a)} {tu(b)}" for a, b in self.merges]},
        }
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(tj, f, ensure_ascii=False, indent=1)
            f.write("\n")
        cfg = {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": EOS,
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHAT_TEMPLATE,
        }
        with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, ensure_ascii=False, indent=1)
            f.write("\n")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--corpus", required=True)
    t.add_argument("--vocab", type=int, default=4096)
    t.add_argument("--out", required=True)
    t.add_argument("--max-length", type=int, default=1024)
    e = sub.add_parser("encode")
    e.add_argument("--tokenizer", required=True)
    e.add_argument("--add-bos", action="store_true")
    args = ap.parse_args()
    if args.cmd == "train":
        texts = [json.loads(l)["text"] for l in open(args.corpus, encoding="utf-8")]
        token_bytes, merges, _ = train(texts, args.vocab)
        tok = Tokenizer(token_bytes, merges)
        tok.save(args.out, args.max_length)
        print(f"vocab {len(token_bytes)} merges {len(merges)} -> {args.out}")
    else:
        tok = Tokenizer.load(args.tokenizer)
        for line in sys.stdin:
            if line.strip():
                print(json.dumps({"ids": tok.encode(json.loads(line)["text"], args.add_bos)}))


if __name__ == "__main__":
    main()
