"""Write the real-engine dumps of tests/data/engine-dumps/ (run on the GPU
machine, where transformers is installed):

    python3 python/tests/make_engine_dumps.py OUTDIR            # transformers, CUDA when present
    python3 python/tests/make_engine_dumps.py OUTDIR --tiny     # tiny_moe.py instead (no transformers)

For each bundled checkpoint (tests/data/dsv4-tiny, dsv3-tiny) loaded with
transformers' from_pretrained, in bfloat16 and float32, and for each contract
bug of engine_bugs.py injected into the running model (none, scale applied
twice, never, to the shared expert, not renormalized, weights from biased
scores, a wrong score function, a hash table off by one), one forward of the
same 48 tokens (2 x 24) with moeaudit_dump attached to every MoE layer writes
OUTDIR/dumps/<model>-<dtype>-<bug>.safetensors. Every case runs inside
try/except; a summary (what each bug changed in moe_out, per layer) is
printed and written to OUTDIR/summary.json; the dumps are also packed into
OUTDIR/engine-dumps.tar.
"""
import json
import os
import sys
import tarfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.join(REPO, "python"), HERE]

import torch  # noqa: E402

import engine_bugs  # noqa: E402
import moeaudit_dump as md  # noqa: E402


def load_transformers(ckpt, dtype, device):
    import transformers
    from transformers import AutoModelForCausalLM
    kw = dict(attn_implementation="eager")
    try:
        m = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, **kw)
    except TypeError:
        m = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=dtype, **kw)
    m = m.to(device).eval()
    return m, m.config.to_dict(), "transformers " + transformers.__version__


def load_tiny(ckpt, dtype, device):
    import tiny_moe
    m, cfg = tiny_moe.load(ckpt, dtype)
    return m.to(device), cfg, "tiny_moe (torch %s)" % torch.__version__


def run_blocks(found, hidden, ids, dtype):
    """Call each MoE block directly on its recorded input (hidden[layer] [T, H])."""
    import inspect
    B, S = ids.shape
    for layer, _, blk in found:
        h = hidden[layer].to(ids.device, dtype).view(B, S, -1)
        if "input_ids" in inspect.signature(blk.forward).parameters:
            blk(h, input_ids=ids)
        else:
            blk(h)


def main():
    out = sys.argv[1]
    tiny = "--tiny" in sys.argv
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(os.path.join(out, "dumps"), exist_ok=True)
    print("torch", torch.__version__, "device", dev, torch.cuda.get_device_name(0) if dev == "cuda" else "")
    loader = load_tiny if tiny else load_transformers
    summary = []
    t0 = time.time()
    inputs = {}
    for model_name in ("dsv4-tiny", "dsv3-tiny"):
        ckpt = os.path.join(REPO, "tests", "data", model_name)
        for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            try:
                model, cfg, engine = loader(ckpt, dtype, dev)
            except Exception:
                traceback.print_exc()
                summary.append({"model": model_name, "dtype": dname, "error": traceback.format_exc()[-800:]})
                continue
            found = md.find_moe_blocks(model)
            blocks = [b for _, _, b in found]
            if dname == "fp32":
                print("== %s: %s; MoE blocks %s" % (model_name, engine, [(i, n, type(b).__name__) for i, n, b in found]))
                print("   gate %s, experts %s, shared %s" % (type(blocks[0].gate).__name__, type(blocks[0].experts).__name__,
                                                         type(getattr(blocks[0], "shared_experts", None)).__name__))
                impl = getattr(getattr(model, "config", None), "_experts_implementation", None)
                print("   experts implementation:", impl)
                try:   # the engine's own MoE code, for the record (docs/dumps.md names these modules)
                    import inspect
                    for obj in (type(blocks[0]), type(blocks[0].gate), type(blocks[0].experts)):
                        print("   --- %s.%s" % (obj.__module__, obj.__qualname__))
                        src = inspect.getsource(obj)
                        print("\n".join("   | " + ln for ln in src.splitlines()[:80]))
                except Exception as e:
                    print("   (source not available: %s)" % e)
            g = torch.Generator().manual_seed(7)
            ids = torch.randint(0, cfg["vocab_size"], (2, 24), generator=g).to(dev)
            base = None
            blockwise = None
            for bug in engine_bugs.BUGS:
                if bug == "hash_off_by_one" and not any(hasattr(b.gate, "tid2eid") for b in blocks):
                    continue
                path = os.path.join(out, "dumps", "%s-%s-%s.safetensors" % (model_name, dname, bug))
                row = {"model": model_name, "dtype": dname, "bug": bug, "file": os.path.basename(path)}
                undo = rec = None
                try:
                    undo = engine_bugs.inject(blocks, bug)
                    rec = md.attach(model, path, metadata={"engine_detail": engine, "bug": bug, "dtype": dname,
                                                          "checkpoint": "tests/data/" + model_name, "device": dev})
                    with torch.no_grad():
                        if blockwise is not None:
                            run_blocks(found, blockwise, ids, dtype)
                        else:
                            try:
                                model(ids) if tiny else model(input_ids=ids, use_cache=False)
                            except RuntimeError:
                                if bug != "none" or model_name not in inputs:
                                    raise
                                # transformers 5.17's DeepseekV4 whole-model forward fails in bf16 (its
                                # attention gets float32 streams); the MoE blocks then run alone, on the
                                # float32 run's block inputs rounded to this dtype.
                                traceback.print_exc(limit=1)
                                print("  -> running the MoE blocks alone, on the float32 model's block inputs")
                                blockwise = inputs[model_name]
                                rec.clear()
                                run_blocks(found, blockwise, ids, dtype)
                                row["blockwise"] = True
                    rec.save()
                    t, _ = md.st.load(path)
                    layers = sorted(set(int(k.split(".")[1]) for k in t))
                    row["layers"] = {}
                    for L in layers:
                        mo = t["layers.%d.moe_out" % L].double()
                        info = {"fields": sorted(k.split(".", 2)[2] for k in t if k.startswith("layers.%d." % L)),
                                "T": int(mo.shape[0])}
                        if "layers.%d.routed_out" % L in t and "layers.%d.shared_out" % L in t:
                            rs = t["layers.%d.routed_out" % L].double() + t["layers.%d.shared_out" % L].double()
                            info["moe_minus_parts"] = float((mo - rs).abs().max() / mo.abs().max())
                        if base is not None and ("layers.%d.moe_out" % L) in base:
                            b0 = base["layers.%d.moe_out" % L].double()
                            info["change_vs_none"] = float((mo - b0).norm() / b0.norm())
                        row["layers"][L] = info
                    if bug == "none":
                        base = t
                        if dname == "fp32":
                            inputs[model_name] = {L: t["layers.%d.hidden" % L] for L in layers}
                    row["blockwise"] = blockwise is not None
                    print("  %-10s %-5s %-17s ok  %s" % (model_name, dname, bug, " ".join(
                        "L%d:%s" % (L, ("%.3g" % v["change_vs_none"]) if "change_vs_none" in v else "-")
                        for L, v in row["layers"].items())))
                except Exception:
                    row["error"] = traceback.format_exc()[-1500:]
                    print("  %-10s %-5s %-17s FAILED\n%s" % (model_name, dname, bug, row["error"]))
                finally:
                    if rec is not None:
                        rec.detach()
                    if undo is not None:
                        undo()
                summary.append(row)
            del model
            if dev == "cuda":
                torch.cuda.empty_cache()
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with tarfile.open(os.path.join(out, "engine-dumps.tar"), "w") as tar:
        tar.add(os.path.join(out, "dumps"), arcname="dumps")
    n_err = sum(1 for r in summary if "error" in r)
    print("cases: %d, failed: %d, %.1f s" % (len(summary), n_err, time.time() - t0))
    return 1 if n_err else 0


if __name__ == "__main__":
    sys.exit(main())
