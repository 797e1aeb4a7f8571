"""One thread's matmul throughput per dtype: how far bf16 sits from float32 on this CPU.

Prints one JSON line per dtype:
  {"bench": "matmul", "dtype": D, "m": M, "k": K, "n": N, "gflops": ..., "native_bf16": bool}
The shapes are the default model's MLP projection over a decode-sized batch
(64 x 512 @ 512 x 1536). Median of --repeats timed runs, each of --iters matmuls.
`--packed` adds, per dtype, `F.linear` with a plain [N, K] weight against the same
weight packed once for oneDNN (models/prepack.py), as the model's layers run them
("op": "linear" / "packed_linear"). Run it alone on the machine: any other load
changes the figures.

`--model-rows R [R ...]` measures instead what a decode step's linears cost on one
thread: every packed weight of the default model, loaded and packed as a rank does
(each layer's q, k, v, o, gate, up, down and the LM head, so each call reads its weight
from memory as a real step does), applied once each to R rows, one line per row count:
  {"bench": "model_linears", "dtype": D, "rows": R, "weights": 57, "weights_mb": ... (MiB),
   "ms": ..., "gflops": ..., "weights_gb_per_s": ... (10^9 bytes)}
Two steps of R rows cost more than one of 2R by the part that does not grow with the
rows, chiefly reading the weights: what two half-size batches in flight pay.

`--together CPU [CPU ...]` measures how this machine's cores scale when all of them
compute at once: the matmul in one process pinned to the first CPU alone, then in one
process per CPU at the same time, one line per dtype:
  {"bench": "matmul_scaling", "dtype": D, "cpus": [...], "alone_gflops": ...,
   "together_gflops": [...], "scaling": sum(together) / alone}
Two real cores scale 2x; cores that share a physical core, a power budget or a busy
host less. A pipeline's stages compute at once, so this bounds what two batches in
flight can gain over one (tools/bench_throughput.py's overlap).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
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


def bench_model_linears(dtype: torch.dtype, rows: list[int], repeats: int) -> list[dict]:
    """The default model's packed linears, each applied once to `rows` rows, as one decode step runs them."""
    from models.config import Layout, load_config
    from models.default_model import default_model_dir
    from models.loader import load_stage
    from models.prepack import PackedLinear, prepack_stage

    path = default_model_dir()
    stage, _ = load_stage(Layout(load_config(path)), path, dtype)  # one stage: every layer and the LM head
    prepack_stage(stage)
    weights = [m.weight_packed for m in stage.modules() if isinstance(m, PackedLinear)]
    del stage  # the packed weights are all that is timed
    params = sum(w.out_features * w.in_features for w in weights)
    nbytes = params * torch.finfo(dtype).bits // 8
    out = []
    for m in rows:
        inputs = {w.in_features: torch.randn(m, w.in_features).to(dtype) for w in weights}

        def step() -> None:
            for w in weights:
                w.linear(inputs[w.in_features])

        for _ in range(3):
            step()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        flops = 2 * m * params
        out.append({"bench": "model_linears", "dtype": str(dtype).removeprefix("torch."), "rows": m,
                    "weights": len(weights), "weights_mb": round(nbytes / 2**20, 1), "ms": round(1e3 * t, 2),
                    "gflops": round(flops / t / 1e9, 1), "weights_gb_per_s": round(nbytes / t / 1e9, 2)})
    return out


# --together: how long after launching the processes they all start measuring.
TOGETHER_START_S = 5.0


def together(cpus: list[int], dtype: str, shape: list[int], iters: int, repeats: int) -> dict:
    """The matmul alone on cpus[0], then on every CPU at once, each in its own one-thread process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--dtypes", dtype, "--shape", *map(str, shape),
           "--iters", str(iters), "--repeats", str(repeats)]

    def measure(*extra: list[str]) -> list[float]:
        procs: list[subprocess.Popen] = []
        try:
            for args in extra:
                procs.append(subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, text=True))
            rates = []
            for proc in procs:
                out, _ = proc.communicate(timeout=600)
                if proc.returncode != 0:
                    raise RuntimeError(f"{' '.join(proc.args)} exited with {proc.returncode}")
                rates.append(json.loads(out.splitlines()[-1])["gflops"])
            return rates
        finally:
            for proc in procs:  # none is left behind when one fails
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    (alone,) = measure(["--cpu", str(cpus[0])])
    # Every process waits for one start time, by when all of them have imported torch.
    start_at = time.time() + TOGETHER_START_S
    rates = measure(*(["--cpu", str(c), "--start-at", str(start_at)] for c in cpus))
    return {"bench": "matmul_scaling", "dtype": dtype, "m": shape[0], "k": shape[1], "n": shape[2], "cpus": cpus,
            "alone_gflops": alone, "together_gflops": rates, "scaling": round(sum(rates) / alone, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[64, 512, 1536], metavar=("M", "K", "N"))
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--packed", action="store_true", help="also F.linear with a plain and a packed weight")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"],
                        help="bf16 without native support can run at ~1 GFLOP/s: leave it out for big shapes")
    parser.add_argument("--model-rows", type=int, nargs="+", metavar="R",
                        help="instead: all the default model's linears (cold weights) over R rows, per R")
    parser.add_argument("--together", type=int, nargs="+", metavar="CPU",
                        help="instead: the matmul alone on the first CPU, then on all of them at once")
    parser.add_argument("--cpu", type=int, help="pin this process to CPU")
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)  # --together's children: a time.time()
    args = parser.parse_args()
    if args.together:
        for name in args.dtypes:
            print(json.dumps(together(args.together, name, args.shape, args.iters, args.repeats)), flush=True)
        return
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(args.threads)
    if args.start_at is not None:
        time.sleep(max(0.0, args.start_at - time.time()))
    if args.model_rows:
        for name in args.dtypes:
            if not prepack_supported(getattr(torch, name), "cpu"):  # no oneDNN packing in this build
                continue
            for line in bench_model_linears(getattr(torch, name), args.model_rows, max(args.repeats, 7)):
                print(json.dumps({**line, "threads": args.threads}), flush=True)
        return
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
