#!/usr/bin/env python3
"""The float64 oracle of the whole DeepSeek-V4 forward: transformers' own modules with their
float32 casts turned into float64, on tiny random checkpoints in two layouts.

Runs on the CPU of the GPU machine (transformers 5.17, PyTorch 2.11; numpy, safetensors and
ml_dtypes as that image has them). Writes, under --out:
  dsv4-attn/           transformers' layout as save_pretrained writes it (BF16) + oracle.safetensors
  dsv4-flash-layout/   the V4-Flash release layout (native names and config schema, FP8 E4M3 +
                       E8M0 128x128 tiles, MXFP4 experts, 3 shards + index) + oracle.safetensors
  dsv4-tiny/oracle_nocast.safetensors   logits of the existing fixture without the casts
  summary.json         every self-check's number
See tests/oracle/README.md for what is checked and how the casts are removed.

Usage: python3 make_v4_oracle.py --out DIR [--fixture tests/data/dsv4-tiny] [--dump-src DIR]
Every stage runs inside try/except: a failure is printed with its traceback and the rest goes on;
the exit status is 1 if any stage failed.
"""

import argparse
import collections
import difflib
import inspect
import json
import math
import os
import re
import shutil
import sys
import tempfile
import textwrap
import time
import traceback

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import v4layout as L  # noqa: E402
import v4pack as P  # noqa: E402

import transformers  # noqa: E402
import transformers.activations as A  # noqa: E402
import transformers.modeling_rope_utils as R  # noqa: E402
import transformers.models.deepseek_v4.modeling_deepseek_v4 as M  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

SUMMARY = collections.OrderedDict()
FAILED = []


def log(*a):
    print(*a, flush=True)


def stage(name):
    """Decorator: run the stage now, log its time, keep going on failure."""
    def run(fn):
        t0 = time.time()
        log("\n==== %s" % name)
        try:
            r = fn()
            log("==== %s: ok (%.1f s)" % (name, time.time() - t0))
            return r
        except Exception:
            FAILED.append(name)
            log("==== %s: FAILED (%.1f s)\n%s" % (name, time.time() - t0, traceback.format_exc()))
            return None
    return run


def rel(a, b):
    """max |a - b| / max |b| over finite entries (0 when both are 0)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    fin = np.isfinite(b)
    if not np.array_equal(np.isfinite(a), fin):
        return math.inf
    d = np.abs(a[fin] - b[fin]).max(initial=0.0)
    s = np.abs(b[fin]).max(initial=0.0)
    return float(d / s) if s > 0 else float(d)


# ============================================================================ the cast removal
#
# Every function and method defined in transformers' deepseek_v4 modeling module, in
# modeling_rope_utils and in the activation classes the config names is read with
# inspect.getsource; in its code (comments left alone) `.float()` becomes `.to(_ORACLE_DTYPE)`,
# `torch.float32` and `torch.float` become `_ORACLE_DTYPE`; the functions that changed are
# compiled again in their module's namespace (inside a factory that provides the `__class__`
# cell, so zero-argument super() still works) and installed in place of the originals.
# With _ORACLE_DTYPE = torch.float32 the rewritten code is the original code; with float64 every
# former float32 cast is a float64 one. Nothing of transformers is copied into this repository:
# the rewrite happens in memory at run time.

_SUBS = [
    (re.compile(r"\.float\(\)"), ".to(_ORACLE_DTYPE)"),
    (re.compile(r"torch\.float32\b"), "_ORACLE_DTYPE"),
    (re.compile(r"torch\.float(?![0-9A-Za-z_])"), "_ORACLE_DTYPE"),
]
_MODULES = [M, R, A]


def _sub_code(src):
    """Apply _SUBS to the code part of each line (text after a '#' is left alone)."""
    out, n = [], 0
    for line in src.splitlines(keepends=True):
        code, hash_, comment = line.partition("#")
        for pat, rep in _SUBS:
            code, k = pat.subn(rep, code)
            n += k
        out.append(code + hash_ + comment)
    return "".join(out), n


class CastPatch:
    """The rewrite of every function that has a cast; install(dtype) compiles the rewritten code
    again each time (so that default arguments see the dtype too) and puts it in place."""

    def __init__(self, act_classes):
        self.items = []  # (owner, attr, original, owner class or None, qualname, n, new source, diff)
        targets = []
        for mod in (M, R):
            for name, obj in list(vars(mod).items()):
                if inspect.isfunction(obj) and obj.__module__ == mod.__name__:
                    targets.append((mod, name, obj, None, mod.__name__ + "." + name))
                elif inspect.isclass(obj) and obj.__module__ == mod.__name__:
                    for an, av in list(vars(obj).items()):
                        fn = av.__func__ if isinstance(av, (staticmethod, classmethod)) else av
                        if inspect.isfunction(fn):
                            targets.append((obj, an, av, obj, obj.__qualname__ + "." + an))
        for cls in act_classes:
            for an, av in list(vars(cls).items()):
                if inspect.isfunction(av):
                    targets.append((cls, an, av, cls, cls.__qualname__ + "." + an))
        for owner, attr, orig, cls, qn in targets:
            fn = orig.__func__ if isinstance(orig, (staticmethod, classmethod)) else orig
            try:
                src = textwrap.dedent(inspect.getsource(fn))
            except (OSError, TypeError):
                continue
            new, n = _sub_code(src)
            if n == 0:
                continue
            diff = "".join(difflib.unified_diff(src.splitlines(True), new.splitlines(True), qn, qn + " (rewritten)", n=0))
            self.items.append((owner, attr, orig, cls, qn, n, new, diff))
        self.installed = []
        self.rope_saved = dict(R.ROPE_INIT_FUNCTIONS)

    def describe(self):
        for owner, attr, orig, cls, qn, n, new, diff in self.items:
            log("-- rewrite %s: %d substitution(s)\n%s" % (qn, n, diff))

    @staticmethod
    def set_dtype(dt):
        for mod in _MODULES:
            mod.__dict__["_ORACLE_DTYPE"] = dt

    def install(self, dt):
        self.set_dtype(dt)
        for owner, attr, orig, cls, qn, n, new, diff in self.items:
            fn = orig.__func__ if isinstance(orig, (staticmethod, classmethod)) else orig
            fname = inspect.unwrap(fn).__name__
            factory = "def __oracle_factory(__class__):\n" + textwrap.indent(new, "    ") + \
                      "\n    return %s\n" % fname
            ns = {}
            exec(compile(factory, "<oracle rewrite of %s>" % qn, "exec"), sys.modules[fn.__module__].__dict__, ns)
            rewritten = ns["__oracle_factory"](cls)
            setattr(owner, attr, rewritten)
            for k, f in self.rope_saved.items():
                if owner is R and f is orig:
                    R.ROPE_INIT_FUNCTIONS[k] = rewritten

    def uninstall(self):
        for owner, attr, orig, cls, qn, n, new, diff in self.items:
            setattr(owner, attr, orig)
        R.ROPE_INIT_FUNCTIONS.clear()
        R.ROPE_INIT_FUNCTIONS.update(self.rope_saved)
        self.set_dtype(torch.float32)


def recompute_rope(model, dtype):
    """Recompute every rotary module's inverse frequencies with the current (rewritten) init
    functions, so the tables themselves are float64 and not float32 values upcast."""
    worst = 0.0
    for mod in model.modules():
        if isinstance(mod, M.DeepseekV4RotaryEmbedding):
            for lt in mod.layer_types:
                fn = mod.compute_default_rope_parameters
                if mod.rope_type[lt] != "default":
                    fn = R.ROPE_INIT_FUNCTIONS[mod.rope_type[lt]]
                inv, scaling = fn(mod.config, None, layer_type=lt)
                old = getattr(mod, "%s_inv_freq" % lt)
                worst = max(worst, rel(inv.double().numpy(), old.double().numpy()))
                setattr(mod, "%s_inv_freq" % lt, inv.to(dtype))
                setattr(mod, "%s_original_inv_freq" % lt, inv.clone().to(dtype))
                setattr(mod, "%s_attention_scaling" % lt, scaling)
    return worst


class DtypeAudit(TorchDispatchMode):
    """Sees every aten op of the forward; counts its floating outputs by dtype and keeps the
    first few that are not float64, with the Python stack that made them."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.bad = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.counts[str(t.dtype)] += 1
                if t.dtype != torch.float64 and len(self.bad) < 6:
                    st = [f for f in traceback.extract_stack()[:-1] if "make_v4_oracle" not in f.filename
                          and "torch/" not in f.filename][-4:]
                    self.bad.append("%s -> %s%s at %s" % (func, t.dtype, tuple(t.shape),
                                    " <- ".join("%s:%d %s" % (os.path.basename(f.filename), f.lineno, f.name)
                                                for f in reversed(st))))
        return out


# ============================================================================ capture

class Capture:
    """Forward hooks on every decoder layer, its attention, its MoE block, its router, and on
    CSA layers the indexer and its scorer. Each call appends; `cat` joins calls along T."""

    def __init__(self, model):
        self.rec = collections.defaultdict(list)
        self.hooks = []
        self.positions = []
        for i, layer in enumerate(model.model.layers):
            self._hook(layer, "layers.%d" % i, streams=True)
            self._hook(layer.self_attn, "layers.%d.attn" % i)
            self._hook(layer.mlp, "layers.%d.ffn" % i)
            self.hooks.append(layer.mlp.gate.register_forward_hook(self._gate(i)))
            comp = layer.self_attn.compressor
            if comp is not None and hasattr(comp, "indexer"):
                self.hooks.append(comp.indexer.register_forward_hook(self._put("layers.%d.index_raw" % i)))
                self.hooks.append(comp.indexer.scorer.register_forward_hook(self._put("layers.%d.score_raw" % i)))

    def _hook(self, mod, name, streams=False):
        def pre(m, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self.rec[name + ".in"].append(x.detach().clone())
            if streams and name == "layers.0":
                self.positions.append(kwargs.get("position_ids"))

        def post(m, args, kwargs, out):
            y = out[0] if isinstance(out, tuple) else out
            self.rec[name + ".out"].append(y.detach().clone())
        self.hooks.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        self.hooks.append(mod.register_forward_hook(post, with_kwargs=True))

    def _put(self, name):
        def post(m, args, out):
            self.rec[name].append(out.detach().clone())
        return post

    def _gate(self, i):
        def post(m, args, out):
            logits, weights, idx = out
            self.rec["layers.%d.gate_logits" % i].append(logits.detach().clone())
            self.rec["layers.%d.gate_weights" % i].append(weights.detach().clone())
            self.rec["layers.%d.gate_ids" % i].append(idx.detach().clone())
            if hasattr(m, "e_score_correction_bias"):
                s = m.score_fn(logits) + m.e_score_correction_bias
                self.rec["layers.%d.gate_choice" % i].append(s.detach().clone())
        return post

    def remove(self):
        for h in self.hooks:
            h.remove()


def pad_topk(x, k):
    """[B, S, k'] int -> [S, k] with -1 padding (k' <= k)."""
    x = x[0]
    if x.shape[-1] < k:
        x = torch.cat([x, torch.full((x.shape[0], k - x.shape[-1]), -1, dtype=x.dtype)], -1)
    return x


def sort_rows(idx):
    """Rows ascending, -1 last."""
    a = idx.copy()
    big = np.iinfo(np.int64).max
    a = np.where(a < 0, big, a)
    a.sort(axis=1)
    return np.where(a == big, -1, a)


def run_model(model, ids, chunks=None):
    """ids [1, T]; chunks None = one shot without a cache; else prefill + decode through
    transformers' DynamicCache (past_key_values carried between calls). -> logits [T, V]."""
    with torch.no_grad():
        if chunks is None:
            return model(input_ids=ids, use_cache=False).logits[0]
        pkv, outs, s = None, [], 0
        for c in chunks:
            out = model(input_ids=ids[:, s:s + c], past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            outs.append(out.logits[0])
            s += c
        assert s == ids.shape[1]
        return torch.cat(outs, 0)


def oracle_tensors(model, ids, cfg, chunkings, audit=True):
    """The float64 forward with every capture; -> (dict name -> numpy array, stats dict)."""
    T = ids.shape[1]
    cap = Capture(model)
    aud = DtypeAudit()
    try:
        if audit:
            with aud:
                logits = run_model(model, ids)
        else:
            logits = run_model(model, ids)
    finally:
        cap.remove()
    out = collections.OrderedDict()
    st = collections.OrderedDict()
    out["input_ids"] = ids[0].numpy().astype(np.int64)
    out["logits"] = logits.numpy()
    st["dtype_counts"] = dict(aud.counts)
    st["non_f64_ops"] = aud.bad
    pos = cap.positions[0]
    st["positions_are_arange"] = bool(pos is None or torch.equal(pos[0].cpu(), torch.arange(T)))
    k_idx = cfg.index_topk
    rates = cfg.compress_rates
    min_index_gap, min_router_gap = math.inf, math.inf
    distinct_sets, rows_choosing, discarded, not_topk = 0, 0, [], 0
    expert_sets = {}
    for i, lt in enumerate(cfg.layer_types):
        p = "layers.%d" % i
        out[p + ".in"] = cap.rec[p + ".in"][0][0].numpy()
        out[p + ".out"] = cap.rec[p + ".out"][0][0].numpy()
        for b in ("attn", "ffn"):
            out["%s.%s.in" % (p, b)] = cap.rec["%s.%s.in" % (p, b)][0][0].numpy()
            out["%s.%s.out" % (p, b)] = cap.rec["%s.%s.out" % (p, b)][0][0].numpy()
        ids_g = cap.rec[p + ".gate_ids"][0].numpy()
        w_g = cap.rec[p + ".gate_weights"][0].numpy()
        order = np.argsort(ids_g, axis=1, kind="stable")
        out[p + ".ffn.topk_ids"] = np.take_along_axis(ids_g, order, 1).astype(np.int32)
        out[p + ".ffn.topk_weights"] = np.take_along_axis(w_g, order, 1)
        expert_sets[p] = len({tuple(r) for r in out[p + ".ffn.topk_ids"].tolist()})
        if cap.rec.get(p + ".gate_choice"):
            s = np.sort(cap.rec[p + ".gate_choice"][0].numpy(), axis=1)[:, ::-1]
            kk = ids_g.shape[1]
            min_router_gap = min(min_router_gap, float((s[:, kk - 1] - s[:, kk]).min()))
        if lt == "compressed_sparse_attention":
            r = rates["compressed_sparse_attention"]
            raw = pad_topk(cap.rec[p + ".index_raw"][0], k_idx).numpy()
            out[p + ".index_topk"] = sort_rows(raw).astype(np.int32)
            sc = cap.rec[p + ".score_raw"][0][0].numpy().copy()  # [T, n_entries]
            vis = (np.arange(T) + 1) // r
            mask = np.arange(sc.shape[1])[None, :] >= vis[:, None]
            sc[mask] = -np.inf
            out[p + ".index_scores"] = sc
            sets = set()
            for t in range(T):
                if vis[t] > k_idx:
                    row = np.sort(sc[t, :vis[t]])[::-1]
                    min_index_gap = min(min_index_gap, float(row[k_idx - 1] - row[k_idx]))
                    rows_choosing += 1
                    sets.add(tuple(out[p + ".index_topk"][t]))
                    discarded.append(int(vis[t] - k_idx))
                # the kept set must be exactly the k best visible entries (lower index first on ties)
                want = np.argsort(-sc[t, :vis[t]], kind="stable")[:k_idx]
                got = out[p + ".index_topk"][t]
                if sorted(want.tolist()) != sorted(int(g) for g in got if g >= 0):
                    not_topk += 1
            distinct_sets += len(sets)
    st["min_index_gap"] = min_index_gap
    st["min_router_gap"] = min_router_gap
    st["index_rows_with_a_choice"] = rows_choosing
    st["index_rows_not_the_topk_of_their_scores"] = not_topk
    st["index_distinct_sets"] = distinct_sets
    st["index_discarded_per_query"] = [min(discarded), max(discarded)] if discarded else [0, 0]
    st["expert_distinct_sets"] = expert_sets
    rope = model.model.rotary_emb
    for lt in rope.layer_types:
        out["rope.%s.inv_freq" % lt] = getattr(rope, "%s_inv_freq" % lt).double().numpy()
    # chunked runs through the cache
    for cname, chunks in chunkings:
        cap = Capture(model)
        try:
            lg = run_model(model, ids, chunks)
        except Exception:
            st[cname + "_error"] = traceback.format_exc()
            log("  chunked run %s %s failed:\n%s" % (cname, chunks, st[cname + "_error"]))
            continue
        finally:
            cap.remove()
        out[cname + ".logits"] = lg.numpy()
        out[cname + ".chunks"] = np.array(chunks, dtype=np.int64)
        st[cname + "_vs_oneshot_logits"] = rel(lg.numpy(), out["logits"])
        for i, lt in enumerate(cfg.layer_types):
            p = "layers.%d" % i
            o = torch.cat([x[0] for x in cap.rec[p + ".out"]], 0).numpy()
            st["%s_vs_oneshot_%s.out" % (cname, p)] = rel(o, out[p + ".out"])
            if lt == "compressed_sparse_attention":
                raw = torch.cat([pad_topk(x, k_idx) for x in cap.rec[p + ".index_raw"]], 0).numpy()
                ch = sort_rows(raw).astype(np.int32)
                out["%s.%s.index_topk" % (cname, p)] = ch
                st["%s_%s_index_rows_differing" % (cname, p)] = int((ch != out[p + ".index_topk"]).any(1).sum())
        st[cname + "_positions_are_arange"] = bool(all(
            q is None for q in cap.positions) or torch.equal(
            torch.cat([q[0].cpu() for q in cap.positions]), torch.arange(T)))
    return out, st


def save_oracle(path, arrays, meta):
    t = {}
    for k, v in arrays.items():
        v = np.ascontiguousarray(v)
        dt = {np.dtype(np.float64): "F64", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32"}[v.dtype]
        t[k] = P.tensor_np(dt, v)
    return P.write_safetensors(path, t, meta)


# ============================================================================ models


def hf_kind(name):
    if name.endswith("norm.weight"):
        return "norm"
    if "embed_tokens" in name:
        return "embed"
    if name.endswith("sinks"):
        return "sink"
    if name.endswith("position_bias"):
        return "ape"
    if name.endswith(("_hc.fn", "hc_head.hc_fn")):
        return "hc_fn"
    if name.endswith(("_hc.base", "hc_head.hc_base")):
        return "hc_base"
    if name.endswith(("_hc.scale", "hc_head.hc_scale")):
        return "hc_scale"
    if name.endswith("e_score_correction_bias"):
        return "bias"
    if name.endswith("tid2eid"):
        return "tid2eid"
    return "linear"


def randomize_hf(model, seed, n_experts):
    """Set every parameter and persistent buffer by role (v4layout.init_value), rounded to bf16
    (so that the BF16 checkpoint save_pretrained writes holds exactly these values)."""
    rng = np.random.default_rng(seed)
    sd = model.state_dict()
    vals = {}
    with torch.no_grad():
        for name in sorted(sd):
            t = sd[name]
            kind = hf_kind(name)
            x = L.init_value(kind, list(t.shape), rng, n_experts=n_experts)
            if kind != "tid2eid":
                x = P.bf16_round(x)
            vals[name] = x
            t.copy_(torch.from_numpy(np.asarray(x)).to(t.dtype))
    return vals


def load_hf(d, dt64, patch, experts_impl_log):
    """from_pretrained in float32, then .to(float64) when dt64, experts eager."""
    model, info = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    model.eval()
    before = getattr(model.config, "_experts_implementation", None)
    model.set_experts_implementation("eager")
    experts_impl_log.append((before, getattr(model.config, "_experts_implementation", None)))
    if dt64:
        model = model.to(torch.float64)
    return model, info


def check_params_dtype(model, dt):
    bad = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
           if t.is_floating_point() and t.dtype != dt]
    return bad


DS1_T = 163
DS1_CHUNKS = [("chunked", [DS1_T - 3, 1, 1, 1]), ("chunked_mid", [97, 1, 1, 50, DS1_T - 149])]


def ds1_config():
    return DeepseekV4Config(
        vocab_size=128, hidden_size=32, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=24,
        partial_rotary_factor=0.25, o_groups=2, o_lora_rank=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5, norm_topk_prob=True, swiglu_limit=2.0,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.25,
                         "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32.0,
                         "beta_slow": 1.0, "attention_factor": 1.0}},
        max_position_embeddings=1048576, sliding_window=12, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        index_n_heads=8, index_head_dim=16, index_topk=6, rms_norm_eps=1e-6, tie_word_embeddings=False,
        num_nextn_predict_layers=0,
    )


DS2_T = 67
DS2_CHUNKS = [("chunked", [DS2_T - 3, 1, 1, 1]), ("chunked_mid", [21, 1, 1, 26, DS2_T - 49])]
DS2_NATIVE = collections.OrderedDict([
    ("architectures", ["DeepseekV4ForCausalLM"]), ("attention_bias", False), ("attention_dropout", 0.0),
    ("bos_token_id", 0), ("eos_token_id", 1), ("expert_dtype", "fp4"),
    ("hc_eps", 1e-06), ("hc_mult", 4), ("hc_sinkhorn_iters", 20),
    ("head_dim", 128), ("hidden_act", "silu"), ("hidden_size", 128),
    ("index_head_dim", 128), ("index_n_heads", 4), ("index_topk", 4),
    ("initializer_range", 0.02), ("max_position_embeddings", 1048576),
    ("model_type", "deepseek_v4"), ("moe_intermediate_size", 192),
    ("n_routed_experts", 8), ("n_shared_experts", 1), ("norm_topk_prob", True),
    ("num_attention_heads", 2), ("num_experts_per_tok", 2), ("num_hidden_layers", 3),
    ("num_hash_layers", 1), ("num_key_value_heads", 1), ("num_nextn_predict_layers", 1),
    ("o_groups", 2), ("o_lora_rank", 128), ("q_lora_rank", 256), ("qk_rope_head_dim", 64),
    ("quantization_config", collections.OrderedDict([
        ("activation_scheme", "dynamic"), ("fmt", "e4m3"), ("quant_method", "fp8"),
        ("scale_fmt", "ue8m0"), ("weight_block_size", [128, 128])])),
    ("rms_norm_eps", 1e-06),
    ("rope_scaling", collections.OrderedDict([
        ("beta_fast", 32), ("beta_slow", 1), ("factor", 16),
        ("original_max_position_embeddings", 65536), ("type", "yarn")])),
    ("rope_theta", 10000), ("routed_scaling_factor", 1.5), ("scoring_func", "sqrtsoftplus"),
    ("sliding_window", 8), ("swiglu_limit", 2.0), ("tie_word_embeddings", False),
    ("topk_method", "noaux_tc"), ("torch_dtype", "bfloat16"), ("use_cache", True),
    ("vocab_size", 128), ("compress_rope_theta", 160000),
    ("compress_ratios", [0, 4, 16, 0]),
])


def ds2_hf_config(n):
    """transformers' config for the native one: compress_ratios -> layer_types + compress_rates,
    num_hash_layers -> mlp_layer_types, rope_scaling -> the `compress` rope parameters."""
    L_ = n["num_hidden_layers"]
    ratios = n["compress_ratios"][:L_]
    hca = sorted({r for r in ratios if r not in (0, 4)})
    assert len(hca) <= 1
    lt = ["sliding_attention" if r == 0 else "compressed_sparse_attention" if r == 4 else
          "heavily_compressed_attention" for r in ratios]
    prf = n["qk_rope_head_dim"] / n["head_dim"]
    rs = n["rope_scaling"]
    return DeepseekV4Config(
        vocab_size=n["vocab_size"], hidden_size=n["hidden_size"], moe_intermediate_size=n["moe_intermediate_size"],
        num_hidden_layers=L_, num_attention_heads=n["num_attention_heads"], num_key_value_heads=1,
        head_dim=n["head_dim"], q_lora_rank=n["q_lora_rank"], partial_rotary_factor=prf,
        o_groups=n["o_groups"], o_lora_rank=n["o_lora_rank"], n_routed_experts=n["n_routed_experts"],
        num_experts_per_tok=n["num_experts_per_tok"], n_shared_experts=n["n_shared_experts"],
        scoring_func=n["scoring_func"], routed_scaling_factor=n["routed_scaling_factor"],
        norm_topk_prob=n["norm_topk_prob"], swiglu_limit=n["swiglu_limit"], layer_types=lt,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca[0] if hca else 128},
        mlp_layer_types=["hash_moe" if i < n["num_hash_layers"] else "moe" for i in range(L_)],
        rope_theta=float(n["rope_theta"]), compress_rope_theta=float(n["compress_rope_theta"]),
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": float(n["rope_theta"]), "partial_rotary_factor": prf},
            "compress": {"rope_type": "yarn", "rope_theta": float(n["compress_rope_theta"]),
                         "partial_rotary_factor": prf, "factor": float(rs["factor"]),
                         "original_max_position_embeddings": rs["original_max_position_embeddings"],
                         "beta_fast": float(rs["beta_fast"]), "beta_slow": float(rs["beta_slow"]),
                         "attention_factor": 1.0}},
        max_position_embeddings=n["max_position_embeddings"], sliding_window=n["sliding_window"],
        hc_mult=n["hc_mult"], hc_sinkhorn_iters=n["hc_sinkhorn_iters"], hc_eps=n["hc_eps"],
        index_n_heads=n["index_n_heads"], index_head_dim=n["index_head_dim"], index_topk=n["index_topk"],
        rms_norm_eps=n["rms_norm_eps"], tie_word_embeddings=False,
        num_nextn_predict_layers=n["num_nextn_predict_layers"],
    )


def hf_state_from_native(values, cfg):
    """native weight values -> transformers state dict (float64 tensors; experts stacked)."""
    sd = {}
    I_ = cfg.moe_intermediate_size
    stacks = {}
    for name, v in values.items():
        m = L.native_to_hf(name)
        if m is None:
            continue
        hf, e, part = m
        if e is None:
            sd[hf] = torch.from_numpy(np.ascontiguousarray(v))
            continue
        stacks.setdefault(hf, {})[(e, part)] = v
    for hf, parts in stacks.items():
        E = 1 + max(e for e, _ in parts)
        if hf.endswith("gate_up_proj"):
            x = np.stack([np.concatenate([parts[(e, "gate")], parts[(e, "up")]], 0) for e in range(E)])
            assert x.shape[1] == 2 * I_
        else:
            x = np.stack([parts[(e, "down")] for e in range(E)])
        sd[hf] = torch.from_numpy(np.ascontiguousarray(x))
    return sd


def margins_ok(st, name):
    ok = st["min_index_gap"] > 1e-7 and st["min_router_gap"] > 1e-7 and st["index_distinct_sets"] > 4
    log("  %s: min index gap %.3g, min router gap %.3g, distinct index sets %d over %d rows, expert sets %s -> %s"
        % (name, st["min_index_gap"], st["min_router_gap"], st["index_distinct_sets"],
           st["index_rows_with_a_choice"], st["expert_distinct_sets"], "ok" if ok else "rejected"))
    return ok


# ============================================================================ main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fixture", default=os.path.join(HERE, "..", "data", "dsv4-tiny"))
    ap.add_argument("--dump-src", default=None, help="copy transformers' V4 sources here (to read, not to commit)")
    ap.add_argument("--seed", type=int, default=1000)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    SUMMARY["versions"] = {"transformers": transformers.__version__, "torch": torch.__version__,
                           "numpy": np.__version__, "python": sys.version.split()[0]}
    log("versions:", SUMMARY["versions"])

    @stage("environment: what this script relies on in transformers")
    def _():
        if args.dump_src:
            os.makedirs(args.dump_src, exist_ok=True)
            for mod in (M, R, sys.modules[DeepseekV4Config.__module__], A):
                shutil.copy(mod.__file__, args.dump_src)
            import transformers.cache_utils as C
            shutil.copy(C.__file__, args.dump_src)
        log("DeepseekV4Config fields:", sorted(k for k in DeepseekV4Config.__dataclass_fields__)
            if hasattr(DeepseekV4Config, "__dataclass_fields__") else inspect.signature(DeepseekV4Config))
        log("modeling classes:", [n for n, o in vars(M).items() if inspect.isclass(o) and o.__module__ == M.__name__])
        log("module functions:", [n for n, o in vars(M).items() if inspect.isfunction(o) and o.__module__ == M.__name__])
        log("yarn init source:\n" + inspect.getsource(R.ROPE_INIT_FUNCTIONS["yarn"]))
        log("ACT2FN sqrtsoftplus:", A.ACT2FN["sqrtsoftplus"], "silu:", A.ACT2FN["silu"])

    act_classes = [type(A.ACT2FN["sqrtsoftplus"]), type(A.ACT2FN["silu"])]
    patch = CastPatch(act_classes)
    patch.describe()
    SUMMARY["rewritten_functions"] = [(it[4], it[5]) for it in patch.items]
    log("-- rope init functions that get rewritten: %s" % sorted(
        k for k, f in R.ROPE_INIT_FUNCTIONS.items() if any(it[0] is R and it[2] is f for it in patch.items)))
    elog = []

    # ------------------------------------------------------------------ dataset 1
    ds1 = {}

    @stage("dataset 1 (transformers layout): seed search, save_pretrained, reload, float64 oracle")
    def _():
        cfg = ds1_config()
        log("config.layer_types", cfg.layer_types, "compress_rates", cfg.compress_rates,
            "mlp_layer_types", cfg.mlp_layer_types, "rope_parameters", cfg.rope_parameters)
        rng = np.random.default_rng(args.seed)
        ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, DS1_T)).long()[None]
        for seed in range(args.seed, args.seed + 25):
            torch.manual_seed(seed)
            m0 = DeepseekV4ForCausalLM(cfg).eval()
            vals = randomize_hf(m0, seed, cfg.n_routed_experts)
            d = tempfile.mkdtemp(prefix="dsv4-attn-")
            m0.to(torch.bfloat16).save_pretrained(d)
            patch.install(torch.float64)
            try:
                model, info = load_hf(d, True, patch, elog)
                recompute_rope(model, torch.float64)
                out, st = oracle_tensors(model, ids, model.config, [], audit=False)
            finally:
                patch.uninstall()
            if margins_ok(st, "seed %d" % seed) and st["index_rows_not_the_topk_of_their_scores"] == 0:
                break
        ds1.update(dir=d, seed=seed, vals=vals, ids=ids, info=info)
        log("loading info:", {k: (v if len(v) < 20 else list(v)[:20]) for k, v in info.items()})
        with open(os.path.join(d, "model.safetensors"), "rb"):
            pass
        _, saved = P.read_safetensors(os.path.join(d, "model.safetensors"))
        ds1["saved_names"] = sorted(saved)
        log("save_pretrained wrote %d tensors; dtypes %s" % (len(saved), collections.Counter(v[0] for v in saved.values())))
        # transformers' saved names against the native names (+ 'model.' prefix on layer tensors)
        native = set()
        d_ = L.Dims({"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
                     "vocab_size": cfg.vocab_size, "num_attention_heads": cfg.num_attention_heads,
                     "head_dim": cfg.head_dim, "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups,
                     "o_lora_rank": cfg.o_lora_rank, "index_n_heads": cfg.index_n_heads,
                     "index_head_dim": cfg.index_head_dim, "moe_intermediate_size": cfg.moe_intermediate_size,
                     "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
                     "n_shared_experts": cfg.n_shared_experts, "hc_mult": cfg.hc_mult,
                     "compress_ratios": [0 if t == "sliding_attention" else cfg.compress_rates[t]
                                         for t in cfg.layer_types],
                     "num_hash_layers": sum(t == "hash_moe" for t in cfg.mlp_layer_types),
                     "num_nextn_predict_layers": 0})
        for name, storage, shape, kind in L.weight_list(d_):
            native.add(name)
        only_saved = sorted(set(saved) - native)
        only_native = sorted(native - set(saved))
        log("saved names not in the native list (%d): %s" % (len(only_saved), only_saved[:40]))
        log("native names not saved (%d): %s" % (len(only_native), only_native[:40]))
        SUMMARY["ds1_saved_vs_native"] = {"only_saved": only_saved[:60], "only_native": only_native[:60]}

    def full_oracle(tag, d_or_model, cfg, ids, chunkings, vals=None):
        """u32 / u64 (casts kept), p32 (rewritten, float32), p64 (the oracle) + comparisons."""
        res = collections.OrderedDict()

        def get(dt64):
            if isinstance(d_or_model, str):
                return load_hf(d_or_model, dt64, patch, elog)[0]
            m = d_or_model(dt64)
            return m
        model = get(False)
        if vals is not None:
            sd = model.state_dict()
            worst = 0.0
            for k, v in vals.items():
                worst = max(worst, float(np.abs(sd[k].double().numpy() - np.asarray(v, np.float64)).max()))
            res["reload_max_abs_diff"] = worst
            log("  %s: reloaded parameters differ from the values set by at most %g" % (tag, worst))
            if worst != 0.0:
                raise AssertionError("%s: from_pretrained does not give back the saved values" % tag)
        res["experts_impl"] = elog[-1] if elog else None
        res["attn_impl"] = getattr(model.config, "_attn_implementation", None)
        lu32 = run_model(model, ids).numpy()
        m64 = get(True)
        res["u64_param_dtypes_not_f64"] = check_params_dtype(m64, torch.float64)[:10]
        cu = Capture(m64)
        lu64 = run_model(m64, ids).numpy()
        u64_streams = {k: v[0][0].numpy() for k, v in cu.rec.items() if k.endswith(".out") and k.count(".") == 2}
        u64_idx = {k: v[0].numpy() for k, v in cu.rec.items() if k.endswith("index_raw")}
        cu.remove()
        patch.install(torch.float32)
        try:
            lp32 = run_model(get(False), ids).numpy()
        finally:
            patch.uninstall()
        patch.install(torch.float64)
        try:
            m = get(True)
            recompute_rope(m, torch.float64)
            res["rope_f64_tables_vs_transformers_tables"] = {
                lt: rel(getattr(m.model.rotary_emb, "%s_inv_freq" % lt).numpy(),
                        getattr(m64.model.rotary_emb, "%s_inv_freq" % lt).double().numpy())
                for lt in m.model.rotary_emb.layer_types}
            res["p64_param_dtypes_not_f64"] = check_params_dtype(m, torch.float64)[:10]
            out, st = oracle_tensors(m, ids, m.config, chunkings)
        finally:
            patch.uninstall()
        res["patched_f32_vs_original_f32_logits"] = rel(lp32, lu32)
        res["original_f32_vs_oracle_logits"] = rel(lu32, out["logits"])
        res["casts_kept_f64_vs_oracle_logits"] = rel(lu64, out["logits"])
        res["casts_kept_f64_vs_oracle_streams"] = {k: rel(v, out[k]) for k, v in u64_streams.items()}
        res["casts_kept_index_rows_differing"] = {
            k: int((sort_rows(pad_topk(torch.from_numpy(v), m.config.index_topk).numpy()) !=
                    out[k.replace("index_raw", "index_topk")]).any(1).sum()) for k, v in u64_idx.items()}
        res.update(st)
        for k, v in res.items():
            log("  %s: %s = %s" % (tag, k, v))
        if st["non_f64_ops"]:
            raise AssertionError("%s: the float64 forward still made non-float64 tensors: %s" % (tag, st["non_f64_ops"]))
        return out, res

    @stage("dataset 1: oracle, checks, files")
    def _():
        cfg = ds1_config()
        out, res = full_oracle("ds1", ds1["dir"], cfg, ds1["ids"], DS1_CHUNKS, vals=ds1["vals"])
        SUMMARY["ds1"] = res
        dst = os.path.join(args.out, "dsv4-attn")
        os.makedirs(dst, exist_ok=True)
        for f in os.listdir(ds1["dir"]):
            shutil.copy(os.path.join(ds1["dir"], f), dst)
        meta = oracle_meta(res, ds1["seed"], "dsv4-attn")
        save_oracle(os.path.join(dst, "oracle.safetensors"), out, meta)
        verify_written(os.path.join(dst, "oracle.safetensors"), out)

    # ------------------------------------------------------------------ dataset 2
    ds2 = {}

    @stage("dataset 2: does transformers read the native config schema?")
    def _():
        for ratios in (DS2_NATIVE["compress_ratios"], [0, 4, 128, 0]):
            n = dict(DS2_NATIVE, compress_ratios=ratios)
            try:
                c = DeepseekV4Config(**n)
                log("  compress_ratios %s -> layer_types %s, compress_rates %s, mlp_layer_types %s, rope_parameters %s,"
                    " qk_rope_head_dim %s" % (ratios, c.layer_types, c.compress_rates, c.mlp_layer_types,
                                              c.rope_parameters, getattr(c, "qk_rope_head_dim", None)))
                SUMMARY.setdefault("native_schema", []).append([ratios, "loads", c.layer_types, c.rope_parameters])
            except Exception as e:
                log("  compress_ratios %s -> %s: %s" % (ratios, type(e).__name__, e))
                SUMMARY.setdefault("native_schema", []).append([ratios, "%s: %s" % (type(e).__name__, e)])

    @stage("dataset 2 (V4-Flash layout): encoders against ml_dtypes / torch, seed search")
    def _():
        checks = collections.OrderedDict()
        rng = np.random.default_rng(7)
        x = np.concatenate([rng.uniform(-448, 448, 20000), rng.standard_normal(20000) * 0.01,
                            np.ldexp(rng.uniform(-1, 1, 2000), -9)])
        try:
            import ml_dtypes
            checks["e4m3_vs_ml_dtypes"] = int((P.encode_e4m3(x) != np.asarray(x, dtype=ml_dtypes.float8_e4m3fn)
                                               .view(np.uint8)).sum())
            y = np.concatenate([rng.uniform(-6, 6, 20000), [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0]])
            mine = P.encode_e2m1(y)
            theirs = np.asarray(y, dtype=ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
            checks["e2m1_vs_ml_dtypes"] = int((mine != theirs).sum())
        except ImportError as e:
            checks["ml_dtypes"] = "absent: %s" % e
        codes = np.arange(256, dtype=np.uint8)
        td = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).to(torch.float64).numpy()
        checks["e4m3_decode_vs_torch"] = int((~((td == P.decode_e4m3(codes)) | (np.isnan(td) & np.isnan(P.decode_e4m3(codes))))).sum())
        te = torch.from_numpy(codes.copy()).view(torch.float8_e8m0fnu).to(torch.float64).numpy()
        checks["e8m0_decode_vs_torch"] = int((~((te == P.decode_e8m0(codes)) | (np.isnan(te) & np.isnan(P.decode_e8m0(codes))))).sum())
        # float32-representable inputs: torch rounds float64 -> bfloat16 through float32
        z = (rng.standard_normal(50000) * 10.0 ** rng.integers(-20, 20, 50000)).astype(np.float32).astype(np.float64)
        tb = torch.from_numpy(z).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        checks["bf16_vs_torch"] = int((tb != P.bf16_bits(z)).sum())
        for k, v in checks.items():
            log("  %s: %s" % (k, v))
        SUMMARY["encoder_checks"] = checks
        bad = [k for k, v in checks.items() if isinstance(v, int) and v]
        if bad:
            raise AssertionError("encoder mismatches: %s" % bad)

    @stage("dataset 2: seed search on the float64 oracle")
    def _():
        cfg = ds2_hf_config(DS2_NATIVE)
        log("config.layer_types", cfg.layer_types, "compress_rates", cfg.compress_rates,
            "mlp_layer_types", cfg.mlp_layer_types, "rope_parameters", cfg.rope_parameters)
        rng = np.random.default_rng(args.seed + 1)
        ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, DS2_T)).long()[None]
        for seed in range(args.seed, args.seed + 25):
            tensors, values = L.flash_tensors(DS2_NATIVE, seed)
            sd = hf_state_from_native(values, cfg)

            def make(dt64, sd=sd):
                torch.manual_seed(0)
                m = DeepseekV4ForCausalLM(cfg).eval()
                missing, unexpected = m.load_state_dict(
                    {k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}, strict=False)
                if missing or unexpected:
                    raise AssertionError("state dict: missing %s unexpected %s" % (missing[:10], unexpected[:10]))
                m.set_experts_implementation("eager")
                return m.to(torch.float64) if dt64 else m
            patch.install(torch.float64)
            try:
                m = make(True)
                recompute_rope(m, torch.float64)
                out, st = oracle_tensors(m, ids, cfg, [], audit=False)
            finally:
                patch.uninstall()
            if margins_ok(st, "seed %d" % seed) and st["index_rows_not_the_topk_of_their_scores"] == 0:
                break
        # exactness: every value is a bf16 number (so a BF16 engine holds the checkpoint exactly)
        nonbf16 = [k for k, v in values.items() if v.dtype == np.float64 and not np.array_equal(P.bf16_round(v), v)
                   and not k.endswith(("hc_attn_fn", "hc_ffn_fn", "hc_head_fn", "hc_attn_base", "hc_ffn_base",
                                        "hc_head_base", "hc_attn_scale", "hc_ffn_scale", "hc_head_scale", "ape",
                                        "attn_sink", "gate.bias"))]
        log("  non-F32 weights whose values are not bf16 numbers: %s" % nonbf16[:10])
        ds2.update(seed=seed, tensors=tensors, values=values, sd=sd, make=make, ids=ids, cfg=cfg)

    @stage("dataset 2: oracle, checks, files (shards read back by the safetensors package)")
    def _():
        cfg = ds2["cfg"]
        out, res = full_oracle("ds2", ds2["make"], cfg, ds2["ids"], DS2_CHUNKS)
        SUMMARY["ds2"] = res
        dst = os.path.join(args.out, "dsv4-flash-layout")
        os.makedirs(dst, exist_ok=True)
        L.write_sharded(dst, ds2["tensors"], 3)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(DS2_NATIVE, f, indent=2)
            f.write("\n")
        meta = oracle_meta(res, ds2["seed"], "dsv4-flash-layout")
        save_oracle(os.path.join(dst, "oracle.safetensors"), out, meta)
        verify_written(os.path.join(dst, "oracle.safetensors"), out)
        # the shards through the safetensors package (an independent parser), decoded by torch
        from safetensors import safe_open
        with open(os.path.join(dst, "model.safetensors.index.json")) as f:
            wm = json.load(f)["weight_map"]
        n_ok, worst = 0, 0.0
        dec = {}
        for shard in sorted(set(wm.values())):
            with safe_open(os.path.join(dst, shard), framework="pt") as g:
                for k in g.keys():
                    t = g.get_tensor(k)
                    mine = ds2["tensors"][k]
                    if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16):
                        raw = t.view(torch.uint8 if t.dtype != torch.bfloat16 else torch.int16).numpy().tobytes()
                    else:
                        raw = t.numpy().tobytes()
                    assert raw == mine.data, k
                    dec[k] = t
                    n_ok += 1
        for k in ds2["values"]:
            t = dec[k]
            base = k[:-len(".weight")] if k.endswith(".weight") else k
            if t.dtype == torch.float8_e4m3fn:
                s = dec[base + ".scale"].to(torch.float64)
                s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:t.shape[0], :t.shape[1]]
                v = t.to(torch.float64) * s
            elif t.dtype == torch.int8:
                u = t.view(torch.uint8)
                lut = torch.tensor(P.E2M1_TABLE)
                v = torch.stack([lut[(u & 15).long()], lut[(u >> 4).long()]], -1).flatten(-2)
                v = v * dec[base + ".scale"].to(torch.float64).repeat_interleave(32, 1)
            else:
                v = t.to(torch.float64) if t.is_floating_point() else t
            worst = max(worst, float((v.double() - torch.from_numpy(np.asarray(ds2["values"][k], np.float64))).abs().max()))
        log("  %d tensors read back byte-identical by safetensors; torch's FP8/E8M0 decode vs the values: %g" % (n_ok, worst))
        res["shards_read_back"] = n_ok
        res["torch_decode_vs_values_max_abs"] = worst
        if worst != 0.0:
            raise AssertionError("torch decodes the shards to other values (max abs diff %g)" % worst)

    # ------------------------------------------------------------------ the fixture without casts
    @stage("dsv4-tiny (existing fixture): logits with and without the casts")
    def _():
        _, oio = P.read_safetensors(os.path.join(args.fixture, "oracle_io.safetensors"))
        ids = torch.from_numpy(P.as_array(*oio["input_ids"]).astype(np.int64).copy())[None]
        ref = P.as_array(*oio["model.logits"])
        model, info = load_hf(args.fixture, True, patch, elog)
        log("  loading info:", {k: list(v)[:20] for k, v in info.items()})
        lu64 = run_model(model, ids).numpy()
        cfg = model.config
        out, res = full_oracle("dsv4-tiny", args.fixture, cfg, ids, [])
        res["fixture_model_logits_vs_casts_kept_f64"] = rel(lu64, ref)
        res["fixture_model_logits_vs_oracle"] = rel(out["logits"], ref)
        log("  fixture model.logits vs casts-kept float64 here: %g; vs the cast-free oracle: %g"
            % (res["fixture_model_logits_vs_casts_kept_f64"], res["fixture_model_logits_vs_oracle"]))
        SUMMARY["dsv4-tiny"] = res
        keep = {k: v for k, v in out.items() if k in ("input_ids", "logits") or k.endswith(("index_topk", "index_scores"))}
        dst = os.path.join(args.out, "dsv4-tiny")
        os.makedirs(dst, exist_ok=True)
        save_oracle(os.path.join(dst, "oracle_nocast.safetensors"), keep, oracle_meta(res, None, "dsv4-tiny"))
        verify_written(os.path.join(dst, "oracle_nocast.safetensors"), keep)

    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)
    log("\nFAILED stages: %s" % FAILED if FAILED else "\nall stages ok")
    return 1 if FAILED else 0


def oracle_meta(res, seed, name):
    return {
        "dataset": name,
        "made_by": "tests/oracle/make_v4_oracle.py (transformers %s, torch %s, CPU float64)" %
                   (transformers.__version__, torch.__version__),
        "casts": "transformers' float32 casts (norms, RoPE and its tables, mHC, indexer scorer, compressor softmax) "
                 "rewritten to float64",
        "seed": str(seed),
        "index_topk_rows": "sorted ascending, -1 (not visible) last",
        "index_scores": "indexer scores [T, n_entries]; -inf where entry j is not visible to query t (j >= (t+1)//ratio)",
        "ffn_topk": "expert ids ascending per row; weights in the same order, routed_scaling_factor included",
        "chunked": "logits of prefill+decode through transformers' DynamicCache; <name>.chunks = the chunk lengths",
        "checks": json.dumps({k: v for k, v in res.items() if isinstance(v, (int, float, str))}, default=str)[:4000],
    }


def verify_written(path, arrays):
    """Read the file back with the safetensors package (numpy) and compare."""
    from safetensors.numpy import load_file
    back = load_file(path)
    assert set(back) == set(arrays), path
    for k, v in arrays.items():
        if not np.array_equal(back[k], v):
            raise AssertionError("%s: %s differs after reading back" % (path, k))


if __name__ == "__main__":
    sys.exit(main())
