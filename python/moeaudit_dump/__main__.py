"""python3 -m moeaudit_dump: convert engines' own dumps, merge ranks, list a dump.

  python3 -m moeaudit_dump sglang PATH OUT.safetensors [--step S] [--rank R] [--experts E]
  python3 -m moeaudit_dump vllm FILE.pt OUT.safetensors [--experts E]
  python3 -m moeaudit_dump merge-ranks OUT.safetensors RANK0.safetensors RANK1.safetensors ...
  python3 -m moeaudit_dump show DUMP.safetensors
"""
import argparse
import sys

from . import convert, merge_ranks, st


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m moeaudit_dump", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sglang", help="convert an SGLang tensor dump")
    s.add_argument("path")
    s.add_argument("out")
    s.add_argument("--step", type=int)
    s.add_argument("--rank", type=int, default=0)
    s.add_argument("--experts", type=int, help="number of routed experts (tells logits from weights)")
    v = sub.add_parser("vllm", help="convert a {module: output} dict saved from a vLLM model")
    v.add_argument("path")
    v.add_argument("out")
    v.add_argument("--experts", type=int)
    m = sub.add_parser("merge-ranks", help="sum tensor-parallel partial outputs")
    m.add_argument("out")
    m.add_argument("inputs", nargs="+")
    w = sub.add_parser("show", help="list a dump's tensors")
    w.add_argument("path")
    a = p.parse_args(argv)
    try:
        if a.cmd == "sglang":
            convert.from_sglang(a.path, a.out, a.step, a.rank, a.experts)
        elif a.cmd == "vllm":
            convert.from_vllm(a.path, a.out, a.experts)
        elif a.cmd == "merge-ranks":
            merge_ranks(a.inputs, a.out)
        else:
            t, meta = st.load(a.path)
            for k, x in meta.items():
                print("# %s: %s" % (k, x))
            for k, x in t.items():
                print("%-28s %-9s %s" % (k, str(x.dtype).replace("torch.", ""), list(x.shape)))
            return 0
        print(a.out)
        return 0
    except (ValueError, OSError, KeyError) as e:
        print("moeaudit_dump: %s" % e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
