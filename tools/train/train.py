"""Trains the tiny DeepSeek-V3 model of model.py on the corpus of prep_data.py.

  nice -n 19 python3 train.py --data /work/train-data --steps 1500      # starts or resumes

Loss = next-token cross-entropy + 0.3 x the MTP cross-entropy (row i predicts t[i+2]).
Aux-loss-free balancing (DeepSeek-V3 paper 2.1.2): after every step each MoE layer's
e_score_correction_bias moves by bias_rate * sign(mean load - expert load). AdamW, linear
warmup then cosine decay to 10 %. Checkpoints (model, optimizer, step, config) go to
DATA/ckpt/last.pt every --ckpt-every steps and at the end (written to a temporary file, then
renamed); rerunning the same command resumes from it. Losses go to DATA/ckpt/loss.jsonl.
Batches are drawn from a generator seeded by (seed, step), so a resumed run sees the same data.
"""

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from model import Config, DeepseekV3, MoE
from tokenizer import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))


def model_config(vocab_size):
    """DeepSeek-V3 shape ratios scaled down to a few million parameters."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "moe_layer_freq": 1,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 1,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.3",
        "use_cache": True,
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 96,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 1024,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    }


def tokenize_corpus(data, split, tok):
    """DATA/tokens/{split}.bin: uint16 ids, each document as BOS + ids + EOS."""
    out = os.path.join(data, "tokens", f"{split}.bin")
    if os.path.exists(out):
        return np.fromfile(out, dtype=np.uint16)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    ids = []
    with open(os.path.join(data, "corpus", f"{split}.jsonl"), encoding="utf-8") as f:
        for line in f:
            ids.append(0)
            ids.extend(tok.encode(json.loads(line)["text"]))
            ids.append(1)
    arr = np.array(ids, dtype=np.uint16)
    arr.tofile(out + ".tmp")
    os.replace(out + ".tmp", out)
    return arr


def init_weights(m, std=0.02):
    n_layers = m.c.num_hidden_layers + 1
    for name, p in m.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.nn.init.normal_(p, 0.0, std / math.sqrt(2 * n_layers))
        else:
            torch.nn.init.normal_(p, 0.0, std)
    for moe in m.moe_layers():
        moe.gate.e_score_correction_bias.zero_()


def batch(arr, rng, B, T):
    starts = rng.integers(0, len(arr) - T - 2, size=B)
    return torch.from_numpy(np.stack([arr[s:s + T + 1] for s in starts]).astype(np.int64))


ASSISTANT_ID = 3  # <｜Assistant｜> in the trained tokenizer (tokenizer.py: special tokens 0-3)


def answer_start_weights(y, weight, first=3):
    """Per-target weights: `weight` for the first `first` targets of each chat answer (the tokens
    right after <｜Assistant｜>, where an answer names its subject), 1 elsewhere."""
    w = torch.ones(y.shape, dtype=torch.float32)
    if weight == 1.0:
        return w
    rows, cols = (y == ASSISTANT_ID).nonzero(as_tuple=True)
    for k in range(1, first + 1):
        c = cols + k
        keep = c < y.shape[1]
        w[rows[keep], c[keep]] = weight
    return w


def losses(m, ids, mtp_weight=0.3, answer_weight=1.0):
    x, y = ids[:, :-1], ids[:, 1:]
    logits, h = m(x)
    w = answer_start_weights(y, answer_weight)
    per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    main = (per * w.reshape(-1)).sum() / w.sum()
    ml = m.mtp(ids[:, 1:-1], h[:, :-1])
    mtp = F.cross_entropy(ml.reshape(-1, ml.shape[-1]), ids[:, 2:].reshape(-1))
    return main, mtp, main + mtp_weight * mtp


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


@torch.no_grad()
def evaluate(m, arr, B, T, n=8, seed=1234):
    m.eval()
    rng = np.random.default_rng(seed)
    tot_main = tot_mtp = 0.0
    for _ in range(n):
        a, b, _ = losses(m, batch(arr, rng, B, T))
        tot_main += a.item()
        tot_mtp += b.item()
    m.train()
    return tot_main / n, tot_mtp / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/work/train-data")
    ap.add_argument("--steps", type=int, default=1500, help="total steps of the cosine schedule")
    ap.add_argument("--stop-at", type=int, default=0, help="stop (checkpointed) at this step; 0 = --steps")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--bias-rate", type=float, default=5e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--answer-weight", type=float, default=1.0,
                    help="loss weight of the first 3 tokens of each chat answer (1 = plain next-token loss)")
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ckdir = os.path.join(args.data, "ckpt")
    os.makedirs(ckdir, exist_ok=True)
    tok = Tokenizer.load(os.path.join(args.data, "tokenizer"))
    train_arr = tokenize_corpus(args.data, "train", tok)
    held_arr = tokenize_corpus(args.data, "heldout", tok)
    print(f"tokens: train {len(train_arr)} heldout {len(held_arr)}", flush=True)

    last = os.path.join(ckdir, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last)
        cfg = Config(ck["config"])
        torch.manual_seed(args.seed)
        m = DeepseekV3(cfg)
        m.load_state_dict(ck["model"])
        step = ck["step"]
        print(f"resumed at step {step}", flush=True)
    else:
        cfg = Config(model_config(len(tok.token_bytes)))
        torch.manual_seed(args.seed)
        m = DeepseekV3(cfg)
        init_weights(m)
        step = 0
        ck = None
    n_params = sum(p.numel() for p in m.parameters())
    print(f"parameters: {n_params} (+ MTP copies of embed/head in the checkpoint)", flush=True)
    decay = [p for n, p in m.named_parameters() if p.dim() == 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in m.named_parameters() if not (p.dim() == 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if ck is not None:
        opt.load_state_dict(ck["opt"])
    stop = args.stop_at or args.steps
    log = open(os.path.join(ckdir, "loss.jsonl"), "a")
    moes = m.moe_layers()

    def save():
        tmp = last + ".tmp"
        torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "step": step, "config": cfg.raw,
                    "args": vars(args)}, tmp)
        os.replace(tmp, last)

    m.train()
    t0 = time.time()
    while step < stop:
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        rng = np.random.default_rng([args.seed, step])
        ids = batch(train_arr, rng, args.batch, args.seq)
        main_l, mtp_l, loss = losses(m, ids, args.mtp_weight, args.answer_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # aux-loss-free balancing
            imb = []
            for moe in moes:
                load = moe.load.float()
                moe.gate.e_score_correction_bias += args.bias_rate * torch.sign(load.mean() - load)
                imb.append((load.max() / load.mean()).item())
        step += 1
        rec = {"step": step, "loss": round(main_l.item(), 4), "mtp_loss": round(mtp_l.item(), 4), "lr": lr,
               "grad_norm": round(gn.item(), 3), "max_load_ratio": round(max(imb), 3),
               "elapsed_s": round(time.time() - t0, 1)}
        if step % args.eval_every == 0 or step == stop:
            hm, ht = evaluate(m, held_arr, args.batch, args.seq)
            rec["heldout_loss"], rec["heldout_mtp_loss"] = round(hm, 4), round(ht, 4)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if step % 10 == 0 or "heldout_loss" in rec:
            print(json.dumps(rec), flush=True)
        if step % args.ckpt_every == 0 or step == stop:
            save()
    print("done", flush=True)


if __name__ == "__main__":
    main()
