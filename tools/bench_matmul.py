"""One thread's matmul throughput per dtype: how far bf16 sits from float32 on this CPU.

Prints one JSON line per dtype:
  {"bench": "matmul", "dtype": D, "m": M, "k": K, "n": N, "gflops": ..., "native_bf16": bool}
The shapes are the default model's MLP projection over a decode-sized batch
(64 x 512 @ 512 x 1536). Median of --repeats timed runs, each of --iters matmuls.
`--packed` adds, per dtype, `F.linear` with a plain [N, K] weight against the same
weight packed once for oneDNN (models/prepack.py), as the model's layers run them
("op": "linear" / "packed_linear"). Run it alone on the machine: any other load
changes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from models.config import cpu_has_native_bf16
from models.prepack import PackedWeight, prepack_supported


def bench(op: str, dtype: torch.dtype, m: int, k: int, n: int, iters: int, repeats: int) -> float:
    a = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    if op == "mm":
        b = w.t().contiguous()
        fn = lambda: torch.mm(a, b)  # noqa: E731
    elif op == "linear":
        fn = lambda: F.linear(a, w)  # noqa: E731
    else:
        packed = PackedWeight(w)
        fn = lambda: packed.linear(a)  # noqa: E731
    for _ in range(10):  # warm-up: oneDNN picks and caches its kernel
        fn()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        rates.append(2 * m * k * n * iters / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[64, 512, 1536], metavar=("M", "K", "N"))
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--packed", action="store_true", help="also F.linear with a plain and a packed weight")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"],
                        help="bf16 without native support can run at ~1 GFLOP/s: leave it out for big shapes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    m, k, n = args.shape
    native = cpu_has_native_bf16()
    for name in args.dtypes:
        dtype = getattr(torch, name)
        ops = ["mm"]
        if args.packed:
            ops += ["linear", "packed_linear"] if prepack_supported(dtype, "cpu") else ["linear"]
        for op in ops:
            gflops = bench(op, dtype, m, k, n, args.iters, args.repeats)
            line = {"bench": "matmul", "op": op, "dtype": name, "m": m, "k": k, "n": n, "threads": args.threads,
                    "gflops": round(gflops, 1), "native_bf16": native}
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
