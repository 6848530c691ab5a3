"""Tests of moeaudit_dump with PyTorch alone (Debian's python3-torch in CI):
the safetensors writer, the hooks on a module of transformers' shape
(tiny_moe.py, the bundled checkpoints' weights), the converters from SGLang's
and vLLM-side dumps, the rank merge, and the whole chain: each contract bug
injected into the running module, its dump diagnosed by the moeaudit CLI.

Environment: MOEAUDIT_CLI (the moeaudit binary) and MOEAUDIT_DATA (tests/data);
without them the CLI cases are skipped with a message.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402

import engine_bugs  # noqa: E402
import moeaudit_dump as md  # noqa: E402
import tiny_moe  # noqa: E402
from moeaudit_dump import convert, st  # noqa: E402

DATA = os.environ.get("MOEAUDIT_DATA", os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "data"))
CLI = os.environ.get("MOEAUDIT_CLI")


def record(model, ids, path, **kw):
    rec = md.attach(model, path, **kw)
    with torch.no_grad():
        model(ids)
    rec.save()
    rec.detach()
    return st.load(path)


class SafetensorsTest(unittest.TestCase):
    def test_roundtrip_every_dtype(self):
        g = torch.Generator().manual_seed(1)
        ts = {"f64": torch.randn(3, 5, dtype=torch.float64, generator=g),
              "f32": torch.randn(4, 2, generator=g),
              "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
              "f16": torch.randn(2, 2, generator=g).to(torch.float16),
              "i64": torch.arange(6, dtype=torch.int64).reshape(2, 3) - 3,
              "i32": torch.arange(5, dtype=torch.int32),
              "u8": torch.arange(4, dtype=torch.uint8),
              "empty": torch.zeros(0, 4)}
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "x.safetensors")
            st.save(ts, p, {"k": "v"})
            back, meta = st.load(p)
            self.assertEqual(meta, {"k": "v"})
            self.assertEqual(list(back), list(ts))
            for k, t in ts.items():
                self.assertEqual(back[k].dtype, t.dtype, k)
                self.assertEqual(tuple(back[k].shape), tuple(t.shape), k)
                self.assertTrue(torch.equal(back[k], t), k)
            with open(p, "rb") as f:
                raw = f.read()
            n = int.from_bytes(raw[:8], "little")
            self.assertEqual((8 + n) % 8, 0, "header padded to 8 bytes")
            self.assertFalse(any(f.startswith("x.safetensors.tmp") for f in os.listdir(d)), "no temp file left")

    def test_rejects_bad_names(self):
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(ValueError):
                st.save({"__metadata__": torch.zeros(1)}, os.path.join(d, "x"))
            with self.assertRaises(ValueError):
                st.save({"c": torch.zeros(1, dtype=torch.complex64)}, os.path.join(d, "x"))
            self.assertEqual(os.listdir(d), [], "nothing written on error")


class AttachTest(unittest.TestCase):
    def test_v4_fields_and_consistency(self):
        m, cfg = tiny_moe.load(os.path.join(DATA, "dsv4-tiny"), torch.float64)
        ids = tiny_moe.token_ids(cfg)
        with tempfile.TemporaryDirectory() as d:
            t, meta = record(m, ids, os.path.join(d, "v4.safetensors"))
        self.assertEqual(meta["layers"], "0,1,2,3")
        T, H, E, K = ids.numel(), cfg["hidden_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
        for L in range(4):
            p = "layers.%d." % L
            for f in md.FIELDS:
                self.assertIn(p + f, t, "layer %d records %s" % (L, f))
            self.assertEqual(tuple(t[p + "hidden"].shape), (T, H))
            self.assertEqual(tuple(t[p + "router_logits"].shape), (T, E))
            self.assertEqual(tuple(t[p + "topk_ids"].shape), (T, K))
            self.assertTrue(torch.equal(t[p + "input_ids"], ids.reshape(-1)))
            rs = t[p + "routed_out"] + t[p + "shared_out"]
            self.assertLess(float((t[p + "moe_out"] - rs).abs().max()), 1e-12)
            # weights as the router emitted them: they sum to s (transformers folds the factor in)
            self.assertLess(float((t[p + "topk_weights"].sum(-1) - cfg["routed_scaling_factor"]).abs().max()), 1e-12)
            self.assertEqual(t[p + "hidden"].dtype, torch.float64)
        # hash layers: the ids are tid2eid's rows
        tid = m.model.layers[0].mlp.gate.tid2eid
        self.assertTrue(torch.equal(t["layers.0.topk_ids"], tid[ids.reshape(-1)]))

    def test_v3_and_options(self):
        m, cfg = tiny_moe.load(os.path.join(DATA, "dsv3-tiny"), torch.bfloat16)
        ids = tiny_moe.token_ids(cfg)
        with tempfile.TemporaryDirectory() as d:
            t, _ = record(m, ids, os.path.join(d, "v3.safetensors"), layers=[1], max_tokens=30,
                          fields=("hidden", "moe_out", "topk_ids"))
            self.assertEqual(sorted(t), ["layers.1.hidden", "layers.1.moe_out", "layers.1.topk_ids"])
            self.assertEqual(t["layers.1.hidden"].shape[0], 30)
            self.assertEqual(t["layers.1.hidden"].dtype, torch.bfloat16, "the engine's dtype is kept")
            t, _ = record(m, ids, os.path.join(d, "keep.safetensors"),
                          keep=lambda h: torch.arange(h.shape[0]) % 2 == 0)
            self.assertEqual(t["layers.1.moe_out"].shape[0], ids.numel() // 2)
            with self.assertRaises(ValueError):
                md.attach(m, os.path.join(d, "x"), layers=[0])     # layer 0 is dense
            rec = md.attach(m, os.path.join(d, "none.safetensors"))
            with self.assertRaises(RuntimeError):
                rec.save()                                          # nothing ran: no empty dump
            rec.detach()
            self.assertFalse(os.path.exists(os.path.join(d, "none.safetensors")))

    def test_hooks_do_not_change_outputs(self):
        m, cfg = tiny_moe.load(os.path.join(DATA, "dsv4-tiny"), torch.float32)
        ids = tiny_moe.token_ids(cfg)
        with torch.no_grad():
            y0 = m(ids)
        with tempfile.TemporaryDirectory() as d:
            with md.attach(m, os.path.join(d, "ctx.safetensors")):
                with torch.no_grad():
                    y1 = m(ids)
            self.assertTrue(os.path.exists(os.path.join(d, "ctx.safetensors")), "written on a clean exit")
        self.assertTrue(torch.equal(y0, y1))
        self.assertFalse(m._forward_hooks or m._forward_pre_hooks, "hooks removed")


class VllmShapedTest(unittest.TestCase):
    """vLLM's DeepseekV2MoE calls experts(hidden_states=..., router_logits=...) by keyword, gets
    (shared, routed) back, then scales and adds into the routed tensor in place."""

    def test_in_place_engine(self):
        class Gate(torch.nn.Linear):
            def forward(self, x):
                return super().forward(x), None

        class Experts(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Linear(8, 8, bias=False)

            def forward(self, hidden_states, router_logits):
                return hidden_states * 0.5, self.w(hidden_states) * router_logits[:, :1]

        class MoE(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.gate, self.experts = Gate(8, 4, bias=False), Experts()

            def forward(self, hidden_states):
                logits, _ = self.gate(hidden_states)
                shared, routed = self.experts(hidden_states=hidden_states, router_logits=logits)
                routed *= 2.5
                routed += shared
                return routed

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = torch.nn.ModuleList([torch.nn.Module()])
                self.layers[0].mlp = MoE()

            def forward(self, x):
                return self.layers[0].mlp(x)

        torch.manual_seed(0)
        net, x = Net(), torch.randn(5, 8)
        with tempfile.TemporaryDirectory() as d:
            t, _ = record(net, x, os.path.join(d, "v.safetensors"))
        with torch.no_grad():
            logits = net.layers[0].mlp.gate(x)[0]
            routed = net.layers[0].mlp.experts.w(x) * logits[:, :1]
        self.assertTrue(torch.allclose(t["layers.0.routed_out"], routed), "captured before the in-place scale")
        self.assertTrue(torch.allclose(t["layers.0.shared_out"], x * 0.5))
        self.assertTrue(torch.allclose(t["layers.0.moe_out"], routed * 2.5 + x * 0.5))
        self.assertTrue(torch.allclose(t["layers.0.router_logits"], logits))


class ConvertTest(unittest.TestCase):
    def setUp(self):
        self.m, self.cfg = tiny_moe.load(os.path.join(DATA, "dsv4-tiny"), torch.float32)
        self.ids = tiny_moe.token_ids(self.cfg)
        self.dir = tempfile.TemporaryDirectory()
        self.t, _ = record(self.m, self.ids, os.path.join(self.dir.name, "ref.safetensors"))

    def tearDown(self):
        self.dir.cleanup()

    def leaves(self, L):
        t, p = self.t, "layers.%d." % L
        return {"model.layers.%d.post_attention_layernorm" % L: (t[p + "hidden"], t[p + "hidden"] * 0),
                "model.layers.%d.mlp.gate" % L: t[p + "router_logits"],
                "model.layers.%d.mlp.topk" % L: [t[p + "topk_weights"], t[p + "topk_ids"], t[p + "router_logits"]],
                "model.layers.%d.mlp.experts" % L: t[p + "routed_out"],
                "model.layers.%d.mlp.shared_experts.down_proj" % L: t[p + "shared_out"]}

    def check(self, out, layers, fields):
        got, meta = st.load(out)
        for L in layers:
            for f in fields:
                k = "layers.%d.%s" % (L, f)
                self.assertIn(k, got)
                self.assertTrue(torch.allclose(got[k].double(), self.t[k].double(), atol=1e-6), k)
        return meta

    def test_sglang_forward_hook_pass_file(self):
        d = os.path.join(self.dir.name, "TP0_PP0_Rank0_pid1")
        os.makedirs(d)
        leaves = {}
        for L in (0, 3):
            leaves.update(self.leaves(L))
        leaves["model.forward_batch_info.input_ids"] = self.ids.reshape(-1)
        torch.save(leaves, os.path.join(d, "Pass00000.pt"))
        out = os.path.join(self.dir.name, "sg.safetensors")
        convert.from_sglang(self.dir.name, out, n_experts=self.cfg["n_routed_experts"])
        meta = self.check(out, (0, 3), ("hidden", "moe_out", "router_logits", "topk_ids", "topk_weights", "input_ids"))
        self.assertIn("moe_out = routed_out + shared_out", meta["notes"])

    def test_sglang_dumper_files(self):
        d = os.path.join(self.dir.name, "dump_x")
        os.makedirs(d)
        i = [0]

        def put(name, v, layer=None):
            i[0] += 1
            tags = "step=0___rank=0___dump_index=%d___name=%s" % (i[0], name)
            if layer is not None:
                tags += "___layer_id=%d" % layer
            torch.save({"value": v, "meta": {"name": name}}, os.path.join(d, tags + ".pt"))
        put("input_ids", self.ids.reshape(-1))
        t, L, p = self.t, 3, "layers.3."
        put("non_intrusive__model.layers.3.mlp.inputs.0", t[p + "hidden"], L)
        put("non_intrusive__model.layers.3.mlp.output", t[p + "moe_out"], L)
        put("non_intrusive__model.layers.3.mlp.gate.output", t[p + "router_logits"], L)
        put("non_intrusive__model.layers.3.mlp.topk.output.0", t[p + "topk_weights"], L)
        put("non_intrusive__model.layers.3.mlp.topk.output.1", t[p + "topk_ids"], L)
        put("non_intrusive__model.layers.3.mlp.experts.output", t[p + "routed_out"], L)
        out = os.path.join(self.dir.name, "sg2.safetensors")
        convert.from_sglang(d, out, n_experts=self.cfg["n_routed_experts"])
        self.check(out, (3,), ("hidden", "moe_out", "router_logits", "topk_ids", "topk_weights", "routed_out", "input_ids"))

    def test_vllm_module_outputs(self):
        t, p = self.t, "layers.3."
        d = {"model.layers.3.post_attention_layernorm": (t[p + "hidden"], t[p + "hidden"]),
             "model.layers.3.mlp.gate": (t[p + "router_logits"], None),
             "model.layers.3.mlp.experts": (t[p + "shared_out"], t[p + "routed_out"]),
             "model.layers.3.mlp": t[p + "moe_out"], "input_ids": self.ids}
        src = os.path.join(self.dir.name, "vllm.pt")
        torch.save(d, src)
        out = os.path.join(self.dir.name, "vl.safetensors")
        convert.from_vllm(src, out, n_experts=self.cfg["n_routed_experts"])
        self.check(out, (3,), ("hidden", "moe_out", "router_logits", "routed_out", "shared_out", "input_ids"))

    def test_merge_ranks(self):
        t = self.t
        parts = []
        for r in range(2):
            part = {}
            for k, v in t.items():
                f = k.rsplit(".", 1)[-1]
                part[k] = v * (0.25 if r == 0 else 0.75) if f in ("moe_out", "routed_out", "shared_out") else v
            p = os.path.join(self.dir.name, "rank%d.safetensors" % r)
            st.save(part, p)
            parts.append(p)
        out = os.path.join(self.dir.name, "merged.safetensors")
        md.merge_ranks(parts, out)
        got, _ = st.load(out)
        for k, v in t.items():
            self.assertTrue(torch.allclose(got[k].double(), v.double(), atol=1e-6), k)
        bad = dict(st.load(parts[1])[0])
        bad["layers.3.hidden"] = bad["layers.3.hidden"] + 1
        st.save(bad, parts[1])
        with self.assertRaises(ValueError):
            md.merge_ranks(parts, out)


@unittest.skipIf(not CLI, "MOEAUDIT_CLI not set: the dumps are not diagnosed")
class ChainTest(unittest.TestCase):
    """Each bug injected into the running module; the CLI must name it on every layer."""

    def run_model(self, name, dtype, bugs):
        m, cfg = tiny_moe.load(os.path.join(DATA, name), dtype)
        ids = tiny_moe.token_ids(cfg)
        blocks = [b for _, _, b in md.find_moe_blocks(m)]
        wrong = []
        with tempfile.TemporaryDirectory() as d:
            for bug in bugs:
                if bug == "hash_off_by_one" and not any(hasattr(b.gate, "tid2eid") for b in blocks):
                    continue
                undo = engine_bugs.inject(blocks, bug)
                try:
                    path = os.path.join(d, "%s-%s.safetensors" % (name, bug))
                    record(m, ids, path)
                finally:
                    undo()
                js = os.path.join(d, "out.json")
                r = subprocess.run([CLI, "diagnose", "--model", os.path.join(DATA, name), "--dump", path, "--all",
                                    "--quiet", "--json", js], capture_output=True, text=True)
                self.assertIn(r.returncode, (0, 1), r.stderr)
                with open(js) as f:
                    layers = json.load(f)["layers"]
                for lay in layers:
                    hashl = name == "dsv4-tiny" and lay["layer"] < 3
                    want = engine_bugs.EXPECTED[bug][0 if hashl else 1]
                    wantn = "float32" if dtype == torch.float32 else "bf16"
                    if lay["verdict"] != want or lay["fit"]["noise"] != wantn:
                        wrong.append("%s %s %s layer %d: %s/%s, want %s/%s: %s" % (
                            name, dtype, bug, lay["layer"], lay["verdict"], lay["fit"]["noise"], want, wantn,
                            lay["sentence"]))
                undo = None
        self.assertEqual(wrong, [])

    def test_v4_float32(self):
        self.run_model("dsv4-tiny", torch.float32, list(engine_bugs.BUGS))

    def test_v4_bfloat16(self):
        self.run_model("dsv4-tiny", torch.bfloat16, list(engine_bugs.BUGS))

    def test_v3_float32(self):
        self.run_model("dsv3-tiny", torch.float32, list(engine_bugs.BUGS))


if __name__ == "__main__":
    unittest.main()
