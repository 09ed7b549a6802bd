"""An independent PyTorch implementation of the DeepSeek-V3 architecture (MLA, MoE with a shared
expert and sigmoid noaux_tc routing, one MTP module), written from the conventions of
tests/data/golden/README.md, with parameter names equal to the Hugging Face checkpoint names.

- RMSNorm x * rsqrt(mean(x^2) + eps) * w; RoPE on interleaved pairs with YaRN frequencies
  computed in float32; softmax scale (dn + dr)^-0.5 * mscale^2 (mscale from mscale_all_dim).
- MLA: 'naive' (up-project c_kv through kv_b_proj) or 'absorb' (W_UK folded into the query,
  attention in the latent space); causal over the rows of one call (full-sequence form; the
  golden shows incremental decode equals full recomputation).
- MoE: sigmoid scores, e_score_correction_bias for selection only, group score = sum of the
  group's top-2 biased scores, topk_group groups, top-k, weights renormalized over the chosen
  unbiased scores times routed_scaling_factor, shared expert added unweighted.
- MTP (SGLang 'nozero' convention, what the C++ engine runs): row i takes (t[i+1], h[i]) with
  h = main hidden after model.norm, x = eh_proj([enorm(emb); hnorm(h)]), one MoE block at RoPE
  position i, logits = shared_head.head(shared_head.norm(y)) predicting t[i+2]. In training
  the MTP embedding and head are tied to the main ones (the checkpoint stores bit copies).

Single-threaded use; no global state except torch's.
"""

import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import safetensors_io as st


class Config:
    def __init__(self, d):
        self.raw = dict(d)
        g = d.get
        self.vocab_size = d["vocab_size"]
        self.hidden_size = d["hidden_size"]
        self.intermediate_size = d["intermediate_size"]
        self.moe_intermediate_size = d["moe_intermediate_size"]
        self.num_hidden_layers = d["num_hidden_layers"]
        self.first_k_dense_replace = g("first_k_dense_replace", 0)
        self.num_attention_heads = d["num_attention_heads"]
        self.q_lora_rank = g("q_lora_rank") or 0
        self.kv_lora_rank = d["kv_lora_rank"]
        self.qk_nope_head_dim = d["qk_nope_head_dim"]
        self.qk_rope_head_dim = d["qk_rope_head_dim"]
        self.v_head_dim = d["v_head_dim"]
        self.n_routed_experts = d["n_routed_experts"]
        self.num_experts_per_tok = d["num_experts_per_tok"]
        self.n_group = g("n_group", 1)
        self.topk_group = g("topk_group", 1)
        self.n_shared_experts = g("n_shared_experts", 0)
        self.routed_scaling_factor = g("routed_scaling_factor", 1.0)
        self.rms_norm_eps = g("rms_norm_eps", 1e-6)
        self.rope_theta = g("rope_theta", 10000.0)
        self.max_position_embeddings = d["max_position_embeddings"]
        self.rope_scaling = g("rope_scaling")
        self.num_nextn_predict_layers = g("num_nextn_predict_layers", 0)
        self.bos_token_id = g("bos_token_id", 0)
        self.eos_token_id = g("eos_token_id", 1)
        self.quantization_config = g("quantization_config")
        assert g("scoring_func", "sigmoid") == "sigmoid" and g("topk_method", "noaux_tc") == "noaux_tc"

    @staticmethod
    def load(model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            return Config(json.load(f))

    def softmax_scale(self):
        s = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        rs = self.rope_scaling
        if rs and rs.get("type", rs.get("rope_type")) == "yarn":
            m = rs.get("mscale_all_dim", 0.0)
            f = rs["factor"]
            if m and f > 1:
                s *= (0.1 * m * math.log(f) + 1.0) ** 2
        return s

    def inv_freq(self):
        d = self.qk_rope_head_dim
        base = float(self.rope_theta)
        freqs = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        rs = self.rope_scaling
        if rs and rs.get("type", rs.get("rope_type")) == "yarn":
            factor = float(rs["factor"])
            l0 = rs["original_max_position_embeddings"]
            bf, bs = rs.get("beta_fast", 32), rs.get("beta_slow", 1)

            def corr(n):
                return d * math.log(l0 / (n * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(corr(bf)), 0)
            high = min(math.ceil(corr(bs)), d - 1)
            if low == high:
                high += 0.001
            ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
            smooth = 1 - ramp
            freqs = freqs / factor * (1 - smooth) + freqs * smooth
        return freqs


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def lin(i, o):
    return nn.Linear(i, o, bias=False)


def apply_rope(x, cos, sin):
    """x [..., T, d] with interleaved pairs; cos/sin [T, d/2]."""
    x0 = x[..., 0::2]
    x1 = x[..., 1::2]
    y0 = x0 * cos - x1 * sin
    y1 = x0 * sin + x1 * cos
    return torch.stack((y0, y1), dim=-1).flatten(-2)


class MLA(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        H, dn, dr, dv, r = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                            c.kv_lora_rank)
        D = c.hidden_size
        if c.q_lora_rank:
            self.q_a_proj = lin(D, c.q_lora_rank)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = lin(c.q_lora_rank, H * (dn + dr))
        else:
            self.q_proj = lin(D, H * (dn + dr))
        self.kv_a_proj_with_mqa = lin(D, r + dr)
        self.kv_a_layernorm = RMSNorm(r, c.rms_norm_eps)
        self.kv_b_proj = lin(r, H * (dn + dv))
        self.o_proj = lin(H * dv, D)
        self.scale = c.softmax_scale()

    def forward(self, x, cos, sin, mode="naive", trace=None):
        """x [B, T, D]; rows are consecutive positions given by cos/sin; causal among the rows."""
        c = self.c
        B, T, _ = x.shape
        H, dn, dr, dv, r = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                            c.kv_lora_rank)
        if c.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(B, T, H, dn + dr).transpose(1, 2)  # [B, H, T, dn+dr]
        q_nope, q_pe = q[..., :dn], apply_rope(q[..., dn:], cos, sin)
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[..., :r])  # [B, T, r]
        k_pe = apply_rope(kv[..., r:], cos, sin)  # [B, T, dr]
        if trace is not None:
            trace["c_kv"], trace["k_pe"] = c_kv, k_pe
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        wb = self.kv_b_proj.weight.view(H, dn + dv, r)
        if mode == "naive":
            kvb = self.kv_b_proj(c_kv).view(B, T, H, dn + dv).transpose(1, 2)
            k_nope, v = kvb[..., :dn], kvb[..., dn:]
            s = (q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe.unsqueeze(1).transpose(-1, -2)) * self.scale
            s = s.masked_fill(~mask, float("-inf"))
            p = torch.softmax(s.float(), dim=-1)
            o = p @ v  # [B, H, T, dv]
        else:
            q_lat = torch.einsum("bhtd,hdr->bhtr", q_nope, wb[:, :dn])
            s = (q_lat @ c_kv.unsqueeze(1).transpose(-1, -2) + q_pe @ k_pe.unsqueeze(1).transpose(-1, -2)) * self.scale
            s = s.masked_fill(~mask, float("-inf"))
            p = torch.softmax(s.float(), dim=-1)
            o_lat = p @ c_kv.unsqueeze(1)  # [B, H, T, r]
            o = torch.einsum("bhtr,hvr->bhtv", o_lat, wb[:, dn:])
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * dv))


class MLP(nn.Module):
    def __init__(self, D, inter):
        super().__init__()
        self.gate_proj = lin(D, inter)
        self.up_proj = lin(D, inter)
        self.down_proj = lin(inter, D)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.n_routed_experts))

    def forward(self, x):
        """x [N, D] -> (idx [N, K] by descending biased score, weights [N, K])."""
        c = self.c
        s = torch.sigmoid(F.linear(x, self.weight).float())
        b = s + self.e_score_correction_bias
        N, E = b.shape
        if c.n_group > 1:
            g = b.view(N, c.n_group, E // c.n_group).topk(2, dim=-1).values.sum(-1)
            keep = g.topk(c.topk_group, dim=-1).indices
            gmask = torch.ones(N, c.n_group, dtype=torch.bool).scatter_(1, keep, False)
            b = b.masked_fill(gmask.repeat_interleave(E // c.n_group, dim=1), float("-inf"))
        idx = b.topk(c.num_experts_per_tok, dim=-1).indices
        w = s.gather(1, idx)
        w = w / w.sum(-1, keepdim=True) * c.routed_scaling_factor
        return idx, w


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.gate = Gate(c)
        self.experts = nn.ModuleList([MLP(c.hidden_size, c.moe_intermediate_size) for _ in range(c.n_routed_experts)])
        if c.n_shared_experts:
            self.shared_experts = MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)
        self.load = None  # expert token counts of the last forward (for bias balancing)

    def forward(self, x, trace=None):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w = self.gate(x)
        if trace is not None:
            trace["topk_idx"], trace["topk_weight"] = idx, w
        E = self.c.n_routed_experts
        self.load = torch.bincount(idx.flatten(), minlength=E)
        # group the (token, slot) assignments by expert, run each expert once over its rows, then
        # one scatter-add (ascending expert id, like the reference)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        tok = order // idx.shape[1]
        ws = w.flatten()[order].unsqueeze(-1)
        xs = x[tok]
        outs = []
        start = 0
        for e, n in enumerate(self.load.tolist()):
            if n:
                outs.append(self.experts[e](xs[start:start + n]))
            start += n
        y = torch.zeros_like(x).index_add(0, tok, torch.cat(outs) * ws)
        if self.c.n_shared_experts:
            y = y + self.shared_experts(x)
        return y.view(shape)


class Block(nn.Module):
    def __init__(self, c, moe):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLA(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MoE(c) if moe else MLP(c.hidden_size, c.intermediate_size)

    def forward(self, h, cos, sin, mode="naive", trace=None):
        t_attn = {} if trace is not None else None
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mode, t_attn)
        if isinstance(self.mlp, MoE):
            t_moe = {} if trace is not None else None
            h = h + self.mlp(self.post_attention_layernorm(h), t_moe)
            if trace is not None:
                trace.update(t_moe)
        else:
            h = h + self.mlp(self.post_attention_layernorm(h))
        if trace is not None:
            trace.update(t_attn)
        return h


class MtpBlock(Block):
    def __init__(self, c):
        super().__init__(c, moe=True)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = lin(2 * c.hidden_size, c.hidden_size)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        layers = [Block(c, moe=i >= c.first_k_dense_replace) for i in range(c.num_hidden_layers)]
        if c.num_nextn_predict_layers:
            layers.append(MtpBlock(c))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DeepseekV3(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Inner(c)
        self.lm_head = lin(c.hidden_size, c.vocab_size)
        self.register_buffer("inv_freq", c.inv_freq(), persistent=False)

    def rope(self, start, T):
        pos = torch.arange(start, start + T, dtype=torch.float32)
        ang = torch.outer(pos, self.inv_freq)  # float32(pos * f)
        return torch.cos(ang), torch.sin(ang)

    def moe_layers(self):
        return [l.mlp for l in self.model.layers if isinstance(l.mlp, MoE)]

    def forward(self, ids, mode="naive", trace=None):
        """ids [B, T] at positions 0..T-1 -> (logits [B, T, V], hidden after model.norm [B, T, D])."""
        B, T = ids.shape
        cos, sin = self.rope(0, T)
        h = self.model.embed_tokens(ids)
        for i in range(self.c.num_hidden_layers):
            lt = {} if trace is not None else None
            h = self.model.layers[i](h, cos, sin, mode, lt)
            if trace is not None:
                lt["hidden"] = h
                trace.setdefault("layers", []).append(lt)
        hf = self.model.norm(h)
        return self.lm_head(hf), hf

    def mtp(self, next_ids, hidden, start=0, mode="naive", zero_first=False, trace=None):
        """MTP rows at positions start..start+T-1: next_ids[:, i] = t[pos+1], hidden[:, i] = h[pos].
        Returns logits [B, T, V] predicting t[pos+2]."""
        blk = self.model.layers[self.c.num_hidden_layers]
        T = next_ids.shape[1]
        e = self.model.embed_tokens(next_ids)
        if zero_first and start == 0:
            e = e.clone()
            e[:, 0] = 0
        x = blk.eh_proj(torch.cat([blk.enorm(e), blk.hnorm(hidden)], dim=-1))
        if trace is not None:
            trace["hidden_in"] = x
        cos, sin = self.rope(start, T)
        y = blk(x, cos, sin, mode, trace)
        return self.lm_head(blk.shared_head.norm(y))


# ---- checkpoint I/O -----------------------------------------------------------------------------

def _block(c):
    q = c.quantization_config or {}
    b = q.get("weight_block_size", [128, 128])
    return b[0], b[1]


def load_model(model_dir, dtype=torch.float32):
    """Loads a Hugging Face-layout checkpoint (one model.safetensors, BF16 or FP8 with
    weight_scale_inv) into float32 parameters. Checks the MTP copies of embed/head are equal."""
    c = Config.load(model_dir)
    m = DeepseekV3(c)
    raw = st.load(os.path.join(model_dir, "model.safetensors"))
    blk = _block(c)
    used = set()

    def get(name):
        t = raw[name]
        used.add(name)
        if t.dtype == torch.uint8:
            s = raw[name + "_scale_inv"]
            used.add(name + "_scale_inv")
            return st.dequant_fp8(t, s.float(), blk)
        return t.float()

    sd = m.state_dict()
    new = {}
    for name in sd:
        if name not in raw:
            raise KeyError(f"{model_dir}: missing tensor {name}")
        new[name] = get(name)
        if new[name].shape != sd[name].shape:
            raise ValueError(f"{name}: shape {tuple(new[name].shape)} != {tuple(sd[name].shape)}")
    m.load_state_dict(new)
    L = c.num_hidden_layers
    if c.num_nextn_predict_layers:
        for copy, main in ((f"model.layers.{L}.embed_tokens.weight", "model.embed_tokens.weight"),
                           (f"model.layers.{L}.shared_head.head.weight", "lm_head.weight")):
            if copy in raw:
                used.add(copy)
                if not torch.equal(get(copy), new[main]):
                    raise ValueError(f"{copy} differs from {main} (tied in this implementation)")
    extra = set(raw) - used
    if extra:
        raise ValueError(f"unused tensors: {sorted(extra)[:5]}")
    return m.to(dtype)


QUANTIZED_SUFFIXES = ("q_a_proj.weight", "q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight",
                      "kv_b_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def export_tensors(m, fp8=False):
    """Hugging Face tensors {name: (tensor, dtype)}: BF16 except e_score_correction_bias (F32);
    with fp8 every attention/MLP linear is F8_E4M3 + F32 weight_scale_inv (128x128 blocks)."""
    c = m.c
    out = {}
    sd = {k: v.detach().float() for k, v in m.state_dict().items()}
    L = c.num_hidden_layers
    if c.num_nextn_predict_layers:
        sd[f"model.layers.{L}.embed_tokens.weight"] = sd["model.embed_tokens.weight"]
        sd[f"model.layers.{L}.shared_head.head.weight"] = sd["lm_head.weight"]
    for name, t in sd.items():
        if name.endswith("e_score_correction_bias"):
            out[name] = (t, "F32")
        elif fp8 and name.endswith(QUANTIZED_SUFFIXES) and ".mlp.gate.weight" not in name:
            codes, scale = st.quant_fp8(t.to(torch.bfloat16).float())
            out[name] = (codes, "F8_E4M3")
            out[name + "_scale_inv"] = (scale, "F32")
        else:
            out[name] = (t, "BF16")
    return out
