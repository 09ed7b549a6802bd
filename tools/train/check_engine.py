"""Second, independent check of the C++ engine on the trained model: `pdserve generate` and
`pdserve logits` against model.py on 10 held-out prompts.

  python3 check_engine.py --pdserve BUILD/tools/pdserve --model OUT_DIR [--tokens 24]

For each prompt (5 chat questions rendered with the chat template, 5 text prefixes, all from
held-out documents): greedy tokens of both (no EOS stop) must be identical; `pdserve logits` on
prompt + greedy tokens gives logits_all and mtp_logits_nozero, compared with model.py (float32;
tolerance 1e-3 as in the golden README). Also runs `pdserve generate --mtp 1 --stats` and
reports the engine's MTP acceptance at k = 1. Prints a JSON summary; exit 1 on a mismatch.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

import safetensors_io as st
from model import load_model
from tokenizer import ASSISTANT, BOS, USER, Tokenizer

torch.set_num_threads(2)


def prompts(tok, heldout, n_chat=5, n_text=5):
    docs = [json.loads(l) for l in open(heldout, encoding="utf-8")]
    chat_docs = [d["text"] for d in docs if d["source"] == "wordnet"]
    chat = []
    for d in chat_docs[::max(1, len(chat_docs) // n_chat)][:n_chat]:  # spread over the file
        q = d[len(USER):d.index(ASSISTANT)]
        chat.append(tok.encode(f"{BOS}{USER}{q}{ASSISTANT}"))
    text = [[0] + tok.encode(d["text"])[:16] for d in docs if d["source"] != "wordnet"][:n_text]
    return chat + text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdserve", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--heldout", default="/work/train-data/corpus/heldout.jsonl")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    tok = Tokenizer.load(args.model)
    m = load_model(args.model)
    m.eval()
    ps = prompts(tok, args.heldout)
    ok = True
    res = {"prompts": [], "max_abs_logits": 0.0, "max_abs_mtp_logits": 0.0, "greedy_equal": 0,
           "drafts_proposed": 0, "drafts_accepted": 0}
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        for k, p in enumerate(ps):
            seq = list(p)
            margins = []
            for _ in range(args.tokens):
                lg, _ = m(torch.tensor([seq]))
                top2 = lg[0, -1].topk(2).values
                margins.append((top2[0] - top2[1]).item())
                seq.append(int(lg[0, -1].argmax()))
            mine = seq[len(p):]
            base = [args.pdserve, "generate", "--model", args.model, "--prompt-ids", ",".join(map(str, p)),
                    "--max-tokens", str(args.tokens), "--ignore-eos", "true", "--threads", str(args.threads),
                    "--log.level", "warn"]
            out = subprocess.run(base, capture_output=True, text=True, check=True).stdout
            eng = json.loads(out.strip().splitlines()[-1])["ids"]
            out = subprocess.run(base + ["--mtp", "1", "--stats", "true"], capture_output=True, text=True,
                                 check=True).stdout
            spec = json.loads(out.strip().splitlines()[-1])
            res["drafts_proposed"] += spec["drafts_proposed"]
            res["drafts_accepted"] += spec["drafts_accepted"]
            same = eng == mine and spec["ids"] == mine
            res["greedy_equal"] += same
            # logits over prompt + greedy tokens
            full = p + mine
            f = os.path.join(tmp, f"l{k}.safetensors")
            subprocess.run([args.pdserve, "logits", "--model", args.model, "--prompt-ids", ",".join(map(str, full)),
                            "--out", f, "--threads", str(args.threads), "--log.level", "warn"],
                           capture_output=True, text=True, check=True)
            g = st.load(f)
            lg, h = m(torch.tensor([full]))
            d_log = (lg[0] - g["logits_all"]).abs().max().item()
            nxt = full[1:] + [int(lg[0, -1].argmax())]
            ml = m.mtp(torch.tensor([nxt]), h)
            d_mtp = (ml[0] - g["mtp_logits_nozero"]).abs().max().item()
            res["max_abs_logits"] = max(res["max_abs_logits"], d_log)
            res["max_abs_mtp_logits"] = max(res["max_abs_mtp_logits"], d_mtp)
            ok &= same and d_log <= 1e-3 and d_mtp <= 1e-3
            res["prompts"].append({"prompt": tok.decode(p), "pytorch": tok.decode(mine), "greedy_equal": same,
                                   "engine": tok.decode(eng), "min_top1_margin": round(min(margins), 5),
                                   "max_abs_logits": d_log, "max_abs_mtp_logits": d_mtp})
    res["engine_mtp_acceptance_k1"] = res["drafts_accepted"] / max(1, res["drafts_proposed"])
    res["pass"] = bool(ok)
    print(json.dumps(res, indent=1, ensure_ascii=False))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
