"""Exports a training checkpoint in the exact Hugging Face DeepSeek-V3 layout and evaluates it.

  python3 export.py --data /work/train-data --out OUT_DIR [--no-eval]

Writes OUT_DIR/config.json, model.safetensors (BF16; e_score_correction_bias F32), tokenizer.json,
tokenizer_config.json; OUT_DIR-fp8/ the same weights with every attention/MLP linear as F8_E4M3
plus F32 weight_scale_inv (128x128 blocks) and quantization_config; OUT_DIR/loss.svg (the loss
curve); OUT_DIR/eval.json: held-out perplexity of the exported BF16 model vs an add-one bigram
baseline fitted on the training tokens, and MTP acceptance at k = 1 (teacher-forced on held-out
windows: the MTP draft at row i equals the main model's greedy token at position i+1).
"""

import argparse
import json
import math
import os
import shutil

import numpy as np
import torch

import safetensors_io as st
from model import Config, DeepseekV3, load_model

torch.set_num_threads(2)


def write_model(m, out, fp8):
    os.makedirs(out, exist_ok=True)
    cfg = dict(m.c.raw)
    if fp8:
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [128, 128]}
    else:
        cfg.pop("quantization_config", None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    from model import export_tensors
    st.save(os.path.join(out, "model.safetensors"), export_tensors(m, fp8=fp8))


def svg_curve(records, path):
    W, H, L, R, T, B = 720, 420, 60, 20, 30, 50
    steps = [r["step"] for r in records]
    series = [("train loss", "#1f77b4", [(r["step"], r["loss"]) for r in records]),
              ("train MTP loss", "#ff7f0e", [(r["step"], r["mtp_loss"]) for r in records]),
              ("held-out loss", "#2ca02c", [(r["step"], r["heldout_loss"]) for r in records if "heldout_loss" in r]),
              ("held-out MTP loss", "#d62728",
               [(r["step"], r["heldout_mtp_loss"]) for r in records if "heldout_mtp_loss" in r])]
    ys = [y for _, _, pts in series for _, y in pts]
    x0, x1 = 0, max(steps)
    y0, y1 = math.floor(min(ys)), math.ceil(max(ys))

    def px(x):
        return L + (x - x0) / max(1, x1 - x0) * (W - L - R)

    def py(y):
        return T + (y1 - y) / max(1e-9, y1 - y0) * (H - T - B)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="14">tiny DeepSeek-V3: cross-entropy '
           f'(nats/token) vs step</text>']
    for k in range(y0, y1 + 1):
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{py(k):.1f}" y2="{py(k):.1f}" stroke="#ddd"/>'
                   f'<text x="{L - 6}" y="{py(k) + 4:.1f}" text-anchor="end">{k}</text>')
    nt = 5
    for i in range(nt + 1):
        s = round(x0 + (x1 - x0) * i / nt)
        out.append(f'<text x="{px(s):.1f}" y="{H - B + 18}" text-anchor="middle">{s}</text>')
    out.append(f'<text x="{W / 2}" y="{H - 10}" text-anchor="middle">step</text>')
    out.append(f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="#333"/>')
    for i, (name, color, pts) in enumerate(series):
        if not pts:
            continue
        # smooth the per-step training curves a little (moving average of 10) for readability
        if "train" in name and len(pts) > 20:
            vals = [p[1] for p in pts]
            pts = [(pts[j][0], sum(vals[max(0, j - 9):j + 1]) / len(vals[max(0, j - 9):j + 1])) for j in range(len(pts))]
        d = " ".join(f"{'M' if j == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for j, (x, y) in enumerate(pts))
        out.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        out.append(f'<rect x="{W - R - 170}" y="{T + 10 + 18 * i}" width="12" height="3" fill="{color}"/>'
                   f'<text x="{W - R - 152}" y="{T + 15 + 18 * i}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


@torch.no_grad()
def evaluate(m, train_arr, held_arr, vocab, T=256, max_windows=128):
    m.eval()
    # bigram baseline with add-one smoothing, fitted on the training tokens
    counts = np.zeros((vocab, vocab), dtype=np.float64)
    np.add.at(counts, (train_arr[:-1].astype(np.int64), train_arr[1:].astype(np.int64)), 1.0)
    probs = (counts + 1.0) / (counts.sum(1, keepdims=True) + vocab)
    total = (len(held_arr) - 2) // (T + 1)
    n_win = min(max_windows, total)
    picks = [round(k * total / n_win) for k in range(n_win)]  # spread over all sources (file order)
    nll = nll_bi = 0.0
    n = 0
    acc = acc_n = 0
    mtp_nll = 0.0
    mtp_n = 0
    mtp_true = 0
    for w in picks:
        ids = torch.from_numpy(held_arr[w * (T + 1):(w + 1) * (T + 1) + 1].astype(np.int64))[None]
        x, y = ids[:, :T], ids[:, 1:T + 1]
        logits, h = m(x)
        lp = torch.log_softmax(logits[0], -1)
        nll -= lp.gather(1, y[0, :, None]).sum().item()
        xb, yb = x[0].numpy(), y[0].numpy()
        nll_bi -= np.log(probs[xb, yb]).sum()
        n += T
        # MTP rows 0..T-2: input t[i+1], h[i]; predicts t[i+2]
        ml = m.mtp(x[:, 1:], h[:, :-1])[0]
        draft = ml.argmax(-1)
        greedy_next = logits[0, 1:].argmax(-1)  # main model's greedy token after position i+1
        acc += (draft == greedy_next).sum().item()
        acc_n += draft.numel()
        mtp_true += (draft == y[0, 1:]).sum().item()
        mlp = torch.log_softmax(ml, -1)
        mtp_nll -= mlp.gather(1, y[0, 1:, None]).sum().item()
        mtp_n += T - 1
    return {
        "heldout_tokens": n,
        "heldout_windows": n_win,
        "window": T,
        "perplexity": math.exp(nll / n),
        "bigram_perplexity": math.exp(nll_bi / n),
        "mtp_perplexity_t_plus_2": math.exp(mtp_nll / mtp_n),
        "mtp_acceptance_k1_vs_main_greedy": acc / acc_n,
        "mtp_draft_equals_true_token": mtp_true / acc_n,
    }


SAMPLE_QUESTIONS = ["What is a dog?", "What does it mean to run?", "Tell me about the sea.", "What is a computer?",
                    "What does happy mean?", "Define library."]


@torch.no_grad()
def samples(m, tok_dir, max_new=48):
    """Greedy answers (model.py, stop at EOS) to a few chat questions rendered with the template."""
    from tokenizer import ASSISTANT, BOS, EOS, USER, Tokenizer
    tok = Tokenizer.load(tok_dir)
    out = []
    for q in SAMPLE_QUESTIONS:
        seq = tok.encode(f"{BOS}{USER}{q}{ASSISTANT}")
        n = len(seq)
        for _ in range(max_new):
            lg, _ = m(torch.tensor([seq]))
            nxt = int(lg[0, -1].argmax())
            if nxt == m.c.eos_token_id:
                break
            seq.append(nxt)
        out.append({"user": q, "assistant": tok.decode(seq[n:])})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/work/train-data")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-eval", action="store_true")
    args = ap.parse_args()
    ck = torch.load(args.ckpt or os.path.join(args.data, "ckpt", "last.pt"))
    m = DeepseekV3(Config(ck["config"]))
    m.load_state_dict(ck["model"])
    out = os.path.abspath(args.out)
    write_model(m, out, fp8=False)
    write_model(m, out + "-fp8", fp8=True)
    for d in (out, out + "-fp8"):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(args.data, "tokenizer", f), os.path.join(d, f))
    records = [json.loads(l) for l in open(os.path.join(args.data, "ckpt", "loss.jsonl"))]
    # a resumed run may have re-logged steps; keep the last record of each step
    by_step = {}
    for r in records:
        by_step[r["step"]] = r
    records = [by_step[s] for s in sorted(by_step) if s <= ck["step"]]
    if records:
        svg_curve(records, os.path.join(out, "loss.svg"))
    size = {d: sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)) for d in (out, out + "-fp8")}
    summary = {"step": ck["step"], "parameters": sum(p.numel() for p in m.parameters()),
               "bytes": size, "last_train_loss": records[-1]["loss"] if records else None}
    if not args.no_eval:
        mb = load_model(out)  # what the engine sees: the BF16 weights
        train_arr = np.fromfile(os.path.join(args.data, "tokens", "train.bin"), dtype=np.uint16)
        held_arr = np.fromfile(os.path.join(args.data, "tokens", "heldout.bin"), dtype=np.uint16)
        summary.update(evaluate(mb, train_arr, held_arr, mb.c.vocab_size))
        summary["samples"] = samples(mb, out)
    with open(os.path.join(out, "eval.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
