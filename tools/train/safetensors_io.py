"""Minimal safetensors reader/writer (no third-party package).

Format: 8-byte little-endian header length, a JSON header (name -> dtype, shape, data_offsets
relative to the data section; optional "__metadata__"), then the raw row-major data.
Supported dtypes: F32, BF16, F16, I64, I32, F8_E4M3 (returned as uint8 codes; see fp8_e4m3_table).

The writer stores tensors sorted by element size (largest first) then name, so each tensor is
aligned to its element size, and pads the header with spaces to a multiple of 8, like the golden
files (tests/data/golden/README.md section 2).
"""

import json
import struct

import numpy as np
import torch

_ELEM = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "F8_E4M3": 1, "U8": 1}


def read_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header, 8 + n


def load(path):
    """Returns {name: torch tensor}. BF16 -> torch.bfloat16, F8_E4M3 -> torch.uint8 codes."""
    header, base = read_header(path)
    with open(path, "rb") as f:
        blob = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
        raw = blob[base + b: base + e]
        if dt == "F32":
            t = torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy())
        elif dt == "F16":
            t = torch.from_numpy(np.frombuffer(raw, dtype="<f2").copy())
        elif dt == "BF16":
            t = torch.from_numpy(np.frombuffer(raw, dtype="<i2").copy()).view(torch.bfloat16)
        elif dt == "I64":
            t = torch.from_numpy(np.frombuffer(raw, dtype="<i8").copy())
        elif dt == "I32":
            t = torch.from_numpy(np.frombuffer(raw, dtype="<i4").copy())
        elif dt in ("F8_E4M3", "U8"):
            t = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
        else:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dt}")
        out[name] = t.reshape(shape)
    return out


def dtypes(path):
    header, _ = read_header(path)
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def _to_bytes(t, dt):
    if dt == "BF16":
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().astype("<i2").tobytes()
    if dt == "F32":
        return t.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
    if dt == "I64":
        return t.to(torch.int64).contiguous().numpy().astype("<i8").tobytes()
    if dt == "I32":
        return t.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()
    if dt == "F8_E4M3":
        assert t.dtype == torch.uint8
        return t.contiguous().numpy().tobytes()
    raise ValueError(dt)


def save(path, tensors, metadata=None):
    """tensors: {name: (torch tensor, dtype string)}."""
    items = sorted(tensors.items(), key=lambda kv: (-_ELEM[kv[1][1]], kv[0]))
    header = {"__metadata__": metadata or {"format": "pt"}}
    chunks = []
    off = 0
    for name, (t, dt) in items:
        data = _to_bytes(t, dt)
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [off, off + len(data)]}
        chunks.append(data)
        off += len(data)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for c in chunks:
            f.write(c)


def fp8_e4m3_table():
    """float32 value of every e4m3fn code 0..255 (0x7F / 0xFF are NaN)."""
    vals = np.zeros(256, dtype=np.float64)
    for c in range(256):
        s = -1.0 if c & 0x80 else 1.0
        e = (c >> 3) & 0xF
        m = c & 7
        if e == 0xF and m == 7:
            vals[c] = np.nan
        elif e == 0:
            vals[c] = s * (m / 8.0) * 2.0 ** -6
        else:
            vals[c] = s * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return torch.from_numpy(vals.astype(np.float32))


_TABLE = None


def dequant_fp8(codes, scale_inv, block=(128, 128)):
    """W[i, j] = float32(e4m3(q[i, j])) * scale[i / bo][j / bi], one float32 product."""
    global _TABLE
    if _TABLE is None:
        _TABLE = fp8_e4m3_table()
    w = _TABLE[codes.long()]
    bo, bi = block
    s = scale_inv.repeat_interleave(bo, 0)[: w.shape[0]].repeat_interleave(bi, 1)[:, : w.shape[1]]
    return w * s


def quant_fp8(w, block=(128, 128)):
    """Block quantization: scale = amax(|block|)/448 (float32), codes = round-to-nearest-even of
    w/scale on the e4m3 grid, saturating at 448. Returns (uint8 codes, float32 scale_inv)."""
    global _TABLE
    if _TABLE is None:
        _TABLE = fp8_e4m3_table()
    w = w.to(torch.float32)
    out_f, in_f = w.shape
    bo, bi = block
    nb_o, nb_i = -(-out_f // bo), -(-in_f // bi)
    scale = torch.zeros(nb_o, nb_i, dtype=torch.float32)
    for a in range(nb_o):
        for b in range(nb_i):
            amax = w[a * bo:(a + 1) * bo, b * bi:(b + 1) * bi].abs().max()
            scale[a, b] = amax / 448.0 if amax > 0 else 1.0
    s = scale.repeat_interleave(bo, 0)[:out_f].repeat_interleave(bi, 1)[:, :in_f]
    x = (w / s).to(torch.float64).clamp(-448.0, 448.0)
    pos = _TABLE[:0x7F].to(torch.float64)  # codes 0..126, ascending, non-negative
    ax = x.abs().flatten()
    hi = torch.searchsorted(pos, ax).clamp(max=pos.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    dlo = ax - pos[lo]
    dhi = pos[hi] - ax
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo)
    sign = (x.flatten() < 0) & (code != 0)
    code = code + sign.long() * 0x80
    return code.to(torch.uint8).reshape(out_f, in_f), scale
