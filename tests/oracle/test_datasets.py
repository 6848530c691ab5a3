"""Checks of the committed V4 datasets (numpy only): the V4-Flash release layout rules tensor by
tensor, and invariants of the float64 oracles that hold whatever the numbers are.

Run: python3 tests/oracle/test_datasets.py   (exit 0 = all passed; 77 = numpy missing, skipped)
"""

import json
import os
import sys
import unittest

try:
    import numpy as np
except ImportError:
    print("skipped: numpy is not installed (Debian: python3-numpy)")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import v4layout as L  # noqa: E402
import v4pack as P  # noqa: E402

DATA = os.path.join(HERE, "..", "data")
FLASH = os.path.join(DATA, "dsv4-flash-layout")
ATTN = os.path.join(DATA, "dsv4-attn")


def load_oracle(d, name="oracle.safetensors"):
    meta, t = P.read_safetensors(os.path.join(d, name))
    return meta, {k: P.as_array(*v) for k, v in t.items()}


class FlashLayout(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(os.path.join(FLASH, "config.json")) as f:
            cls.cfg = json.load(f)
        cls.t = L.read_sharded(FLASH)  # every indexed tensor in its shard and back

    def test_config_is_the_native_schema(self):
        c = self.cfg
        self.assertEqual(len(c["compress_ratios"]), c["num_hidden_layers"] + c["num_nextn_predict_layers"])
        self.assertEqual(c["compress_ratios"][-1], 0)  # the MTP block: sliding window only
        self.assertEqual(c["quantization_config"], {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                                    "scale_fmt": "ue8m0", "weight_block_size": [128, 128]})
        self.assertEqual(c["rope_scaling"]["type"], "yarn")
        for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            self.assertIn(k, c["rope_scaling"])
        for k in ("num_hash_layers", "compress_rope_theta", "expert_dtype"):
            self.assertIn(k, c)
        for k in ("layer_types", "compress_rates", "mlp_layer_types", "rope_parameters"):
            self.assertNotIn(k, c)  # transformers' keys are not in the release config

    def test_names_dtypes_shapes(self):
        d = L.Dims(self.cfg)
        want = {}
        for name, storage, shape, kind in L.weight_list(d):
            base = name[:-len(".weight")] if name.endswith(".weight") else name
            if storage == "fp8":
                want[name] = ("F8_E4M3", shape)
                want[base + ".scale"] = ("F8_E8M0", [-(-shape[0] // 128), -(-shape[1] // 128)])
            elif storage == "mxfp4":
                want[name] = ("I8", [shape[0], shape[1] // 2])
                want[base + ".scale"] = ("F8_E8M0", [shape[0], shape[1] // 32])
            else:
                want[name] = ({"bf16": "BF16", "f32": "F32", "i64": "I64"}[storage], shape)
        got = {n: (t.dtype, t.shape) for n, t in self.t.items()}
        self.assertEqual(sorted(set(got) - set(want)), [])
        self.assertEqual(sorted(set(want) - set(got)), [])
        for n in want:
            self.assertEqual(got[n], want[n], n)
        self.assertFalse(any(n.startswith("model.") for n in got))
        with open(os.path.join(FLASH, "model.safetensors.index.json")) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        self.assertEqual(shards, ["model-0000%d-of-00003.safetensors" % i for i in (1, 2, 3)])

    def test_scales_are_the_smallest_power_of_two(self):
        """FP8 tiles: 2^ceil(log2(amax/448)) puts amax/scale in (224, 448], so the largest |code value|
        of a tile, amax/scale rounded, is in [224, 448]; MXFP4 blocks: amax/scale in (3, 6], so the
        largest |E2M1| of a block is 3, 4 or 6 (necessary conditions: amax itself is not stored)."""
        n_tiles = n_blocks = 0
        for name, t in self.t.items():
            if t.dtype == "F8_E4M3":
                v = np.abs(P.decode_e4m3(P.as_array(t.dtype, t.shape, t.data)))
                r, c = t.shape
                for i in range(0, r, 128):
                    for j in range(0, c, 128):
                        m = v[i:i + 128, j:j + 128].max()
                        self.assertTrue(224 <= m <= 448, "%s tile (%d, %d): max %g" % (name, i // 128, j // 128, m))
                        n_tiles += 1
            elif t.dtype == "I8":
                v = np.abs(P.unpack_e2m1(P.as_array(t.dtype, t.shape, t.data), 2 * t.shape[1]))
                m = v.reshape(t.shape[0], -1, 32).max(axis=2)
                self.assertTrue(np.all((m == 3) | (m == 4) | (m == 6)), name)
                n_blocks += m.size
        self.assertGreater(n_tiles, 50)
        self.assertGreater(n_blocks, 1000)

    def test_decoded_values_are_bf16_numbers(self):
        vals = L.decode_checkpoint(self.t)
        for n, v in vals.items():
            if self.t[n].dtype in ("F8_E4M3", "I8", "BF16"):
                np.testing.assert_array_equal(P.bf16_round(v), v, err_msg=n)

    def test_hash_rows_distinct(self):
        for n, t in self.t.items():
            if n.endswith("tid2eid"):
                a = P.as_array(t.dtype, t.shape, t.data)
                self.assertTrue(all(len(set(r)) == len(r) for r in a.tolist()), n)
                self.assertTrue(0 <= a.min() and a.max() < self.cfg["n_routed_experts"])


class OracleInvariants(unittest.TestCase):
    """Both datasets: shapes by the config, streams chained, the first streams are the embedding,
    hash layers route by tid2eid, index sets are the top-k of the recorded scores over the visible
    entries, chunked index sets equal the one-shot ones."""

    def check(self, d, embed, tid2eid, layer_types, ratio4, hc, topk, H, V):
        meta, o = load_oracle(d)
        self.assertIn("sorted ascending", meta["index_topk_rows"])
        ids = o["input_ids"]
        T = len(ids)
        self.assertEqual(o["logits"].shape, (T, V))
        self.assertTrue(np.all(np.isfinite(o["logits"])))
        np.testing.assert_array_equal(o["layers.0.in"], np.repeat(embed[ids][:, None, :], hc, axis=1))
        for i, lt in enumerate(layer_types):
            p = "layers.%d" % i
            self.assertEqual(o[p + ".in"].shape, (T, hc, H))
            self.assertEqual(o[p + ".out"].shape, (T, hc, H))
            for b in ("attn", "ffn"):
                self.assertEqual(o["%s.%s.in" % (p, b)].shape, (T, H))
                self.assertEqual(o["%s.%s.out" % (p, b)].shape, (T, H))
            if i + 1 < len(layer_types):
                np.testing.assert_array_equal(o[p + ".out"], o["layers.%d.in" % (i + 1)])
            if i in tid2eid:
                np.testing.assert_array_equal(o[p + ".ffn.topk_ids"], np.sort(tid2eid[i][ids], axis=1))
            if lt == "compressed_sparse_attention":
                idx, sc = o[p + ".index_topk"], o[p + ".index_scores"]
                self.assertEqual(idx.dtype, np.int32)
                self.assertEqual(idx.shape, (T, topk))
                self.assertEqual(sc.shape[1], T // ratio4)
                discarded = 0
                for t in range(T):
                    vis = (t + 1) // ratio4
                    kept = idx[t][idx[t] >= 0]
                    self.assertEqual(len(kept), min(topk, vis), "query %d" % t)
                    self.assertTrue(np.all(idx[t][len(kept):] == -1))
                    self.assertTrue(np.all(np.diff(kept) > 0))
                    self.assertTrue(np.all(np.isneginf(sc[t, vis:])))
                    best = np.sort(np.argsort(-sc[t, :vis], kind="stable")[:topk])
                    np.testing.assert_array_equal(kept, best, err_msg="%s query %d" % (p, t))
                    discarded += max(0, vis - topk)
                self.assertGreater(discarded, T)  # the indexer really discards entries
                for c in ("chunked", "chunked_mid"):
                    np.testing.assert_array_equal(o["%s.%s.index_topk" % (c, p)], idx)
        for c in ("chunked", "chunked_mid"):
            self.assertEqual(int(o[c + ".chunks"].sum()), T)
            self.assertEqual(o[c + ".logits"].shape, (T, V))
        return o

    def test_flash_layout(self):
        with open(os.path.join(FLASH, "config.json")) as f:
            c = json.load(f)
        t = L.read_sharded(FLASH)
        vals = L.decode_checkpoint(t)
        n = c["num_hidden_layers"]
        lt = ["sliding_attention" if r == 0 else "compressed_sparse_attention" if r == 4 else
              "heavily_compressed_attention" for r in c["compress_ratios"][:n]]
        t2e = {i: vals["layers.%d.ffn.gate.tid2eid" % i] for i in range(c["num_hash_layers"])}
        self.check(FLASH, vals["embed.weight"], t2e, lt, 4, c["hc_mult"], c["index_topk"], c["hidden_size"],
                   c["vocab_size"])

    def test_transformers_layout(self):
        with open(os.path.join(ATTN, "config.json")) as f:
            c = json.load(f)
        _, t = P.read_safetensors(os.path.join(ATTN, "model.safetensors"))
        emb = P.value_of(*t["model.embed_tokens.weight"])
        t2e = {i: P.as_array(*t["model.layers.%d.ffn.gate.tid2eid" % i])
               for i, m in enumerate(c["mlp_layer_types"]) if m == "hash_moe"}
        self.check(ATTN, emb, t2e, c["layer_types"], c["compress_rates"]["compressed_sparse_attention"], c["hc_mult"],
                   c["index_topk"], c["hidden_size"], c["vocab_size"])

    def test_dsv4_tiny_nocast(self):
        _, o = load_oracle(os.path.join(DATA, "dsv4-tiny"), "oracle_nocast.safetensors")
        _, f = P.read_safetensors(os.path.join(DATA, "dsv4-tiny", "oracle_io.safetensors"))
        np.testing.assert_array_equal(o["input_ids"], P.as_array(*f["input_ids"]))
        ref = P.as_array(*f["model.logits"])
        self.assertEqual(o["logits"].shape, ref.shape)
        # the fixture's logits were made with the float32 casts (and differ by ~2e-5, see README)
        d = np.abs(o["logits"] - ref).max() / np.abs(ref).max()
        self.assertLess(d, 1e-4)
        self.assertGreater(d, 1e-8)


if __name__ == "__main__":
    r = unittest.main(exit=False, verbosity=1).result
    print("%d passed, %d failed" % (r.testsRun - len(r.failures) - len(r.errors), len(r.failures) + len(r.errors)))
    sys.exit(0 if r.wasSuccessful() else 1)
