"""How long a CPU rank's numba kernels take to compile from nothing, kernel by kernel.

For each thread count and repeat, a fresh Python process with an empty numba cache
(`NUMBA_CACHE_DIR` pointed at a new temporary folder) builds what a rank of that dtype
and thread count builds (`models.kernel_warmup.KernelSet`, the set `LLM`'s warm-up
shares out), one kernel after another, and prints one JSON line:

  {"bench": "compile", "dtype": "bfloat16", "threads": 2, "head_dim": 64, "repeat": 0,
   "kernels_s": {"bf16_gemm": 2.6, "decode_attention": 2.2, ...}, "total_s": 10.6}

A kernel's time is its build and check as a worker runs them (`KernelSet.build`); the
first kernel also pays for setting LLVM up, and importing torch and numba is left out.
With more than one thread a kernel's time includes its thread-pool version
(models/pool_kernels.py). This is what a machine's first start compiles; `LLM` splits
it over one helper process per CPU. Run it alone: compiling is CPU-bound.

    python tools/bench_compile.py                       # bfloat16, 1 and 2 threads
    python tools/bench_compile.py --threads 2 --repeats 3 --kernels decode_attention
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = ("bf16_gemm", "decode_attention", "prompt_attention", "norm_rope", "kv_write", "argmax")


def build_each(dtype: str, threads: int, head_dim: int, names: Optional[list[str]]) -> dict[str, float]:
    """Builds the set's kernels (those of `names`, else all that apply) one by one in this process: seconds each."""
    import torch

    from models.kernel_warmup import KernelSet

    kernels = KernelSet(getattr(torch, dtype), threads, head_dim)
    applicable = list(kernels.builds())
    missing = [name for name in names or () if name not in applicable]
    if missing:
        raise SystemExit(f"not built for {dtype} with head_dim {head_dim}: {missing} (built: {applicable})")
    seconds = {}
    for name in names or applicable:
        start = time.perf_counter()
        if not kernels.build([name])[name]:
            raise SystemExit(f"{name} did not build (see the log): is numba installed?")
        seconds[name] = round(time.perf_counter() - start, 3)
    return seconds


def measure(dtype: str, threads: int, head_dim: int, names: Optional[list[str]]) -> dict:
    """One fresh process with an empty numba cache builds the kernels; their seconds, as a JSON-ready dict."""
    with tempfile.TemporaryDirectory(prefix="pipeactors-compile-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        command = [sys.executable, os.path.abspath(__file__), "--child", "--dtype", dtype,
                   "--threads", str(threads), "--head-dim", str(head_dim)]
        if names:
            command += ["--kernels", *names]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"the build process failed ({done.returncode}):\n{done.stderr}")
        seconds = json.loads(done.stdout.splitlines()[-1])
    return {
        "bench": "compile", "dtype": dtype, "threads": threads, "head_dim": head_dim,
        "kernels_s": seconds, "total_s": round(sum(seconds.values()), 3),
    }


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="a rank's threads, one measurement each")
    parser.add_argument("--head-dim", type=int, default=64, help="the model's head_dim (the default model's: 64)")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, help="only these (default: all a rank builds)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one build, in this process
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(build_each(args.dtype, args.threads[0], args.head_dim, args.kernels)))
        return
    for repeat in range(args.repeats):
        for threads in args.threads:
            line = measure(args.dtype, threads, args.head_dim, args.kernels)
            print(json.dumps({**line, "repeat": repeat}), flush=True)


if __name__ == "__main__":
    main()
