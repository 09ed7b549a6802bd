"""How well the trained model answers held-out chat questions (model.py, greedy, stop at EOS).

  python3 eval_chat.py --model ../../models/tiny-dsv3 [--heldout /work/train-data/corpus/heldout.jsonl] [--n 200]

For the first --n held-out WordNet exchanges ("What is a dog?" -> "A dog is ..."), reports:
  names_subject: the answer contains the question's subject word (what a reference answer starts
                 with: "A dog is ...");
  readable:      the answer is printable ASCII with at least 85 % letters and spaces (the same rule as
                 tests/e2e/test_e2e_default_model.cpp);
and a few examples. Prints JSON.
"""

import argparse
import json
import re

import torch

from model import load_model
from tokenizer import ASSISTANT, BOS, USER, Tokenizer

torch.set_num_threads(2)


def subject_of(question):
    for pat in (r"What is an? (.+)\?$", r"What are (.+)\?$", r"What does the word (.+) mean\?$",
                r"What does it mean to (.+)\?$", r"Tell me about (.+)\.$", r"Define (.+)\.$", r"What is (.+)\?$"):
        m = re.match(pat, question)
        if m:
            return m.group(1).lower()
    return None


def readable(text):
    if not text or any(ord(c) < 0x20 or ord(c) > 0x7e for c in text):
        return False
    return sum(c.isalpha() or c == " " for c in text) * 100 >= len(text) * 85


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--heldout", default="/work/train-data/corpus/heldout.jsonl")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    tok = Tokenizer.load(args.model)
    m = load_model(args.model)
    m.eval()
    eos = m.c.eos_token_id
    docs = [json.loads(l) for l in open(args.heldout, encoding="utf-8")]
    qs = []
    for d in docs:
        if d["source"] != "wordnet":
            continue
        t = d["text"]
        q = t[len(USER):t.index(ASSISTANT)]
        if subject_of(q):
            qs.append(q)
    qs = qs[:args.n]
    named = ok = 0
    examples = []
    with torch.no_grad():
        for i, q in enumerate(qs):
            seq = tok.encode(f"{BOS}{USER}{q}{ASSISTANT}")
            n = len(seq)
            for _ in range(args.max_tokens):
                lg, _ = m(torch.tensor([seq]))
                t = int(lg[0, -1].argmax())
                if t == eos:
                    break
                seq.append(t)
            a = tok.decode(seq[n:])
            s = subject_of(q)
            hit = s in a.lower()
            named += hit
            ok += readable(a)
            if i < 12:
                examples.append({"question": q, "answer": a, "names_subject": hit})
    print(json.dumps({"questions": len(qs), "names_subject": named / len(qs), "readable": ok / len(qs),
                      "examples": examples}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
