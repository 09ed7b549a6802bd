"""Checks that the project's tokenizer (pdserve tokenize / chat-template) agrees with tokenizer.py.

  python3 check_tokenizer.py --pdserve BUILD/tools/pdserve --tokenizer DIR [--heldout FILE] [--lines 400]

Encodes held-out lines (plain text, chat exchanges with the marker tokens, and a few edge cases)
with both and requires identical ids; decodes each back (round trip); renders three
conversations with the chat template and requires the expected text and ids. Exit 1 on a mismatch.
"""

import argparse
import json
import random
import subprocess
import sys

from tokenizer import ASSISTANT, BOS, EOS, USER, Tokenizer


def run(pdserve, cmd, tok_dir, lines):
    p = subprocess.run([pdserve, cmd, "--tokenizer", tok_dir], input="".join(json.dumps(l) + "\n" for l in lines),
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"pdserve {cmd} failed ({p.returncode}): {p.stderr[-2000:]}")
    return [json.loads(l) for l in p.stdout.splitlines()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdserve", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--heldout", default="/work/train-data/corpus/heldout.jsonl")
    ap.add_argument("--lines", type=int, default=400)
    args = ap.parse_args()
    tok = Tokenizer.load(args.tokenizer)
    docs = [json.loads(l)["text"] for l in open(args.heldout, encoding="utf-8")]
    texts = []
    for d in docs:
        texts.extend(x for x in d.split("\n") if x.strip())
    random.Random(0).shuffle(texts)
    texts = texts[:args.lines]
    texts += ["", " ", "  leading and trailing  ", "tabs\tand\nnewlines\r\n\n end", "numbers 1234567 and 3.14159",
              "Unicode: café, naïve, 東京, emoji 🙂, Ω≈ç", f"{BOS}{USER}Hi{ASSISTANT}Hello.{EOS}",
              "ＦＵＬＬＷＩＤＴＨ and 'quotes' \"double\" don't", "x" * 300]
    got = run(args.pdserve, "tokenize", args.tokenizer, [{"text": t} for t in texts])
    bad = 0
    for t, g in zip(texts, got):
        want = tok.encode(t)
        if g.get("ids") != want:
            bad += 1
            if bad <= 5:
                print(f"MISMATCH {t!r}\n  pdserve {g}\n  python  {want}")
        if tok.decode(want) != t:
            bad += 1
            print(f"ROUND TRIP {t!r} -> {tok.decode(want)!r}")
    n_tokens = sum(len(tok.encode(t)) for t in texts)
    print(f"tokenize: {len(texts) - bad}/{len(texts)} lines identical ({n_tokens} tokens)")

    convs = [
        {"messages": [{"role": "user", "content": "What is a river?"}], "add_generation_prompt": True},
        {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Define cat."}],
         "add_generation_prompt": True},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
         "add_generation_prompt": False},
    ]
    expect = [
        f"{BOS}{USER}What is a river?{ASSISTANT}",
        f"{BOS}You are terse.\n\n{USER}Hi{ASSISTANT}Hello.{EOS}{USER}Define cat.{ASSISTANT}",
        f"{BOS}{USER}x{ASSISTANT}y{EOS}",
    ]
    rendered = run(args.pdserve, "chat-template", args.tokenizer, convs)
    for r, e in zip(rendered, expect):
        if r.get("rendered") != e or r.get("ids") != tok.encode(e):
            bad += 1
            print(f"CHAT MISMATCH {r} vs {e!r} {tok.encode(e)}")
    print(f"chat-template: {len(convs)} conversations, {'all equal' if bad == 0 else 'MISMATCH'}")
    print("PASS" if bad == 0 else "FAIL")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
