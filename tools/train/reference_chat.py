"""Reference answers of the trained default model, from model.py (the independent PyTorch
implementation), for the end-to-end test of the quick start (tests/e2e/test_e2e_default_model.cpp):
each prompt is rendered with the model's chat template (one user turn, generation prompt), then
decoded greedily until EOS or --max-tokens, exactly as the router and the C++ engine must do.

  python3 reference_chat.py --model ../../models/tiny-dsv3 > ../../tests/data/default_model/reference.json
"""

import argparse
import json

import torch

from model import load_model
from tokenizer import ASSISTANT, BOS, EOS, USER, Tokenizer

torch.set_num_threads(2)

PROMPTS = ["What is a river?", "What does the word harbor mean?", "Tell me about music.", "What is a dog?"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    tok = Tokenizer.load(args.model)
    m = load_model(args.model)
    m.eval()
    eos = tok.encode(EOS)
    assert len(eos) == 1, eos
    out = {"generated_by": "tools/train/reference_chat.py", "max_tokens": args.max_tokens, "answers": []}
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok.encode(f"{BOS}{USER}{prompt}{ASSISTANT}")
            seq = list(ids)
            new = []
            finish = "length"
            for _ in range(args.max_tokens):
                lg, _ = m(torch.tensor([seq]))
                t = int(lg[0, -1].argmax())
                if t == eos[0]:
                    finish = "stop"
                    break
                new.append(t)
                seq.append(t)
            out["answers"].append({"prompt": prompt, "prompt_ids": ids, "ids": new, "text": tok.decode(new),
                                   "finish_reason": finish})
    print(json.dumps(out, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
