"""The peer of `moeaudit bench --device cuda`: PyTorch's torch._grouped_mm in bf16
on the same routed-expert problem (gate+up as one [2I, H] grouped GEMM, SwiGLU,
down [H, I] grouped GEMM, weighted combine), fresh random routing over all E
experts per iteration (8 sets rotated), CUDA-event timing, median over iterations.

Prints one line per token count: `PEER tokens=T median_ms=M p90_ms=P`.
"""
import argparse
import sys

import torch

SHAPES = {"v4flash": (4096, 2048, 256, 6), "v3": (7168, 2048, 256, 8)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="v4flash")
    ap.add_argument("--tokens", default="1,16,128,1024,4096,8192")
    ap.add_argument("--iters", type=int, default=0)
    a = ap.parse_args()
    H, I, E, K = SHAPES[a.shape]
    dev = "cuda"
    torch.manual_seed(0)
    # [E, 2I, H] and [E, H, I] row-major; _grouped_mm takes B as [E, k, n] column-major (transposed views)
    w13 = (torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02)
    w2 = (torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02)
    b13, b2 = w13.transpose(1, 2), w2.transpose(1, 2)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}: {a.shape} H {H} I {I} E {E} K {K}, bf16", flush=True)

    def step(x, ids, w):
        T = x.shape[0]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        tok = order // K
        xg = x.index_select(0, tok)
        h = torch._grouped_mm(xg, b13, offs=offs)
        g, u = h[:, :I], h[:, I:]
        act = torch.nn.functional.silu(g) * u
        y = torch._grouped_mm(act, b2, offs=offs)
        y = y * w.reshape(-1)[order].unsqueeze(1).to(y.dtype)
        out = torch.zeros(T, H, device=dev, dtype=torch.float32)
        out.index_add_(0, tok, y.float())
        return out

    for T in [int(t) for t in a.tokens.split(",")]:
        sets = []
        for s in range(8):
            ids = torch.rand(T, E, device=dev).argsort(dim=1)[:, :K].contiguous()
            w = torch.full((T, K), 1.0 / K, device=dev)
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
            sets.append((x, ids, w))
        iters = a.iters or (200 if T <= 16 else 40 if T <= 1024 else 12)
        try:
            for i in range(5):
                step(*sets[i % 8])
            torch.cuda.synchronize()
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
            for i in range(iters):
                ev[i][0].record()
                step(*sets[i % 8])
                ev[i][1].record()
            torch.cuda.synchronize()
            ts = sorted(e0.elapsed_time(e1) for e0, e1 in ev)
            print(f"PEER tokens={T} median_ms={ts[len(ts) // 2]:.5f} p90_ms={ts[int(0.9 * len(ts)) - 1]:.5f}", flush=True)
        except Exception as exc:  # report, keep going
            print(f"PEER tokens={T} error: {exc}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
