# Float64 forward of a DeepSeek-V4 checkpoint with transformers 5.17, every
# intermediate the moeaudit forward streams, dumped to safetensors.
#
#   python3 make_oracle_fwd.py DIR OUT.safetensors [nocast]    (CHUNKS=37,1,1,1 adds a chunked run)
#
# It wrote tests/data/dsv4-tiny/oracle_fwd.safetensors on the H200 machine
# (torch 2.11.0+cu130, transformers 5.17.0, CPU, float64) as
#   CHUNKS=37,1,1,1 python3 make_oracle_fwd.py tests/data/dsv4-tiny oracle_fwd.safetensors nocast
# "nocast" replaces the modules that round to fp32 inside transformers'
# float64 forward (RMSNorm, unweighted RMSNorm, RoPE frequencies and rotation,
# mHC and the hc head, the indexer scorer, the compressor softmax) by the same
# formulas without the casts, and recomputes the RoPE inverse frequencies in
# float64. Nothing else is changed. See ORACLE_FWD.md.
import sys, os, torch
from transformers import DeepseekV4ForCausalLM
from safetensors.torch import save_file, load_file
d = sys.argv[1]; outp = sys.argv[2]
nocast = len(sys.argv) > 3 and sys.argv[3] == 'nocast'
import transformers.models.deepseek_v4.modeling_deepseek_v4 as M
if nocast:
    import torch.nn.functional as F
    def rms_fwd(self, x):
        v = x.pow(2).mean(-1, keepdim=True); return self.weight * (x * torch.rsqrt(v + self.variance_epsilon))
    M.DeepseekV4RMSNorm.forward = rms_fwd
    def urms_fwd(self, x):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
    M.DeepseekV4UnweightedRMSNorm.forward = urms_fwd
    def rot(x, cos, sin, unsqueeze_dim=1):
        cos = cos.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
        sin = sin.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
        rd = cos.shape[-1]
        nope, rope = x[..., :-rd], x[..., -rd:]
        return torch.cat([nope, rope * cos + M.rotate_half(rope) * sin], dim=-1)
    M.apply_rotary_pos_emb = rot
    def rotary_fwd(self, x, position_ids, layer_type=None):
        inv = getattr(self, f"{layer_type}_inv_freq").to(torch.float64)
        sc = getattr(self, f"{layer_type}_attention_scaling")
        freqs = (inv[None, :, None].expand(position_ids.shape[0], -1, 1) @ position_ids[:, None, :].to(torch.float64)).transpose(1, 2)
        return freqs.cos() * sc, freqs.sin() * sc
    M.DeepseekV4RotaryEmbedding.forward = rotary_fwd
    def scorer_fwd(self, q, ckv, h):
        s = torch.matmul(q, ckv.transpose(-1, -2).unsqueeze(1))
        s = F.relu(s) * self.softmax_scale
        w = self.weights_proj(h) * self.weights_scaling
        return (s * w.unsqueeze(-1)).sum(dim=2)
    M.DeepseekV4IndexerScorer.forward = scorer_fwd
    orig_softmax = torch.Tensor.softmax
    def sm(self, dim=None, dtype=None, **kw):
        return orig_softmax(self, dim)
    torch.Tensor.softmax = sm
    def hc_fwd(self, hs):
        hc = self.hc_mult
        flat = self.input_norm(hs.flatten(start_dim=2))
        pre_w, post_w, comb_w = F.linear(flat, self.fn).split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        s0, s1, s2 = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * s0 + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s1 + post_b)
        cl = comb_w.view(*comb_w.shape[:-1], hc, hc) * s2 + comb_b.view(hc, hc)
        comb = orig_softmax(cl, -1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * hs).sum(dim=2)
        return post, comb, collapsed
    M.DeepseekV4HyperConnection.forward = hc_fwd
    def hh_fwd(self, x):
        flat = self.input_norm(x.flatten(2))
        mixes = F.linear(flat, self.hc_fn)
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * x).sum(dim=2)
    M.DeepseekV4HyperHead.forward = hh_fwd
m = DeepseekV4ForCausalLM.from_pretrained(d)
m = m.to(torch.float64)
if nocast:
    # recompute inv_freq in float64 for every rotary module
    for mod in m.modules():
        if isinstance(mod, M.DeepseekV4RotaryEmbedding):
            for lt in mod.layer_types:
                p = mod.config.rope_parameters[lt]
                base = p['rope_theta']; dim = int(mod.config.head_dim * p.get('partial_rotary_factor', 1.0))
                inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
                assert p['rope_type'] == 'default', p
                setattr(mod, f"{lt}_inv_freq", inv)
try:
    m.set_experts_implementation("eager")
except Exception as e:
    print("experts impl:", e)
m.eval()
io = load_file(os.path.join(d, 'oracle_io.safetensors'))
ids = io['input_ids'][None]
out = {}
handles = []
def reg(mod, name, kind):
    def f(module, args, kwargs, res):
        x = args[0] if args else kwargs.get('hidden_states')
        if kind in ('layer', 'attn', 'mlp'):
            out[name + '.in'] = x[0].detach().clone()
            r = res[0] if isinstance(res, tuple) else res
            out[name + '.out'] = r[0].detach().clone()
        elif kind == 'idx':
            out[name] = res[0].detach().clone().to(torch.int32)
    handles.append(mod.register_forward_hook(f, with_kwargs=True))
for i, L in enumerate(m.model.layers):
    reg(L, f'layers.{i}', 'layer')
    reg(L.self_attn, f'layers.{i}.attn', 'attn')
    reg(L.mlp, f'layers.{i}.ffn', 'mlp')
    c = L.self_attn.compressor
    if c is not None and hasattr(c, 'indexer'):
        reg(c.indexer, f'layers.{i}.index_topk', 'idx')
        def sc_hook(module, args, kwargs, res, name=f'layers.{i}.index_scores'):
            out[name] = res[0].detach().clone()
        handles.append(c.indexer.scorer.register_forward_hook(sc_hook, with_kwargs=True))
with torch.no_grad():
    r = m(input_ids=ids, use_cache=False)
out['logits'] = r.logits[0].detach().clone()
for h in handles: h.remove()
chunks = [int(x) for x in os.environ.get('CHUNKS', '').split(',') if x]
if chunks:
    from transformers import DynamicCache
    pkv = DynamicCache(config=m.config); at = 0; parts = []
    with torch.no_grad():
        for n in chunks:
            rr = m(input_ids=ids[:, at:at + n], past_key_values=pkv, use_cache=True)
            pkv = rr.past_key_values; parts.append(rr.logits[0]); at += n
    out['chunked.logits'] = torch.cat(parts, 0).detach().clone()
    out['chunked.sizes'] = torch.tensor(chunks, dtype=torch.int64)
    print('chunked vs one shot', ((out['chunked.logits'] - out['logits']).abs().max() / out['logits'].abs().max()).item())
out['input_ids'] = ids[0].clone()
if 'model.logits' in io:
    print('vs fixture logits', ((out['logits'] - io['model.logits']).abs().max() / io['model.logits'].abs().max()).item())
save_file({k: v.contiguous() for k, v in out.items()}, outp)
print(sorted(out.keys()))
