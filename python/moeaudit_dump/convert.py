"""Converters from SGLang's and vLLM-side tensor dumps (PyTorch pickles) to
the moeaudit dump format (safetensors, `layers.N.<field>`).

SGLang writes two kinds of dumps (read from its source, python/sglang/srt/debug_utils/):
  * `--debug-tensor-dump-output-folder DIR` (tensor_dump_forward_hook.py): per rank a folder
    TP{t}_PP{p}_Rank{r}_pid{pid}/ with one Pass{NNNNN}.pt per forward pass, a dict
    {module name: output} of every *leaf* module (plus the root's ForwardBatch ids).
    The MoE block itself is not a leaf, so its output is absent: moe_out is rebuilt as
    experts + shared_experts.down_proj (what the block adds on CUDA builds, where the
    factor lives in the fused kernels) and the file's metadata says so.
  * the dumper (dumper.py, DUMPER_ENABLE=1, DUMPER_NON_INTRUSIVE_MODE=all): one .pt per
    tensor named `step=S___rank=R___dump_index=I___name=NAME[___layer_id=L...].pt`, holding
    {"value": tensor, "meta": {...}}; module inputs/outputs are named
    `non_intrusive__<module>.inputs.0` / `.output[.i]`, and input_ids comes as `input_ids`.
vLLM has no per-module tensor dumper of its own (as of its DeepSeek models read for this
package); a dict {module name: output} saved by a forward hook (or attach() itself run in
the worker) is what from_module_outputs() reads, with vLLM's module names.
"""
import glob
import os
import re

import torch

from . import st

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.*)$")


def _torch_load(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except TypeError:  # torch < 1.13 has no weights_only
        return torch.load(path, map_location="cpu")


def _first_tensor(v):
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, (list, tuple)):
        for x in v:
            if isinstance(x, torch.Tensor):
                return x
    return None


def _tensor_list(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return []


def _flat(t, per_token_cols=True):
    return t.reshape(-1, t.shape[-1]) if per_token_cols else t.reshape(-1)


def _routing_fields(ts, E):
    """Classify a top-k output's tensors (SGLang TopKOutput order: weights, ids, logits)."""
    out = {}
    for t in ts:
        if not torch.is_floating_point(t):
            out.setdefault("topk_ids", _flat(t).to(torch.int64))
        elif E is not None and t.shape[-1] == E:
            out.setdefault("router_logits", _flat(t))
        else:
            out.setdefault("topk_weights", _flat(t))
    return out


def _moe_suffixes(engine):
    # (suffix of the module path after "layers.N.", field, how to read the value)
    return [
        ("mlp.gate", "router_logits", "first"),
        ("mlp.topk", "topk", "routing"),
        ("mlp.experts", "experts", "experts"),
        ("mlp.shared_experts.down_proj", "shared_out", "first"),
        ("mlp.shared_experts", "shared_out", "first"),
        ("post_attention_layernorm", "hidden", "first"),
        ("mlp", "moe_out", "first"),
    ]


def from_module_outputs(outputs, out_path, engine="sglang", n_experts=None, layers=None, input_ids=None,
                        metadata=None):
    """Convert {module name: output} (one forward pass) to a moeaudit dump.

    Module names follow the engines' DeepSeek models: model.layers.N.mlp (the block),
    .mlp.gate (logits; vLLM's ReplicatedLinear returns (logits, None)), .mlp.topk (SGLang
    TopKOutput), .mlp.experts (routed output; vLLM's SharedFusedMoE returns (shared,
    routed)), .mlp.shared_experts[.down_proj], .post_attention_layernorm (its first output is
    the block input). Without the block's own output, moe_out = routed_out + shared_out and
    the metadata says so. Returns out_path."""
    per = {}
    for name, v in outputs.items():
        m = _LAYER.search(name)
        if not m:
            continue
        layer, rest = int(m.group(1)), m.group(2)
        if layers is not None and layer not in layers:
            continue
        d = per.setdefault(layer, {})
        for suffix, field, how in _moe_suffixes(engine):
            if rest != suffix:
                continue
            if how == "routing":
                for k, t in _routing_fields(_tensor_list(v), n_experts).items():
                    d.setdefault(k, t)
            elif how == "experts":
                ts = _tensor_list(v)
                if len(ts) == 2:
                    d.setdefault("shared_out", _flat(ts[0]))
                    d.setdefault("routed_out", _flat(ts[1]))
                elif ts:
                    d.setdefault("routed_out", _flat(ts[0]))
            else:
                t = _first_tensor(v)
                if t is not None and (field != "router_logits" or torch.is_floating_point(t)):
                    d.setdefault(field, _flat(t))
            break
    res, notes = {}, []
    for layer in sorted(per):
        d = per[layer]
        if "hidden" not in d:
            continue
        if "moe_out" not in d:
            if "routed_out" not in d:
                continue
            d["moe_out"] = d["routed_out"] + d["shared_out"] if "shared_out" in d else d["routed_out"].clone()
            notes.append("layer %d: moe_out = routed_out%s (the block's output is not in the engine's dump)" % (
                layer, " + shared_out" if "shared_out" in d else ""))
        T = d["hidden"].shape[0]
        if input_ids is not None:
            ids = input_ids.reshape(-1).to(torch.int64)
            if ids.shape[0] == T:
                d["input_ids"] = ids
        for k, t in d.items():
            if t.shape[0] == T:
                res["layers.%d.%s" % (layer, k)] = t
    if not res:
        raise ValueError("no MoE layer found in the dump (expected module names like model.layers.N.mlp.experts "
                         "and model.layers.N.post_attention_layernorm)")
    meta = {"format": "moeaudit-dump-1", "engine": engine, "converted_from": "module outputs"}
    if notes:
        meta["notes"] = "; ".join(notes)
    meta.update(metadata or {})
    st.write(res, out_path, meta)
    return out_path


def _parse_tags(fname):
    base = os.path.basename(fname)
    if base.endswith(".pt"):
        base = base[:-3]
    tags = {}
    for part in base.split("___"):
        k, sep, v = part.partition("=")
        if sep:
            tags[k] = v
    return tags


def from_sglang(path, out_path, step=None, rank=0, n_experts=None, layers=None, metadata=None):
    """Convert an SGLang dump (either kind, see the module docstring) to a moeaudit dump.

    path   a Pass{N}.pt file, a TP*_PP*_Rank*_pid* folder (its first pass), a folder of
           dumper files, or the dumper's exp folder
    step   the dumper step / forward pass to take (default: the first that has MoE tensors)
    rank   which rank's tensors (dumper files carry rank=R)"""
    if os.path.isfile(path):
        d = _torch_load(path)
        ids = d.get("model.forward_batch_info.input_ids")
        return from_module_outputs(d, out_path, "sglang", n_experts, layers, ids,
                                   dict(metadata or {}, converted_from="sglang tensor_dump_forward_hook " + path))
    passes = sorted(glob.glob(os.path.join(path, "Pass*.pt")))
    if not passes:
        passes = sorted(glob.glob(os.path.join(path, "TP*_PP*_Rank%d_pid*" % rank, "Pass*.pt")))
    if passes:
        pick = passes[0] if step is None else next(p for p in passes if int(re.findall(r"\d+", os.path.basename(p))[0]) == step)
        return from_sglang(pick, out_path, None, rank, n_experts, layers, metadata)
    files = sorted(glob.glob(os.path.join(path, "*.pt")) + glob.glob(os.path.join(path, "*", "*.pt")))
    if not files:
        raise ValueError("%s: no SGLang dump files (Pass*.pt or dumper step=...___name=....pt)" % path)
    by_step = {}
    for f in files:
        tags = _parse_tags(f)
        if "name" not in tags or int(tags.get("rank", 0)) != rank:
            continue
        by_step.setdefault(int(tags.get("step", 0)), []).append((tags, f))
    for s in sorted(by_step):
        if step is not None and s != step:
            continue
        outputs, ids = {}, None
        for tags, f in by_step[s]:
            name = tags["name"]
            v = _torch_load(f)
            v = v["value"] if isinstance(v, dict) and "value" in v else v
            if name == "input_ids":
                ids = v
                continue
            if not name.startswith("non_intrusive__"):
                continue
            mod, _, sub = name[len("non_intrusive__"):].rpartition(".inputs.")
            if mod:
                if sub in ("0", "hidden_states"):
                    outputs[mod + "#in"] = v
                continue
            mod, _, sub = name[len("non_intrusive__"):].partition(".output")
            if sub in ("", ".0", ".1", ".2"):
                outputs.setdefault(mod, [None, None, None, None])
                outputs[mod][int(sub[1:]) if sub else 3] = v
        remap = {}
        for mod, v in outputs.items():
            if mod.endswith("#in"):
                m = mod[:-3]
                if m.endswith(".mlp"):
                    remap[m.rsplit(".mlp", 1)[0] + ".post_attention_layernorm"] = v
                continue
            vals = [x for x in (v[3], v[0], v[1], v[2]) if x is not None]
            remap[mod] = vals[0] if len(vals) == 1 else tuple(vals)
        if any(k.endswith(".mlp.experts") or k.endswith(".mlp") for k in remap):
            return from_module_outputs(remap, out_path, "sglang", n_experts, layers, ids,
                                       dict(metadata or {}, converted_from="sglang dumper %s step %d" % (path, s)))
    raise ValueError("%s: no step with MoE tensors (run with DUMPER_NON_INTRUSIVE_MODE=all)" % path)


def from_vllm(path, out_path, n_experts=None, layers=None, metadata=None):
    """Convert a torch.save'd {module name: output} of a vLLM DeepSeek model (the
    module names of vllm/model_executor/models/deepseek_v2.py) to a moeaudit dump."""
    d = _torch_load(path)
    if not isinstance(d, dict):
        raise ValueError("%s: expected a dict {module name: output}" % path)
    ids = d.get("input_ids")
    return from_module_outputs(d, out_path, "vllm", n_experts, layers, ids,
                               dict(metadata or {}, converted_from="vllm module outputs " + path))
