"""Proves model.py against tests/data/golden/{tiny-bf16,tiny-fp8} (tolerances of the golden
README section 6). Usage: python3 check_golden.py [GOLDEN_DIR ...]; exit code 1 on a failure.
Prints the measured max |delta| per tensor, for both attention modes."""

import json
import os
import sys

import torch

import safetensors_io as st
from model import load_model

torch.set_num_threads(2)
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = [os.path.join(HERE, "..", "..", "tests", "data", "golden", n) for n in ("tiny-bf16", "tiny-fp8")]

TOL = {"logits": 1e-3, "hidden": 2e-4, "weight": 1e-5}


def check_dir(d):
    ok = True
    res = {}
    m = load_model(d)
    m.eval()
    g = st.load(os.path.join(d, "golden.safetensors"))
    meta = json.load(open(os.path.join(d, "golden.json")))
    c = m.c

    def cmp(name, got, want, tol):
        nonlocal ok
        err = (got.float() - want.float()).abs().max().item()
        res[name] = max(err, res.get(name, 0.0))
        if not err <= tol:
            ok = False
            print(f"  FAIL {name}: {err:.3g} > {tol}")

    def same(name, got, want):
        nonlocal ok
        eq = bool(torch.equal(got.long(), want.long()))
        res[name] = res.get(name, True) and eq
        if not eq:
            ok = False
            print(f"  FAIL {name}: differ")

    # rope / scale conventions
    cmp("rope.inv_freq", m.inv_freq, torch.tensor(meta["rope"]["inv_freq"]), 0.0)
    if abs(c.softmax_scale() - meta["softmax_scale"]) > 1e-12:
        ok = False
        print("  FAIL softmax_scale")
    # fp8 dequantization
    raw = st.load(os.path.join(d, "model.safetensors"))
    for k in g:
        if k.startswith("dequant."):
            name = k[len("dequant."):]
            dq = st.dequant_fp8(raw[name], raw[name + "_scale_inv"])
            cmp("dequant.*", dq, g[k], 0.0)

    with torch.no_grad():
        for p in range(len(meta["prompts"])):
            pre = f"p{p}."
            tokens = g[pre + "tokens"].long()
            greedy = g[pre + "greedy"].long()
            N, G = tokens.numel(), greedy.numel()
            for mode in ("absorb", "naive"):
                tr = {}
                logits, hf = m(tokens[None], mode=mode, trace=tr)
                cmp(f"logits_all[{mode}]", logits[0], g[pre + "logits_all"], TOL["logits"])
                cmp(f"hidden_final[{mode}]", hf[0], g[pre + "hidden_final"], TOL["hidden"])
                hl = torch.stack([lt["hidden"][0] for lt in tr["layers"]])
                cmp(f"hidden_layers[{mode}]", hl, g[pre + "hidden_layers"], TOL["hidden"])
                cmp(f"kv_cache[{mode}]", torch.stack([lt["c_kv"][0] for lt in tr["layers"]]), g[pre + "kv_cache"],
                    TOL["hidden"])
                cmp(f"pe_cache[{mode}]", torch.stack([lt["k_pe"][0] for lt in tr["layers"]]), g[pre + "pe_cache"],
                    TOL["hidden"])
                moe = [lt for lt in tr["layers"] if "topk_idx" in lt]
                gi, gw = g[pre + "moe_topk_idx"].long(), g[pre + "moe_topk_weight"]
                for li, lt in enumerate(moe):
                    same(f"moe_topk_idx[{mode}]", lt["topk_idx"].sort(-1).values, gi[li].sort(-1).values)
                    cmp(f"moe_topk_weight[{mode}]", lt["topk_weight"], gw[li], TOL["weight"])
                # greedy decode by full recomputation (golden: incremental == full, delta 0)
                seq = tokens.clone()
                rows = []
                for t in range(G):
                    lg, _ = m(seq[None], mode=mode)
                    rows.append(lg[0, -1])
                    seq = torch.cat([seq, lg[0, -1].argmax().view(1)])
                same(f"greedy[{mode}]", seq[N:], greedy)
                cmp(f"decode_logits[{mode}]", torch.stack(rows), g[pre + "decode_logits"], TOL["logits"])
                full = torch.cat([tokens, greedy])  # t = prompt + greedy, N + G tokens
                lg, hfull = m(full[None], mode=mode)
                cmp(f"decode_hidden[{mode}]", hfull[0, N - 1:N - 1 + G], g[pre + "decode_hidden"], TOL["hidden"])
                # MTP: positions 1..N-1, tokens t[2..N] (t[N] = greedy[0])
                tr = {}
                ml = m.mtp(full[None, 2:N + 1], hfull[:, 1:N], start=1, mode=mode, trace=tr)
                cmp(f"mtp_logits[{mode}]", ml[0], g[pre + "mtp_logits"], TOL["logits"])
                cmp(f"mtp_hidden_in[{mode}]", tr["hidden_in"][0], g[pre + "mtp_hidden_in"], TOL["hidden"])
                cmp(f"mtp_kv_cache[{mode}]", tr["c_kv"][0], g[pre + "mtp_kv_cache"], TOL["hidden"])
                cmp(f"mtp_pe_cache[{mode}]", tr["k_pe"][0], g[pre + "mtp_pe_cache"], TOL["hidden"])
                same(f"mtp_topk_idx[{mode}]", tr["topk_idx"].sort(-1).values,
                     g[pre + "mtp_topk_idx"].long().sort(-1).values)
                cmp(f"mtp_topk_weight[{mode}]", tr["topk_weight"], g[pre + "mtp_topk_weight"], TOL["weight"])
                same(f"mtp_draft[{mode}]", ml[0, -1].argmax(), torch.tensor(meta["prompts"][p]["mtp_draft"]))
                # MTP over positions 0..N+G-2 with and without the position-0 zeroing
                for conv, zero in (("nozero", False), ("vllm", True)):
                    tr = {}
                    ml = m.mtp(full[None, 1:N + G], hfull[:, 0:N + G - 1], start=0, mode=mode, zero_first=zero,
                               trace=tr)
                    cmp(f"mtp_logits_{conv}[{mode}]", ml[0], g[pre + f"mtp_logits_{conv}"], TOL["logits"])
                    cmp(f"mtp_kv_cache_{conv}[{mode}]", tr["c_kv"][0], g[pre + f"mtp_kv_cache_{conv}"], TOL["hidden"])
                    same(f"mtp_drafts_{conv}[{mode}]", ml[0, N - 1:].argmax(-1),
                         torch.tensor(meta["prompts"][p][f"mtp_drafts_{conv}"]))
    return ok, res


def main():
    dirs = sys.argv[1:] or DEFAULT
    all_ok = True
    report = {}
    for d in dirs:
        name = os.path.basename(os.path.normpath(d))
        ok, res = check_dir(d)
        all_ok &= ok
        report[name] = res
        print(f"{name}: {'PASS' if ok else 'FAIL'}")
        for k, v in res.items():
            print(f"  {k}: {v if isinstance(v, bool) else f'{v:.3g}'}")
    print("ALL PASS" if all_ok else "SOME CHECKS FAILED")
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
