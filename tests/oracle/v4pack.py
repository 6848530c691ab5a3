"""Numpy-only encoders, decoders and writers for the DeepSeek-V4-Flash release layout.

Used by make_v4_oracle.py (on the GPU machine, numpy 2.x) and tested here by
test_v4pack.py (Debian's python3-numpy, no torch). Nothing in this file needs torch.

What it defines (every encoder has a table-driven decoder written independently of it):
- bf16_round(x): float64 -> float64 rounded to bfloat16 (round to nearest even), and bf16 bits.
- E4M3 (float8_e4m3fn): encode_e4m3(x) -> uint8 codes, round to nearest even, |x| <= 448
  required (the weight quantizer guarantees it); decode_e4m3(codes) -> float64.
- E8M0 (float8_e8m0fnu): a power of two 2^(b-127) stored as the byte b; b = 255 is NaN.
- E2M1 (MXFP4 element): encode_e2m1(x) -> 4-bit codes, round to nearest even, |x| <= 6;
  two codes per byte, element 2i in the low nibble, 2i+1 in the high nibble.
- quant_fp8_block(w): [out, in] -> (e4m3 codes [out, in], E8M0 bytes [ceil(out/128), ceil(in/128)]),
  scale of each 128x128 tile = 2^ceil(log2(amax / 448)) (the V4 "ue8m0" rule).
- quant_mxfp4(w): [out, in] -> (packed bytes as int8 [out, in/2], E8M0 bytes [out, in/32]),
  scale of each 1x32 block = 2^ceil(log2(amax / 6)).
- write_safetensors(path, tensors, metadata): the safetensors format (8-byte little-endian header
  length, JSON header, raw little-endian data), header padded with spaces to a multiple of 8.
- read_safetensors(path): the reverse, returning raw bytes per tensor (for the self-checks).
"""

import json
import math
import struct

import numpy as np

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_TILE = 128
MX_BLOCK = 32

# --------------------------------------------------------------------------- bf16


def bf16_bits(x):
    """float64 array -> uint16 bfloat16 bits, rounded to nearest even directly from the float64
    value (no float32 step, so no double rounding)."""
    x = np.asarray(x, dtype=np.float64)
    if np.any(~np.isfinite(x)):
        raise ValueError("bf16_bits: non-finite input")
    m, e = np.frexp(x)  # x = m * 2^e, 0.5 <= |m| < 1
    q = np.rint(m * 256.0)  # 8 significant bits, ties to even
    r = np.ldexp(q, e - 8)
    # Below the bf16 normal range (2^-126) the grid is fixed at 2^-133: redo those.
    small = np.abs(r) < 2.0 ** -126
    if np.any(small):
        r[small] = np.rint(x[small] * 2.0 ** 133) * 2.0 ** -133
    f32 = r.astype(np.float32)
    if np.any(f32.astype(np.float64) != r):
        raise ValueError("bf16_bits: value out of the float32 range")
    return (f32.view(np.uint32) >> 16).astype(np.uint16)


def bf16_from_bits(bits):
    bits = np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def bf16_round(x):
    return bf16_from_bits(bf16_bits(x))


def f32_round(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


# --------------------------------------------------------------------------- decoders (tables)


def _e4m3_table():
    t = np.empty(256, dtype=np.float64)
    for c in range(256):
        s = -1.0 if c & 0x80 else 1.0
        e = (c >> 3) & 0xF
        m = c & 0x7
        if e == 0xF and m == 0x7:
            t[c] = math.nan
        elif e == 0:
            t[c] = s * m * 2.0 ** -9
        else:
            t[c] = s * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return t


E4M3_TABLE = _e4m3_table()
E2M1_TABLE = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def decode_e4m3(codes):
    return E4M3_TABLE[np.asarray(codes, dtype=np.uint8)]


def decode_e8m0(b):
    b = np.asarray(b, dtype=np.uint8)
    out = np.ldexp(1.0, b.astype(np.int64) - 127)
    return np.where(b == 255, np.nan, out)


def unpack_e2m1(packed, cols):
    """int8/uint8 [rows, cols/2] -> float64 [rows, cols] E2M1 values (no scale)."""
    u = np.asarray(packed).view(np.uint8)
    lo = E2M1_TABLE[u & 0xF]
    hi = E2M1_TABLE[u >> 4]
    out = np.empty((u.shape[0], cols), dtype=np.float64)
    out[:, 0::2] = lo
    out[:, 1::2] = hi
    return out


def dequant_fp8_block(codes, scale_bytes):
    out, inn = codes.shape
    s = decode_e8m0(scale_bytes)
    s_full = np.repeat(np.repeat(s, FP8_TILE, axis=0), FP8_TILE, axis=1)[:out, :inn]
    return decode_e4m3(codes) * s_full


def dequant_mxfp4(packed, scale_bytes, cols):
    v = unpack_e2m1(packed, cols)
    s = np.repeat(decode_e8m0(scale_bytes), MX_BLOCK, axis=1)
    return v * s


# --------------------------------------------------------------------------- encoders


def encode_e4m3(x):
    """float64 -> E4M3FN codes, round to nearest even; |x| > 448 raises (no saturation here:
    the block quantizer's power-of-two scale guarantees |x| <= 448)."""
    x = np.asarray(x, dtype=np.float64)
    if np.any(~np.isfinite(x)) or np.any(np.abs(x) > E4M3_MAX):
        raise ValueError("encode_e4m3: input outside [-448, 448]")
    a = np.abs(x)
    sign = np.signbit(x).astype(np.uint8) << 7
    _, ex = np.frexp(a)  # a = m 2^ex, m in [0.5, 1) => floor(log2 a) = ex - 1
    E = np.maximum(ex - 1, -6)
    E = np.where(a == 0, -6, E)
    q = np.rint(np.ldexp(a, 3 - E))  # significand in units of 2^(E-3): [0, 16]
    up = q == 16
    E = np.where(up, E + 1, E)
    q = np.where(up, 8, q)
    sub = (E == -6) & (q < 8)
    code = np.where(sub, q, ((E + 7) << 3) + (q - 8)).astype(np.int64)
    if np.any(code > 0x7E):
        raise ValueError("encode_e4m3: rounded past 448")
    return (code.astype(np.uint8) | sign).astype(np.uint8)


def encode_e2m1(x):
    """float64 -> 4-bit E2M1 codes (uint8 0..15), round to nearest, ties to the even code."""
    x = np.asarray(x, dtype=np.float64)
    if np.any(~np.isfinite(x)) or np.any(np.abs(x) > E2M1_MAX):
        raise ValueError("encode_e2m1: input outside [-6, 6]")
    a = np.abs(x)
    grid = E2M1_TABLE[:8]
    d = np.abs(a[..., None] - grid)  # [..., 8]
    best = np.argmin(d, axis=-1)  # first minimum: the lower code on a tie
    # On a tie between codes c and c+1 take the even one.
    nxt = np.minimum(best + 1, 7)
    tie = np.take_along_axis(d, nxt[..., None], -1)[..., 0] == np.take_along_axis(d, best[..., None], -1)[..., 0]
    tie &= nxt != best
    code = np.where(tie & (best % 2 == 1), nxt, best).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 3)


def pow2_scale_exponent(amax, qmax):
    """Smallest k with amax / 2^k <= qmax, i.e. k = ceil(log2(amax / qmax)), computed exactly
    (frexp on amax and qmax, then one correction step); amax = 0 gives the smallest scale that
    E8M0 holds, 2^-127."""
    amax = np.asarray(amax, dtype=np.float64)
    safe = np.where(amax > 0, amax, 1.0)
    k = np.ceil(np.log2(safe / qmax)).astype(np.int64)
    # correct a log2 rounding either way
    k = np.where(np.ldexp(qmax, k - 1) >= safe, k - 1, k)
    k = np.where(np.ldexp(qmax, k) < safe, k + 1, k)
    k = np.where(amax > 0, k, -127)
    if np.any(k < -127) or np.any(k > 127):
        raise ValueError("pow2_scale_exponent: scale outside the E8M0 range")
    return k


def quant_fp8_block(w):
    """[out, in] float64 -> (codes uint8 [out, in], scale E8M0 uint8 [ceil(out/128), ceil(in/128)])."""
    w = np.asarray(w, dtype=np.float64)
    out, inn = w.shape
    gr, gc = -(-out // FP8_TILE), -(-inn // FP8_TILE)
    pad = np.zeros((gr * FP8_TILE, gc * FP8_TILE))
    pad[:out, :inn] = np.abs(w)
    amax = pad.reshape(gr, FP8_TILE, gc, FP8_TILE).max(axis=(1, 3))
    k = pow2_scale_exponent(amax, E4M3_MAX)
    k_full = np.repeat(np.repeat(k, FP8_TILE, axis=0), FP8_TILE, axis=1)[:out, :inn]
    codes = encode_e4m3(np.ldexp(w, -k_full))
    return codes, (k + 127).astype(np.uint8)


def quant_mxfp4(w):
    """[out, in] float64 (in % 32 == 0) -> (packed int8 [out, in/2], scale E8M0 uint8 [out, in/32])."""
    w = np.asarray(w, dtype=np.float64)
    out, inn = w.shape
    if inn % MX_BLOCK:
        raise ValueError("quant_mxfp4: in must be a multiple of 32")
    amax = np.abs(w).reshape(out, inn // MX_BLOCK, MX_BLOCK).max(axis=2)
    k = pow2_scale_exponent(amax, E2M1_MAX)
    k_full = np.repeat(k, MX_BLOCK, axis=1)
    codes = encode_e2m1(np.ldexp(w, -k_full))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed.view(np.int8), (k + 127).astype(np.uint8)


# --------------------------------------------------------------------------- safetensors

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "I64": np.int64, "I32": np.int32, "I8": np.int8,
    "U8": np.uint8, "BF16": np.uint16, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8,
}


class Tensor:
    """One tensor to write: safetensors dtype name, shape, raw little-endian bytes."""

    def __init__(self, dtype, shape, data):
        self.dtype = dtype
        self.shape = [int(s) for s in shape]
        self.data = bytes(data)
        n = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        if n * np.dtype(_ST_DTYPES[dtype]).itemsize != len(self.data):
            raise ValueError("Tensor: %s%s needs %d bytes, got %d" % (dtype, self.shape, n, len(self.data)))


def tensor_np(dtype, arr):
    """Tensor from a numpy array already holding the storage values (bf16 as uint16 bits,
    fp8/e8m0 as uint8 codes)."""
    arr = np.ascontiguousarray(np.asarray(arr, dtype=_ST_DTYPES[dtype]))
    return Tensor(dtype, arr.shape, arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())


def write_safetensors(path, tensors, metadata=None):
    """tensors: dict name -> Tensor, written in sorted name order. metadata: dict str -> str."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    names = sorted(tensors)
    for n in names:
        t = tensors[n]
        header[n] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [off, off + len(t.data)]}
        off += len(t.data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for n in names:
            f.write(tensors[n].data)
    return 8 + len(h) + off


def read_safetensors(path):
    """-> (metadata dict or None, dict name -> (dtype, shape, raw bytes)); checks that the data
    offsets tile the data section exactly."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", None)
    data = raw[8 + n:]
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items())
    pos = 0
    for a, b, k in spans:
        if a != pos:
            raise ValueError("%s: tensor %s starts at %d, expected %d" % (path, k, a, pos))
        pos = b
    if pos != len(data):
        raise ValueError("%s: data section is %d bytes, tensors cover %d" % (path, len(data), pos))
    out = {}
    for k, v in header.items():
        a, b = v["data_offsets"]
        out[k] = (v["dtype"], v["shape"], data[a:b])
    return meta, out


def as_array(dtype, shape, raw):
    """Raw bytes of a tensor -> numpy array of its storage type (bf16 stays uint16 bits)."""
    return np.frombuffer(raw, dtype=np.dtype(_ST_DTYPES[dtype]).newbyteorder("<")).reshape(shape)


def value_of(dtype, shape, raw):
    """Raw bytes -> float64 values for float dtypes (E4M3 / E8M0 decoded without scales)."""
    a = as_array(dtype, shape, raw)
    if dtype == "BF16":
        return bf16_from_bits(a)
    if dtype == "F8_E4M3":
        return decode_e4m3(a)
    if dtype == "F8_E8M0":
        return decode_e8m0(a)
    return a.astype(np.float64)
