"""Checks of the V4-Flash layout encoders (numpy only; runs with Debian's python3-numpy).

Each encoder is held to a brute-force reference: the nearest representable value found by
scanning the decode table (ties to the even code), so the tests do not reuse the encoders'
arithmetic. Run: python3 tests/oracle/test_v4pack.py   (exit 0 = all passed)
"""

import math
import os
import sys
import tempfile
import unittest

try:
    import numpy as np
except ImportError:
    print("skipped: numpy is not installed (Debian: python3-numpy)")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import v4layout as L  # noqa: E402
import v4pack as P  # noqa: E402


def nearest_code(x, table, codes):
    """Brute force: the code whose value is nearest to x; on a tie the even code (mantissa
    LSB 0); the sign of zero follows x."""
    best, bd = None, math.inf
    for c in codes:
        v = table[c]
        if math.isnan(v) or (math.copysign(1.0, v) != math.copysign(1.0, x)):
            continue
        dd = abs(v - x)
        if dd < bd or (dd == bd and c % 2 == 0):
            best, bd = c, dd
    return best


class E4M3(unittest.TestCase):
    def test_every_code_round_trips(self):
        codes = np.array([c for c in range(256) if not math.isnan(P.E4M3_TABLE[c])], dtype=np.uint8)
        self.assertEqual(len(codes), 254)  # 0x7f and 0xff are NaN
        back = P.encode_e4m3(P.decode_e4m3(codes))
        np.testing.assert_array_equal(back, codes)

    def test_table_landmarks(self):
        self.assertEqual(P.E4M3_TABLE[0x7E], 448.0)
        self.assertEqual(P.E4M3_TABLE[0x01], 2.0 ** -9)  # smallest subnormal
        self.assertEqual(P.E4M3_TABLE[0x08], 2.0 ** -6)  # smallest normal
        self.assertEqual(P.E4M3_TABLE[0x38], 1.0)
        self.assertEqual(P.E4M3_TABLE[0xB8], -1.0)

    def test_random_and_ties_against_brute_force(self):
        rng = np.random.default_rng(1)
        vals = list(rng.uniform(-448, 448, 3000)) + list(rng.standard_normal(2000) * 0.01)
        vals += list(np.ldexp(rng.uniform(-1, 1, 500), -8))  # subnormal range
        # exact midpoints between neighbours (the ties), positive and negative
        pos = sorted(set(v for v in P.E4M3_TABLE if v >= 0 and not math.isnan(v)))
        mids = [(a + b) / 2 for a, b in zip(pos, pos[1:])]
        vals += mids + [-m for m in mids] + [0.0, -0.0, 448.0, -448.0]
        x = np.array(vals)
        got = P.encode_e4m3(x)
        want = np.array([nearest_code(v, P.E4M3_TABLE, range(256)) for v in vals], dtype=np.uint8)
        np.testing.assert_array_equal(got, want)

    def test_rejects_out_of_range(self):
        for bad in (449.0, -1e9, math.nan, math.inf):
            with self.assertRaises(ValueError):
                P.encode_e4m3(np.array([bad]))


class E2M1(unittest.TestCase):
    def test_every_code_and_ties(self):
        codes = np.arange(16, dtype=np.uint8)
        np.testing.assert_array_equal(P.encode_e2m1(P.E2M1_TABLE[codes]), codes)
        grid = list(P.E2M1_TABLE[:8])
        mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
        rng = np.random.default_rng(2)
        vals = mids + [-m for m in mids] + list(rng.uniform(-6, 6, 3000))
        got = P.encode_e2m1(np.array(vals))
        want = [nearest_code(v, P.E2M1_TABLE, range(16)) for v in vals]
        np.testing.assert_array_equal(got, want)
        # the ties by name: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
        np.testing.assert_array_equal(P.E2M1_TABLE[P.encode_e2m1(np.array(mids))], [0, 1, 1, 2, 2, 4, 4])


class Scales(unittest.TestCase):
    def test_pow2_exponent_is_the_smallest_that_fits(self):
        rng = np.random.default_rng(3)
        amax = np.concatenate([rng.uniform(1e-6, 1e3, 2000), [448.0, 448.0 * 2 ** -20, 6.0, 3.0, 1e-30]])
        for qmax in (448.0, 6.0):
            k = P.pow2_scale_exponent(amax, qmax)
            self.assertTrue(np.all(amax / np.ldexp(1.0, k) <= qmax))
            self.assertTrue(np.all(amax / np.ldexp(1.0, k - 1) > qmax))
        self.assertEqual(int(P.pow2_scale_exponent(np.array([0.0]), 448.0)[0]), -127)

    def test_e8m0(self):
        self.assertEqual(P.decode_e8m0(np.array([127], np.uint8))[0], 1.0)
        self.assertEqual(P.decode_e8m0(np.array([0], np.uint8))[0], 2.0 ** -127)
        self.assertTrue(math.isnan(P.decode_e8m0(np.array([255], np.uint8))[0]))


class Blocks(unittest.TestCase):
    def test_fp8_tiles_partial_and_exact_in_bf16(self):
        rng = np.random.default_rng(4)
        w = rng.standard_normal((192, 320)) * 0.05
        w[:128, 128:256] *= 40.0  # one tile with a much larger scale
        codes, sc = P.quant_fp8_block(w)
        self.assertEqual(sc.shape, (2, 3))
        deq = P.dequant_fp8_block(codes, sc)
        # each tile's scale is the smallest power of two with amax/scale <= 448
        for i in range(2):
            for j in range(3):
                t = np.abs(w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max()
                s = 2.0 ** (int(sc[i, j]) - 127)
                self.assertLessEqual(t / s, 448.0)
                self.assertGreater(t / (s / 2), 448.0)
        # the error is at most half a step of E4M3 (relative 2^-4) plus the subnormal step
        s_full = np.repeat(np.repeat(P.decode_e8m0(sc), 128, 0), 128, 1)[:192, :320]
        self.assertTrue(np.all(np.abs(deq - w) <= np.maximum(np.abs(w) * 2.0 ** -4, s_full * 2.0 ** -10) + 0))
        np.testing.assert_array_equal(P.bf16_round(deq), deq)

    def test_mxfp4_packing_low_nibble_first(self):
        w = np.zeros((1, 32))
        w[0, 0], w[0, 1] = 1.0, -6.0  # codes 2 and 0xF
        packed, sc = P.quant_mxfp4(w)
        self.assertEqual(packed.dtype, np.int8)
        self.assertEqual(int(packed.view(np.uint8)[0, 0]), 0x2 | (0xF << 4))
        self.assertEqual(int(sc[0, 0]), 127)  # amax 6 -> scale 1
        rng = np.random.default_rng(5)
        w = rng.standard_normal((64, 192)) * 0.1
        packed, sc = P.quant_mxfp4(w)
        self.assertEqual(packed.shape, (64, 96))
        self.assertEqual(sc.shape, (64, 6))
        deq = P.dequant_mxfp4(packed, sc, 192)
        np.testing.assert_array_equal(P.bf16_round(deq), deq)
        # brute force per element: the decoded value is the nearest E2M1 multiple of its scale
        s = np.repeat(P.decode_e8m0(sc), 32, 1)
        want = np.array([[P.E2M1_TABLE[nearest_code(v, P.E2M1_TABLE, range(16))] for v in row]
                         for row in (w / s)]) * s
        np.testing.assert_array_equal(deq, want)


class Bf16(unittest.TestCase):
    def test_against_brute_force_neighbours(self):
        rng = np.random.default_rng(6)
        x = np.concatenate([rng.standard_normal(3000) * 10.0 ** rng.integers(-30, 30, 3000),
                            np.ldexp(rng.uniform(-1, 1, 200), -128)])
        got = P.bf16_round(x)
        f32 = np.abs(x).astype(np.float32)  # may differ from x; take the bf16 neighbours of |x|
        bits = (f32.view(np.uint32) >> 16).astype(np.int64)
        for dx in range(len(x)):
            cands = [b for b in (bits[dx] - 1, bits[dx], bits[dx] + 1) if 0 <= b < 0x7F80]
            vals = [math.copysign(float(np.array([b << 16], np.uint32).view(np.float32)[0]), x[dx]) for b in cands]
            best = min(range(len(cands)), key=lambda i: (abs(vals[i] - x[dx]), cands[i] & 1))
            self.assertEqual(got[dx], vals[best], msg="x=%r" % x[dx])
            self.assertEqual(math.copysign(1.0, got[dx]), math.copysign(1.0, x[dx]))

    def test_ties_to_even(self):
        one_plus_half_ulp = 1.0 + 2.0 ** -8  # halfway between 1 and 1 + 2^-7
        self.assertEqual(P.bf16_round(np.array([one_plus_half_ulp]))[0], 1.0)
        self.assertEqual(P.bf16_round(np.array([1.0 + 3 * 2.0 ** -8]))[0], 1.0 + 2.0 ** -6)


class Layout(unittest.TestCase):
    CFG = {
        "hidden_size": 128, "num_hidden_layers": 3, "vocab_size": 64, "num_attention_heads": 2, "head_dim": 128,
        "q_lora_rank": 256, "o_groups": 2, "o_lora_rank": 128, "index_n_heads": 4, "index_head_dim": 128,
        "moe_intermediate_size": 192, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "hc_mult": 4, "compress_ratios": [0, 4, 16, 0], "num_hash_layers": 1, "num_nextn_predict_layers": 1,
    }

    def test_write_read_decode(self):
        tensors, values = L.flash_tensors(self.CFG, seed=7)
        d = tempfile.mkdtemp()
        index = L.write_sharded(d, tensors, 3)
        self.assertEqual(len(set(index["weight_map"].values())), 3)
        back = L.read_sharded(d)
        self.assertEqual(set(back), set(tensors))
        for n in tensors:
            self.assertEqual((back[n].dtype, back[n].shape, back[n].data),
                             (tensors[n].dtype, tensors[n].shape, tensors[n].data), n)
        dec = L.decode_checkpoint(back)
        self.assertEqual(set(dec), set(values))
        for n, v in values.items():
            np.testing.assert_array_equal(dec[n], v, err_msg=n)
        # release dtypes by name
        dt = {n: t.dtype for n, t in back.items()}
        self.assertEqual(dt["layers.1.attn.wq_a.weight"], "F8_E4M3")
        self.assertEqual(dt["layers.1.attn.wq_a.scale"], "F8_E8M0")
        self.assertEqual(back["layers.1.attn.wq_b.scale"].shape, [2, 2])
        self.assertEqual(back["layers.1.ffn.shared_experts.w2.scale"].shape, [1, 2])  # 192 inputs: a partial tile
        self.assertEqual(dt["layers.1.attn.indexer.wq_b.weight"], "F8_E4M3")
        self.assertEqual(dt["layers.1.attn.indexer.weights_proj.weight"], "BF16")
        self.assertEqual(dt["layers.1.attn.compressor.wkv.weight"], "BF16")
        self.assertEqual(back["layers.1.attn.compressor.ape"].shape, [4, 256])
        self.assertEqual(back["layers.2.attn.compressor.ape"].shape, [16, 128])
        self.assertEqual(dt["layers.2.attn.attn_sink"], "F32")
        self.assertEqual(dt["layers.0.hc_attn_fn"], "F32")
        self.assertEqual(dt["layers.0.ffn.gate.tid2eid"], "I64")
        self.assertNotIn("layers.0.ffn.gate.bias", dt)
        self.assertEqual(dt["layers.1.ffn.gate.bias"], "F32")
        self.assertEqual(dt["layers.1.ffn.experts.3.w2.weight"], "I8")
        self.assertEqual(back["layers.1.ffn.experts.3.w2.weight"].shape, [128, 96])
        self.assertEqual(back["layers.1.ffn.experts.3.w2.scale"].shape, [128, 6])
        self.assertIn("mtp.0.e_proj.weight", dt)
        self.assertFalse(any(n.startswith("model.") for n in dt))
        # tid2eid rows are distinct experts
        t2e = values["layers.0.ffn.gate.tid2eid"]
        self.assertTrue(all(len(set(r)) == len(r) for r in t2e.tolist()))

    def test_name_map_is_injective(self):
        d = L.Dims(self.CFG)
        seen = set()
        for name, _, _, _ in L.weight_list(d):
            m = L.native_to_hf(name)
            if m is None:
                self.assertTrue(name.startswith("mtp."))
                continue
            self.assertNotIn(m, seen, name)
            seen.add(m)
        self.assertIn(("model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight", None, None), seen)
        self.assertIn(("model.layers.1.mlp.experts.gate_up_proj", 3, "up"), seen)


if __name__ == "__main__":
    r = unittest.main(exit=False, verbosity=1).result
    print("%d passed, %d failed" % (r.testsRun - len(r.failures) - len(r.errors), len(r.failures) + len(r.errors)))
    sys.exit(0 if r.wasSuccessful() else 1)
