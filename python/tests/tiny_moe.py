"""A small torch model with transformers' DeepSeek MoE module and attribute
names and call signatures (DeepseekV4SparseMoeBlock with gate / experts /
shared_experts, DeepseekV4TopKRouter / DeepseekV4HashRouter returning
(logits, weights * s, ids); DeepseekV3MoE with route_tokens_to_experts), with
the weights of the bundled checkpoints tests/data/dsv4-tiny and dsv3-tiny.

It is the stand-in for transformers where only Debian's python3-torch is
installed (CI): the hooks of moeaudit_dump and the bugs of engine_bugs.py
act on it exactly as on transformers' modules. Its arithmetic is the
engine's (torch, in the model's dtype), not moeaudit's.
"""
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from moeaudit_dump import st


def sqrtsoftplus(x):
    return torch.sqrt(F.softplus(x))


class TopKRouter(nn.Module):          # transformers DeepseekV4TopKRouter
    def __init__(self, E, H, K, s, score_fn):
        super().__init__()
        self.top_k, self.num_experts, self.hidden_dim = K, E, H
        self.weight = nn.Parameter(torch.zeros(E, H))
        self.score_fn = score_fn
        self.routed_scaling_factor = s
        self.register_buffer("e_score_correction_bias", torch.zeros(E))

    def forward(self, hidden_states):
        flat = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(flat, self.weight)
        scores = self.score_fn(logits)
        idx = torch.topk(scores + self.e_score_correction_bias.to(scores.dtype), self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * self.routed_scaling_factor, idx


class HashRouter(nn.Module):          # transformers DeepseekV4HashRouter
    def __init__(self, E, H, K, s, score_fn, vocab):
        super().__init__()
        self.top_k, self.num_experts, self.hidden_dim = K, E, H
        self.weight = nn.Parameter(torch.zeros(E, H))
        self.score_fn = score_fn
        self.routed_scaling_factor = s
        self.register_buffer("tid2eid", torch.zeros(vocab, K, dtype=torch.long))

    def forward(self, hidden_states, input_ids):
        flat = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(flat, self.weight)
        scores = self.score_fn(logits)
        idx = self.tid2eid[input_ids.reshape(-1)].long()
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * self.routed_scaling_factor, idx


class Experts(nn.Module):             # transformers DeepseekV4Experts / DeepseekV3NaiveMoe
    def __init__(self, E, H, I, limit):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))
        self.limit = limit

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            pos, tok = torch.where((top_k_index == e).t())
            if tok.numel() == 0:
                continue
            gate, up = F.linear(hidden_states[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            if self.limit:
                gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
            cur = F.linear(F.silu(gate) * up, self.down_proj[e]) * top_k_weights[tok, pos, None]
            final.index_add_(0, tok, cur.to(final.dtype))
        return final


class MLP(nn.Module):                 # transformers DeepseekV4MLP / DeepseekV3MLP
    def __init__(self, H, I, limit):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.limit = limit

    def forward(self, x):
        g, u = self.gate_proj(x), self.up_proj(x)
        if self.limit:
            g, u = g.clamp(max=self.limit), u.clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(g) * u)


class SparseMoeBlock(nn.Module):      # transformers DeepseekV4SparseMoeBlock
    def __init__(self, cfg, is_hash):
        super().__init__()
        E, H, I, K = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
        s, lim = cfg["routed_scaling_factor"], cfg.get("swiglu_limit") or 0
        self.is_hash = is_hash
        self.gate = HashRouter(E, H, K, s, sqrtsoftplus, cfg["vocab_size"]) if is_hash else TopKRouter(E, H, K, s, sqrtsoftplus)
        self.experts = Experts(E, H, I, lim)
        self.shared_experts = MLP(H, I * cfg.get("n_shared_experts", 1), lim)

    def forward(self, hidden_states, input_ids=None):
        b, t, h = hidden_states.shape
        flat = hidden_states.view(-1, h)
        if self.is_hash:
            _, w, idx = self.gate(hidden_states, input_ids)
        else:
            _, w, idx = self.gate(hidden_states)
        return self.experts(flat, idx, w).view(b, t, h) + self.shared_experts(hidden_states)


class V3Router(nn.Module):            # transformers 5.17 DeepseekV3TopkRouter: fp32 logits, grouped top-k
    def __init__(self, cfg):
        super().__init__()
        E, H = cfg["n_routed_experts"], cfg["hidden_size"]
        self.top_k, self.num_experts, self.hidden_dim = cfg["num_experts_per_tok"], E, H
        self.weight = nn.Parameter(torch.zeros(E, H))
        self.routed_scaling_factor = cfg["routed_scaling_factor"]
        self.num_group, self.topk_group = cfg["n_group"], cfg["topk_group"]
        self.norm_topk_prob = cfg["norm_topk_prob"]
        self.register_buffer("e_score_correction_bias", torch.zeros(E))

    def forward(self, hidden_states):
        h = hidden_states.view(-1, self.hidden_dim)
        logits = F.linear(h.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        G, E = self.num_group, self.num_experts
        gs = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(gs).scatter_(1, torch.topk(gs, self.topk_group, dim=-1, sorted=False)[1], 1)
        mask = keep.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        idx = torch.topk(choice.masked_fill(~mask.bool(), float("-inf")), self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return logits, w * self.routed_scaling_factor, idx


class V3MoE(nn.Module):               # transformers 5.17 DeepseekV3MoE
    def __init__(self, cfg):
        super().__init__()
        E, H, I = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
        self.gate = V3Router(cfg)
        self.experts = Experts(E, H, I, 0)
        self.shared_experts = MLP(H, I * cfg["n_shared_experts"], 0)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        _, w, idx = self.gate(hidden_states)
        out = self.experts(hidden_states.view(-1, shape[-1]), idx, w).view(*shape)
        return out + self.shared_experts(hidden_states)


class Layer(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp


class Inner(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)


class TinyModel(nn.Module):
    """model.layers.N.mlp, as in transformers' DeepseekV{3,4}ForCausalLM. The
    residual stream is a fixed random embedding; each layer adds its MoE
    block's output of the RMS-normalised stream."""

    def __init__(self, cfg, layers, v4):
        super().__init__()
        self.v4 = v4
        self.model = Inner(layers)
        g = torch.Generator().manual_seed(1234)
        self.register_buffer("embed", torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=g))

    def forward(self, input_ids):
        h = self.embed[input_ids].to(next(self.parameters()).dtype)
        for lay in self.model.layers:
            if lay.mlp is None:
                continue
            x = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)
            h = h + (lay.mlp(x, input_ids=input_ids) if self.v4 else lay.mlp(x))
        return h


def _w(t, name, dtype):
    return t[name].to(dtype)


def load(ckpt_dir, dtype=torch.float32):
    """The bundled V4 or V3 checkpoint as a TinyModel in `dtype`."""
    cfg = json.load(open(os.path.join(ckpt_dir, "config.json")))
    t, _ = st.load(os.path.join(ckpt_dir, "model.safetensors"))
    v4 = cfg["model_type"] == "deepseek_v4"
    layers = []
    with torch.no_grad():
        for i in range(cfg["num_hidden_layers"]):
            if v4:
                p = "model.layers.%d.ffn." % i
                blk = SparseMoeBlock(cfg, cfg["mlp_layer_types"][i] == "hash_moe")
                names = ("w1", "w3", "w2")
                sh = p + "shared_experts."
            else:
                if i < cfg.get("first_k_dense_replace", 0):
                    layers.append(Layer(None))
                    continue
                p = "model.layers.%d.mlp." % i
                blk = V3MoE(cfg)
                names = ("gate_proj", "up_proj", "down_proj")
                sh = p + "shared_experts."
            blk.gate.weight.copy_(_w(t, p + "gate.weight", torch.float32))
            if blk.gate.__class__ is HashRouter:
                blk.gate.tid2eid.copy_(t[p + "gate.tid2eid"].long())
            else:
                bias_name = p + ("gate.bias" if v4 else "gate.e_score_correction_bias")
                blk.gate.e_score_correction_bias.copy_(t[bias_name].float())
            for e in range(cfg["n_routed_experts"]):
                g, u, d = (t["%sexperts.%d.%s.weight" % (p, e, n)].float() for n in names)
                blk.experts.gate_up_proj[e].copy_(torch.cat([g, u], 0))
                blk.experts.down_proj[e].copy_(d)
            blk.shared_experts.gate_proj.weight.copy_(t[sh + names[0] + ".weight"].float())
            blk.shared_experts.up_proj.weight.copy_(t[sh + names[1] + ".weight"].float())
            blk.shared_experts.down_proj.weight.copy_(t[sh + names[2] + ".weight"].float())
            layers.append(Layer(blk))
    m = TinyModel(cfg, layers, v4).to(dtype)
    for mod in m.modules():           # the bias stays fp32 as in the checkpoints' engines
        if isinstance(getattr(mod, "e_score_correction_bias", None), torch.Tensor):
            mod.e_score_correction_bias.data = mod.e_score_correction_bias.data.float()
    m.eval()
    return m, cfg


def token_ids(cfg, batch=2, seq=24, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg["vocab_size"], (batch, seq), generator=g)

