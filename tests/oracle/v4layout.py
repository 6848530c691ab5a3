"""The DeepSeek-V4-Flash release layout, tensor by tensor, for a tiny model (numpy only).

`flash_tensors(cfg, seed)` makes every tensor of a native checkpoint (names without the
`model.` prefix, release dtypes: FP8 E4M3 + E8M0 128x128 tile scales on the attention linears,
the indexer's wq_b, the shared experts and the MTP projections; MXFP4 routed experts; BF16
norms, compressors, weights_proj, gate, embeddings and head; F32 hc_*, ape, attn_sink, gate.bias;
I64 tid2eid) and returns the stored tensors together with the float64 value of every weight
as the checkpoint defines it (FP8 x E8M0 and E2M1 x E8M0 decoded exactly).

`native_to_hf(name)` maps a native weight name to transformers 5.17's DeepseekV4ForCausalLM
parameter (experts: the slice of the stacked gate_up_proj / down_proj); mtp.* maps to None
(transformers does not build the MTP block).

`write_sharded(dir, tensors, n)` splits the sorted tensor list into n shards of about equal
size, `model-0000k-of-0000n.safetensors`, and writes `model.safetensors.index.json`.
"""

import json
import os

import numpy as np

import v4pack as P


def _lin(rng, shape):
    return rng.standard_normal(shape) / np.sqrt(shape[-1])


def init_value(kind, shape, rng, vocab=None, n_experts=None):
    """float64 initial values by role (scales chosen so routing, the indexer and the compressor
    gates are not degenerate: linear outputs of unit-RMS inputs have unit scale)."""
    if kind == "linear":
        return _lin(rng, shape)
    if kind == "norm":
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if kind == "embed":
        return rng.standard_normal(shape)
    if kind in ("sink", "ape"):
        return rng.standard_normal(shape)
    if kind == "hc_fn":
        return _lin(rng, shape)
    if kind == "hc_base":
        return 0.5 * rng.standard_normal(shape)
    if kind == "hc_scale":
        return rng.uniform(0.5, 1.5, shape)
    if kind == "bias":
        return 0.3 * rng.standard_normal(shape)
    if kind == "tid2eid":
        v, k = shape
        return np.stack([rng.permutation(n_experts)[:k] for _ in range(v)]).astype(np.int64)
    raise ValueError(kind)


class Dims:
    """The numbers of a native V4 config.json that fix the tensor shapes."""

    def __init__(self, c):
        self.H = c["hidden_size"]
        self.L = c["num_hidden_layers"]
        self.V = c["vocab_size"]
        self.nh = c["num_attention_heads"]
        self.hd = c["head_dim"]
        self.ql = c["q_lora_rank"]
        self.og = c["o_groups"]
        self.olr = c["o_lora_rank"]
        self.inh = c["index_n_heads"]
        self.ihd = c["index_head_dim"]
        self.I = c["moe_intermediate_size"]
        self.E = c["n_routed_experts"]
        self.k = c["num_experts_per_tok"]
        self.ns = c["n_shared_experts"]
        self.hc = c["hc_mult"]
        self.ratios = c["compress_ratios"]
        self.n_hash = c["num_hash_layers"]
        self.n_mtp = c.get("num_nextn_predict_layers", 0)
        if len(self.ratios) != self.L + self.n_mtp:
            raise ValueError("compress_ratios has %d entries; %d layers + %d MTP need %d" %
                             (len(self.ratios), self.L, self.n_mtp, self.L + self.n_mtp))


def weight_list(d):
    """-> list of (name, storage, shape, kind). storage: fp8 | mxfp4 | bf16 | f32 | i64.
    fp8/mxfp4 names are the `.weight` tensor; their `.scale` tensor is implied."""
    W = []
    mix = (2 + d.hc) * d.hc

    def block(p, ratio, hashed):
        W.extend([
            (p + "attn_norm.weight", "bf16", [d.H], "norm"),
            (p + "ffn_norm.weight", "bf16", [d.H], "norm"),
        ])
        for s in ("attn", "ffn"):
            W.extend([
                (p + "hc_%s_fn" % s, "f32", [mix, d.hc * d.H], "hc_fn"),
                (p + "hc_%s_base" % s, "f32", [mix], "hc_base"),
                (p + "hc_%s_scale" % s, "f32", [3], "hc_scale"),
            ])
        a = p + "attn."
        W.extend([
            (a + "wq_a.weight", "fp8", [d.ql, d.H], "linear"),
            (a + "q_norm.weight", "bf16", [d.ql], "norm"),
            (a + "wq_b.weight", "fp8", [d.nh * d.hd, d.ql], "linear"),
            (a + "wkv.weight", "fp8", [d.hd, d.H], "linear"),
            (a + "kv_norm.weight", "bf16", [d.hd], "norm"),
            (a + "wo_a.weight", "fp8", [d.og * d.olr, d.nh * d.hd // d.og], "linear"),
            (a + "wo_b.weight", "fp8", [d.H, d.og * d.olr], "linear"),
            (a + "attn_sink", "f32", [d.nh], "sink"),
        ])
        if ratio:
            coff = 2 if ratio == 4 else 1
            c = a + "compressor."
            W.extend([
                (c + "ape", "f32", [ratio, coff * d.hd], "ape"),
                (c + "norm.weight", "bf16", [d.hd], "norm"),
                (c + "wkv.weight", "bf16", [coff * d.hd, d.H], "linear"),
                (c + "wgate.weight", "bf16", [coff * d.hd, d.H], "linear"),
            ])
        if ratio == 4:
            x = a + "indexer."
            W.extend([
                (x + "wq_b.weight", "fp8", [d.inh * d.ihd, d.ql], "linear"),
                (x + "weights_proj.weight", "bf16", [d.inh, d.H], "linear"),
                (x + "compressor.ape", "f32", [4, 2 * d.ihd], "ape"),
                (x + "compressor.norm.weight", "bf16", [d.ihd], "norm"),
                (x + "compressor.wkv.weight", "bf16", [2 * d.ihd, d.H], "linear"),
                (x + "compressor.wgate.weight", "bf16", [2 * d.ihd, d.H], "linear"),
            ])
        f = p + "ffn."
        W.append((f + "gate.weight", "bf16", [d.E, d.H], "linear"))
        if hashed:
            W.append((f + "gate.tid2eid", "i64", [d.V, d.k], "tid2eid"))
        else:
            W.append((f + "gate.bias", "f32", [d.E], "bias"))
        for e in range(d.E):
            W.extend([
                (f + "experts.%d.w1.weight" % e, "mxfp4", [d.I, d.H], "linear"),
                (f + "experts.%d.w2.weight" % e, "mxfp4", [d.H, d.I], "linear"),
                (f + "experts.%d.w3.weight" % e, "mxfp4", [d.I, d.H], "linear"),
            ])
        si = d.I * d.ns
        W.extend([
            (f + "shared_experts.w1.weight", "fp8", [si, d.H], "linear"),
            (f + "shared_experts.w2.weight", "fp8", [d.H, si], "linear"),
            (f + "shared_experts.w3.weight", "fp8", [si, d.H], "linear"),
        ])

    W.extend([
        ("embed.weight", "bf16", [d.V, d.H], "embed"),
        ("head.weight", "bf16", [d.V, d.H], "linear"),
        ("norm.weight", "bf16", [d.H], "norm"),
        ("hc_head_fn", "f32", [d.hc, d.hc * d.H], "hc_fn"),
        ("hc_head_base", "f32", [d.hc], "hc_base"),
        ("hc_head_scale", "f32", [1], "hc_scale"),
    ])
    for i in range(d.L):
        block("layers.%d." % i, d.ratios[i], i < d.n_hash)
    for m in range(d.n_mtp):
        p = "mtp.%d." % m
        W.extend([
            (p + "e_proj.weight", "fp8", [d.H, d.H], "linear"),
            (p + "h_proj.weight", "fp8", [d.H, d.H], "linear"),
            (p + "enorm.weight", "bf16", [d.H], "norm"),
            (p + "hnorm.weight", "bf16", [d.H], "norm"),
            (p + "norm.weight", "bf16", [d.H], "norm"),
            (p + "hc_head_fn", "f32", [d.hc, d.hc * d.H], "hc_fn"),
            (p + "hc_head_base", "f32", [d.hc], "hc_base"),
            (p + "hc_head_scale", "f32", [1], "hc_scale"),
        ])
        block(p, d.ratios[d.L + m], False)
    return W


def flash_tensors(cfg, seed):
    """-> (tensors: name -> v4pack.Tensor, values: weight name -> float64 array (int64 for tid2eid))."""
    d = Dims(cfg)
    rng = np.random.default_rng(seed)
    tensors, values = {}, {}
    for name, storage, shape, kind in weight_list(d):
        x = init_value(kind, shape, rng, vocab=d.V, n_experts=d.E)
        base = name[:-len(".weight")] if name.endswith(".weight") else name
        if storage == "fp8":
            codes, sc = P.quant_fp8_block(x)
            tensors[name] = P.tensor_np("F8_E4M3", codes)
            tensors[base + ".scale"] = P.tensor_np("F8_E8M0", sc)
            values[name] = P.dequant_fp8_block(codes, sc)
        elif storage == "mxfp4":
            packed, sc = P.quant_mxfp4(x)
            tensors[name] = P.tensor_np("I8", packed)
            tensors[base + ".scale"] = P.tensor_np("F8_E8M0", sc)
            values[name] = P.dequant_mxfp4(packed, sc, shape[1])
        elif storage == "bf16":
            bits = P.bf16_bits(x)
            tensors[name] = P.tensor_np("BF16", bits)
            values[name] = P.bf16_from_bits(bits)
        elif storage == "f32":
            v = P.f32_round(x)
            tensors[name] = P.tensor_np("F32", v.astype(np.float32))
            values[name] = v
        elif storage == "i64":
            tensors[name] = P.tensor_np("I64", x)
            values[name] = x
        else:
            raise ValueError(storage)
    return tensors, values


def decode_checkpoint(tensors):
    """Independent reading of stored tensors -> weight name -> float64 value, by the layout's
    rules alone (E4M3 x E8M0 tiles, packed E2M1 x E8M0 blocks, BF16, F32, I64)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".scale"):  # E8M0 scales of the FP8 / MXFP4 weight beside them
            continue
        raw = P.as_array(t.dtype, t.shape, t.data)
        if t.dtype == "F8_E4M3":
            s = tensors[name[:-len(".weight")] + ".scale"]
            out[name] = P.dequant_fp8_block(raw, P.as_array(s.dtype, s.shape, s.data))
        elif t.dtype == "I8":
            s = tensors[name[:-len(".weight")] + ".scale"]
            out[name] = P.dequant_mxfp4(raw, P.as_array(s.dtype, s.shape, s.data), 2 * t.shape[1])
        else:
            out[name] = P.value_of(t.dtype, t.shape, t.data) if t.dtype != "I64" else raw.astype(np.int64)
    return out


_ATTN = {
    "wq_a.weight": "q_a_proj.weight", "q_norm.weight": "q_a_norm.weight", "wq_b.weight": "q_b_proj.weight",
    "wkv.weight": "kv_proj.weight", "kv_norm.weight": "kv_norm.weight", "wo_a.weight": "o_a_proj.weight",
    "wo_b.weight": "o_b_proj.weight", "attn_sink": "sinks",
}
_COMP = {"wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight", "ape": "position_bias",
         "norm.weight": "kv_norm.weight"}
_SHARED = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def native_to_hf(name):
    """native weight name -> (hf parameter name, expert index or None, part) where part is None,
    'gate' (rows [:I] of gate_up_proj), 'up' (rows [I:]) or 'down'; None for mtp.* ."""
    root = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
            "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
            "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
    if name in root:
        return root[name], None, None
    if name.startswith("mtp."):
        return None
    parts = name.split(".")
    if parts[0] != "layers":
        raise KeyError(name)
    p = "model.layers.%s." % parts[1]
    rest = ".".join(parts[2:])
    simple = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
    for s in ("attn", "ffn"):
        for f in ("fn", "base", "scale"):
            simple["hc_%s_%s" % (s, f)] = "%s_hc.%s" % (s, f)
    if rest in simple:
        return p + simple[rest], None, None
    if rest.startswith("attn.indexer.compressor."):
        return p + "self_attn.compressor.indexer." + _COMP[rest[len("attn.indexer.compressor."):]], None, None
    if rest == "attn.indexer.wq_b.weight":
        return p + "self_attn.compressor.indexer.q_b_proj.weight", None, None
    if rest == "attn.indexer.weights_proj.weight":
        return p + "self_attn.compressor.indexer.scorer.weights_proj.weight", None, None
    if rest.startswith("attn.compressor."):
        return p + "self_attn.compressor." + _COMP[rest[len("attn.compressor."):]], None, None
    if rest.startswith("attn."):
        return p + "self_attn." + _ATTN[rest[len("attn."):]], None, None
    if rest == "ffn.gate.weight":
        return p + "mlp.gate.weight", None, None
    if rest == "ffn.gate.bias":
        return p + "mlp.gate.e_score_correction_bias", None, None
    if rest == "ffn.gate.tid2eid":
        return p + "mlp.gate.tid2eid", None, None
    if rest.startswith("ffn.shared_experts."):
        w = rest.split(".")[2]
        return p + "mlp.shared_experts.%s.weight" % _SHARED[w], None, None
    if rest.startswith("ffn.experts."):
        e, w = int(rest.split(".")[2]), rest.split(".")[3]
        if w == "w2":
            return p + "mlp.experts.down_proj", e, "down"
        return p + "mlp.experts.gate_up_proj", e, "gate" if w == "w1" else "up"
    raise KeyError(name)


def write_sharded(dirname, tensors, n_shards, metadata=None):
    """Sorted names split into n contiguous groups of about equal bytes; -> index dict."""
    names = sorted(tensors)
    total = sum(len(tensors[n].data) for n in names)
    groups, cur, acc = [], [], 0
    for n in names:
        cur.append(n)
        acc += len(tensors[n].data)
        if len(groups) < n_shards - 1 and acc >= total * (len(groups) + 1) / n_shards:
            groups.append(cur)
            cur = []
    groups.append(cur)
    while len(groups) < n_shards:
        groups.append([])
    if any(not g for g in groups):
        raise ValueError("write_sharded: an empty shard")
    weight_map = {}
    for i, g in enumerate(groups):
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, n_shards)
        P.write_safetensors(os.path.join(dirname, fname), {n: tensors[n] for n in g}, metadata or {"format": "pt"})
        for n in g:
            weight_map[n] = fname
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(dirname, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return index


def read_sharded(dirname):
    """-> name -> v4pack.Tensor, read through the index (every indexed tensor must be in its shard,
    every shard tensor in the index)."""
    with open(os.path.join(dirname, "model.safetensors.index.json")) as f:
        index = json.load(f)
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        _, ts = P.read_safetensors(os.path.join(dirname, fname))
        for n, (dt, shape, raw) in ts.items():
            if index["weight_map"].get(n) != fname:
                raise ValueError("%s: tensor %s is not indexed to this shard" % (fname, n))
            out[n] = P.Tensor(dt, shape, raw)
    missing = set(index["weight_map"]) - set(out)
    if missing:
        raise ValueError("index names tensors no shard holds: %s" % sorted(missing)[:5])
    return out
