"""moeaudit_dump: record what a running engine's DeepSeek MoE blocks compute,
in the dump format `moeaudit diagnose` reads.

    import moeaudit_dump
    rec = moeaudit_dump.attach(model, "dump.safetensors", layers=[3])
    model(input_ids)          # one or more forward calls
    rec.save()                # writes layers.3.hidden, layers.3.moe_out, ...
    rec.detach()

then `moeaudit diagnose --model CHECKPOINT --all --dump dump.safetensors`.

Only PyTorch is needed (the `safetensors` package is used when present).
Modules are found by shape, not by import: any module with children `gate`
and `experts` is an MoE block (transformers' DeepseekV3MoE and
DeepseekV4SparseMoeBlock; SGLang's and vLLM's DeepseekV2MoE and their V4
blocks). What each engine exposes, and what to do about CUDA graphs,
tensor-parallel partial sums and padded tokens, is in docs/dumps.md.

Dump tensors, per layer N (prefix "layers.N."), tokens flattened over batch x sequence:
  hidden [T, H]        the block input (after the FFN RMSNorm), the engine's dtype
  moe_out [T, H]       the block output
  input_ids [T]        token ids (needed on hash-routed layers)
  router_logits [T, E] the gate's logits
  topk_ids [T, K]      the experts the engine ran (ids >= E: fused shared experts)
  topk_weights [T, K]  the weights it gave them
  routed_out [T, H]    the routed experts' output; shared_out [T, H] the shared expert's
"""
import re

import torch

from . import st

__all__ = ["attach", "Recorder", "find_moe_blocks", "merge_ranks", "FIELDS", "__version__"]
__version__ = "0.1.0"

FIELDS = ("hidden", "moe_out", "input_ids", "router_logits", "topk_ids", "topk_weights", "routed_out", "shared_out")

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_TORCH2 = int(torch.__version__.split(".")[0]) >= 2


def _engine_of(module):
    mod = type(module).__module__ or ""
    for name in ("sglang", "vllm", "transformers"):
        if mod.startswith(name + ".") or mod == name:
            return name
    return "torch"


def find_moe_blocks(model):
    """[(layer index, qualified name, module)] of every MoE block of `model`:
    a module with children named `gate` and `experts` under a `layers.N` path."""
    found = []
    for name, m in model.named_modules():
        kids = dict(m.named_children())
        if "gate" in kids and "experts" in kids:
            mt = _LAYER_RE.search(name)
            if mt:
                found.append((int(mt.group(1)), name, m))
    found.sort(key=lambda x: x[0])
    return found


def _n_experts(block):
    w = getattr(block.gate, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return int(w.shape[0])
    for attr in ("n_routed_experts", "num_experts", "num_local_experts"):
        v = getattr(block, attr, None) or getattr(block.experts, attr, None)
        if isinstance(v, int):
            return v
    return None


def _tensors_in(x):
    """Tensors inside an output: a tensor, a tuple/list, or an object with
    topk_ids / topk_weights / router_logits attributes (SGLang's TopKOutput)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)) and not hasattr(x, "topk_ids"):
        out = []
        for v in x:
            out += _tensors_in(v)
        return out
    return []


def _routing_from(x, E):
    """(logits, ids, weights), each a tensor or None, from a gate/top-k output or
    an experts call's arguments. Classified by dtype and width: integer -> ids,
    float of width E -> logits, other float 2-D -> weights."""
    logits = ids = weights = None
    if hasattr(x, "topk_ids"):
        return getattr(x, "router_logits", None), getattr(x, "topk_ids", None), getattr(x, "topk_weights", None)
    for t in _tensors_in(x):
        if t.dim() < 1:
            continue
        if not torch.is_floating_point(t):
            if t.dim() >= 2 and ids is None:
                ids = t
        elif E is not None and t.shape[-1] == E and logits is None:
            logits = t
        elif t.dim() >= 2 and weights is None and (E is None or t.shape[-1] != E):
            weights = t
    return logits, ids, weights


class _LayerRec:
    def __init__(self):
        self.calls = []      # one dict per forward call of the block
        self.cur = None


class Recorder:
    """Hooks on a model's MoE blocks; see attach(). Thread safety: none (one
    forward at a time, as engines run a model)."""

    def __init__(self, model, path, layers=None, fields=FIELDS, max_tokens=None, keep=None, metadata=None):
        self.model = model
        self.path = path
        self.fields = tuple(fields)
        unknown = set(self.fields) - set(FIELDS)
        if unknown:
            raise ValueError("unknown dump fields: %s (known: %s)" % (sorted(unknown), ", ".join(FIELDS)))
        self.max_tokens = max_tokens
        self.keep = keep
        self.metadata = dict(metadata or {})
        self.handles = []
        self.rec = {}
        self._ids = None     # input_ids of the model call in flight
        blocks = find_moe_blocks(model)
        if layers is not None:
            want = set(int(i) for i in layers)
            blocks = [b for b in blocks if b[0] in want]
            missing = want - set(b[0] for b in blocks)
            if missing:
                raise ValueError("no MoE block found for layers %s (MoE layers: %s)" % (
                    sorted(missing), [b[0] for b in find_moe_blocks(model)]))
        if not blocks:
            raise ValueError("no MoE block found: expected modules with children `gate` and `experts` under "
                             "`layers.N` (transformers DeepseekV3MoE / DeepseekV4SparseMoeBlock, SGLang or vLLM "
                             "DeepseekV2MoE)")
        self.blocks = blocks
        self.engine = _engine_of(blocks[0][2])
        self._hook_model()
        for layer, name, block in blocks:
            self.rec[layer] = _LayerRec()
            self._hook_block(layer, block)

    # ---------------------------------------------------------------- hooks
    def _hook_model(self):
        def pre(mod, args, kwargs=None):
            ids = (kwargs or {}).get("input_ids")
            if ids is None and args and isinstance(args[0], torch.Tensor) and not torch.is_floating_point(args[0]):
                ids = args[0]
            self._ids = ids.detach().reshape(-1) if isinstance(ids, torch.Tensor) else None
        if _TORCH2:
            self.handles.append(self.model.register_forward_pre_hook(pre, with_kwargs=True))
        else:
            self.handles.append(self.model.register_forward_pre_hook(lambda m, a: pre(m, a, None)))

    def _hook_block(self, layer, block):
        r = self.rec[layer]
        E = _n_experts(block)

        def put(key, t):
            # cloned now: engines modify outputs in place after the hook (vLLM's DeepseekV2MoE
            # multiplies the experts' output by s and adds the shared output into it)
            if key in self.fields and isinstance(t, torch.Tensor) and r.cur is not None and key not in r.cur:
                r.cur[key] = t.detach().clone()

        def block_pre(mod, args, kwargs=None):
            x = args[0] if args else (kwargs or {}).get("hidden_states")
            r.cur = {}
            if isinstance(x, torch.Tensor):
                r.cur["hidden"] = x.detach().reshape(-1, x.shape[-1]).clone()
            ids = (kwargs or {}).get("input_ids")
            if isinstance(ids, torch.Tensor):
                put("input_ids", ids.reshape(-1))

        def block_post(mod, args, out):
            if r.cur is None:
                return
            t = out if isinstance(out, torch.Tensor) else next(iter(_tensors_in(out)), None)
            if isinstance(t, torch.Tensor):
                r.cur["moe_out"] = t.detach().reshape(-1, t.shape[-1]).clone()
            if "input_ids" not in r.cur and self._ids is not None:
                put("input_ids", self._ids)
            self._finish_call(r)

        def gate_pre(mod, args):
            if len(args) >= 2 and isinstance(args[1], torch.Tensor) and not torch.is_floating_point(args[1]):
                put("input_ids", args[1].reshape(-1))     # transformers' V4 hash router: gate(hidden, input_ids)

        def gate_post(mod, args, out):
            lg, ids, w = _routing_from(out, E)
            put("router_logits", lg)
            put("topk_ids", ids)
            put("topk_weights", w)

        def topk_post(mod, args, out):                    # SGLang: TopK -> TopKOutput
            lg, ids, w = _routing_from(out, E)
            put("router_logits", lg)
            put("topk_ids", ids)
            put("topk_weights", w)

        def experts_pre(mod, args, kwargs=None):
            # transformers: experts(hidden, top_k_index, top_k_weights); SGLang: experts(hidden, topk_output)
            rest = list(args[1:]) + [v for k, v in (kwargs or {}).items() if k != "hidden_states"]
            lg, ids, w = _routing_from(rest[0] if len(rest) == 1 else rest, E)
            if ids is not None and r.cur is not None:
                r.cur["topk_ids"] = ids.detach().clone()   # what the runner actually used
                if w is not None:
                    r.cur["topk_weights"] = w.detach().clone()
            put("router_logits", lg)

        def experts_post(mod, args, out):
            ts = _tensors_in(out)
            if isinstance(out, (tuple, list)) and len(ts) == 2 and ts[0] is not None:
                put("shared_out", ts[0])                   # vLLM SharedFusedMoE: (shared, routed)
                put("routed_out", ts[1])
            elif ts:
                put("routed_out", ts[0])

        def shared_post(mod, args, out):
            t = out if isinstance(out, torch.Tensor) else next(iter(_tensors_in(out)), None)
            put("shared_out", t)

        h = self.handles
        if _TORCH2:
            h.append(block.register_forward_pre_hook(block_pre, with_kwargs=True))
            h.append(block.experts.register_forward_pre_hook(experts_pre, with_kwargs=True))
        else:
            h.append(block.register_forward_pre_hook(lambda m, a: block_pre(m, a, None)))
            h.append(block.experts.register_forward_pre_hook(lambda m, a: experts_pre(m, a, None)))
        h.append(block.register_forward_hook(block_post))
        h.append(block.gate.register_forward_pre_hook(gate_pre))
        h.append(block.gate.register_forward_hook(gate_post))
        h.append(block.experts.register_forward_hook(experts_post))
        if isinstance(getattr(block, "topk", None), torch.nn.Module):
            h.append(block.topk.register_forward_hook(topk_post))
        if isinstance(getattr(block, "shared_experts", None), torch.nn.Module):
            h.append(block.shared_experts.register_forward_hook(shared_post))

    def _finish_call(self, r):
        cur, r.cur = r.cur, None
        if "hidden" not in cur or "moe_out" not in cur:
            return
        T = cur["hidden"].shape[0]
        call = {}
        for k, v in cur.items():
            if k not in self.fields:
                continue
            v = v.reshape(T, -1) if k not in ("input_ids",) else v.reshape(-1)
            if v.shape[0] != T:
                continue      # not per token (e.g. input_ids of another batch shape): dropped, not guessed
            call[k] = v
        if self.keep is not None:
            mask = self.keep(call["hidden"])
            call = {k: v[mask] for k, v in call.items()}
        have = sum(c["hidden"].shape[0] for c in r.calls)
        if self.max_tokens is not None:
            room = self.max_tokens - have
            if room <= 0:
                return
            call = {k: v[:room] for k, v in call.items()}
        r.calls.append({k: v.to("cpu").clone() for k, v in call.items()})

    # ---------------------------------------------------------------- output
    def tensors(self):
        """{"layers.N.<field>": tensor} over every recorded call. A field is
        written for a layer only when every call produced it."""
        out = {}
        for layer, r in self.rec.items():
            if not r.calls:
                continue
            for k in self.fields:
                if all(k in c for c in r.calls):
                    v = torch.cat([c[k] for c in r.calls], 0)
                    if k in ("input_ids", "topk_ids"):
                        v = v.to(torch.int64)
                    out["layers.%d.%s" % (layer, k)] = v
        return out

    def save(self, path=None):
        """Write the dump (atomically) and return its path. Raises when no
        block ran: an empty dump is never written."""
        t = self.tensors()
        if not t:
            raise RuntimeError("moeaudit_dump: no MoE block ran while attached (with CUDA graphs, hooks do not fire "
                               "on replays: run eagerly; see docs/dumps.md)")
        meta = {"format": "moeaudit-dump-1", "engine": self.engine, "torch": torch.__version__,
                "layers": ",".join(str(b[0]) for b in self.blocks if self.rec[b[0]].calls),
                "model_class": type(self.model).__name__}
        meta.update(self.metadata)
        st.write(t, path or self.path, meta)
        return path or self.path

    def clear(self):
        for r in self.rec.values():
            r.calls, r.cur = [], None

    def detach(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            if exc[0] is None:
                self.save()
        finally:
            self.detach()
        return False


def attach(model, path, layers=None, fields=FIELDS, max_tokens=None, keep=None, metadata=None):
    """Register forward hooks on `model`'s MoE blocks and return a Recorder.

    model      a torch.nn.Module holding DeepSeek MoE blocks (transformers, SGLang, vLLM)
    path       where Recorder.save() writes the safetensors dump
    layers     layer indices to record (default: every MoE layer)
    fields     which tensors to keep (default: all of FIELDS)
    max_tokens stop recording a layer after this many tokens
    keep       callable(hidden [T, H]) -> bool mask [T]: tokens to keep (drop padding)
    metadata   extra string pairs for the file's __metadata__

    Used as a context manager, the dump is written on a clean exit."""
    return Recorder(model, path, layers, fields, max_tokens, keep, metadata)


def merge_ranks(paths, out, metadata=None):
    """Combine dumps written by the tensor-parallel ranks of one forward
    (attach on every rank, one file each): moe_out, routed_out and shared_out,
    partial sums on each rank before the all-reduce, are summed in float32 and
    cast back; every other tensor must agree across ranks and is taken from
    the first."""
    parts = [st.load(p)[0] for p in paths]
    res = {}
    for name, t in parts[0].items():
        field = name.rsplit(".", 1)[-1]
        if field in ("moe_out", "routed_out", "shared_out"):
            acc = sum(p[name].to(torch.float32) for p in parts)
            res[name] = acc.to(t.dtype)
        else:
            for p, path in zip(parts[1:], paths[1:]):
                if name not in p or p[name].shape != t.shape or not torch.equal(p[name], t):
                    raise ValueError("%s: %s differs from %s's; ranks of one forward must agree on it" % (
                        path, name, paths[0]))
            res[name] = t
    meta = {"format": "moeaudit-dump-1", "merged_ranks": str(len(paths))}
    meta.update(metadata or {})
    st.write(res, out, meta)
    return out
