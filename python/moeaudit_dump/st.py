"""Safetensors read/write with PyTorch alone (used when the `safetensors`
package is absent; the bytes are the same either way).

Format: 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
padded with spaces to a multiple of 8, then the tensors' bytes in order.
"""
import array
import json
import os
import struct
import sys

import torch

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}

# Same-size integer views used to get at the raw bytes of each dtype.
_RAW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
        torch.bfloat16: torch.int16}


def _raw_bytes(t):
    """The little-endian bytes of a CPU tensor, without numpy if need be."""
    t = t.detach().to("cpu").contiguous()
    if sys.byteorder != "little":
        raise RuntimeError("moeaudit_dump writes little-endian safetensors only")
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    try:
        import numpy  # noqa: F401
        return t.view(_RAW.get(t.dtype, t.dtype)).numpy().tobytes()
    except ImportError:
        pass
    v = t.view(_RAW.get(t.dtype, t.dtype)).flatten().tolist()
    code = {torch.int64: "q", torch.int32: "i", torch.int16: "h", torch.int8: "b", torch.uint8: "B"}
    return array.array(code[_RAW.get(t.dtype, t.dtype)], v).tobytes()


def save(tensors, path, metadata=None):
    """Write {name: tensor} to `path` atomically (temp file, fsync, rename).

    Names keep the dict's order. Raises ValueError for a dtype safetensors
    cannot hold or a name that is empty or "__metadata__"."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs, off = [], 0
    for name, t in tensors.items():
        if not name or name == "__metadata__":
            raise ValueError("bad tensor name %r" % (name,))
        if t.dtype not in _DTYPES:
            raise ValueError("%s: dtype %s cannot be written to safetensors" % (name, t.dtype))
        b = _raw_bytes(t)
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = "%s.tmp.%d" % (path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for b in blobs:
                f.write(b)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path):
    """Read a safetensors file: ({name: CPU tensor}, metadata dict)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError("%s: not a safetensors file (shorter than 8 bytes)" % path)
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise ValueError("%s: header length %d runs past the end of the file" % (path, n))
    header = json.loads(data[8:8 + n].decode())
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    out = {}
    for name, e in header.items():
        dt = _FROM_NAME.get(e["dtype"])
        if dt is None:
            raise ValueError("%s: tensor %s has dtype %s, which this reader does not know" % (path, name, e["dtype"]))
        b, end = e["data_offsets"]
        raw = bytearray(data[base + b:base + end])
        if dt == torch.bool:
            t = torch.frombuffer(raw, dtype=torch.uint8).to(torch.bool) if raw else torch.zeros(0, dtype=torch.bool)
        elif raw:
            t = torch.frombuffer(raw, dtype=_RAW.get(dt, dt)).view(dt)
        else:
            t = torch.zeros(0, dtype=dt)
        out[name] = t.reshape(e["shape"]).clone()
    return out, meta


def write(tensors, path, metadata=None):
    """save() through the `safetensors` package when present (same bytes), else ours."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        return save(tensors, path, metadata)
    tmp = "%s.tmp.%d" % (path, os.getpid())
    try:
        # safetensors refuses tensors that share storage (a converter may put
        # one input_ids under every layer): such repeats are written as copies.
        seen, out = set(), {}
        for k, v in tensors.items():
            t = v.detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr() if t.numel() else None
            if ptr is not None and ptr in seen:
                t = t.clone()
            elif ptr is not None:
                seen.add(ptr)
            out[k] = t
        save_file(out, tmp, metadata={str(k): str(v) for k, v in (metadata or {}).items()})
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
