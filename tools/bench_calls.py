"""What one call of each hot-path kernel costs from Python, wrapper included, on the decode step's shapes.

A decode step of the default model calls the bf16 GEMM 57 times, and the KV write and
decode attention once a layer each; at a few rows a call's Python (checks, tensor
properties, addresses, numba's dispatch) is a visible share of the step. Prints one JSON
line per call, medians of `--repeats` rounds of `--calls` calls each, in microseconds:

  {"bench": "call", "op": "linear", "rows": 32, "dtype": "bfloat16", "us": 8.9, "kernel_us": 4.9}

- `linear`: a 512 -> 512 `PackedLinear` as a rank calls it (module call, `PackedWeight`,
  `models/bf16_gemm.py`); `kernel_us` the kernel alone on the same addresses.
- `kv_write`: `models/kv_write.py`'s `write_kv` of one layer's keys and values into the paged
  cache and the mirror (4 kv heads of 64).
- `decode_attention_args`: preparing a decode attention call (`_arguments`: the float32
  queries, the output, the addresses), without the kernel, whose 0.2-0.3 ms is the keys'
  and values' reading; `kernel_us` the whole call.

Needs numba and, for `linear`, a CPU with avx512_bf16 (its line is left out otherwise).
One thread, pinned to `--cpu`. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from models import bf16_gemm, decode_attention, kv_write  # noqa: E402
from models.prepack import PackedLinear  # noqa: E402

HIDDEN, KV_HEADS, GROUPS, HEAD_DIM = 512, 4, 2, 64
CONTEXT = 160  # about the throughput workload's positions in decode
SLOTS = 4096


def _per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    for _ in range(max(1, calls // 10)):
        fn()
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return round(statistics.median(rounds), 2)


def _linear(rows: int, calls: int, repeats: int) -> dict:
    layer = PackedLinear(torch.nn.Linear(HIDDEN, HIDDEN, bias=False).to(torch.bfloat16))
    x = torch.randn(rows, HIDDEN).to(torch.bfloat16)
    kernel = bf16_gemm._kernel()
    out = torch.empty(rows, HIDDEN, dtype=torch.bfloat16)
    raw = (x.data_ptr(), layer.weight_packed.packed.data_ptr(), out.data_ptr(), rows, HIDDEN, HIDDEN)
    return {"us": _per_call_us(lambda: layer(x), calls, repeats),
            "kernel_us": _per_call_us(lambda: kernel(*raw), calls, repeats)}


def _kv_write(rows: int, dtype: torch.dtype, calls: int, repeats: int) -> dict:
    paged_k, paged_v = torch.zeros(2, SLOTS, KV_HEADS, HEAD_DIM, dtype=dtype)
    mirror_k, mirror_v = torch.zeros(2, rows, KV_HEADS, CONTEXT + 16, HEAD_DIM, dtype=dtype)
    k, v = torch.randn(2, rows, KV_HEADS, HEAD_DIM).to(dtype)
    slots = torch.arange(rows) * 7
    index = torch.arange(rows)
    paged = (kv_write.bits(paged_k), kv_write.bits(paged_v))
    mirror = (index, index, torch.full((rows,), CONTEXT), kv_write.bits(mirror_k), kv_write.bits(mirror_v))
    return {"us": _per_call_us(lambda: kv_write.write_kv(k, v, slots, paged, mirror), calls, repeats)}


def _decode_attention(rows: int, dtype: torch.dtype, calls: int, repeats: int) -> dict:
    k_buf, v_buf = torch.randn(2, rows, KV_HEADS, CONTEXT + 16, HEAD_DIM).to(dtype)
    q = torch.randn(rows, KV_HEADS, GROUPS, HEAD_DIM).to(dtype)
    index, counts = torch.arange(rows), torch.full((rows,), CONTEXT)
    scale = HEAD_DIM**-0.5
    return {
        "us": _per_call_us(lambda: decode_attention._arguments(q, k_buf, v_buf, index, counts, scale), calls, repeats),
        "kernel_us": _per_call_us(
            lambda: decode_attention.mirror_decode_attention(q, k_buf, v_buf, index, counts, scale),
            max(1, calls // 10), repeats,
        ),
    }


def run(dtype: str, rows: list[int], calls: int, repeats: int) -> list[dict]:
    torch_dtype = getattr(torch, dtype)
    if not (kv_write.prepare(torch_dtype) and decode_attention.prepare(1, torch_dtype)):
        raise SystemExit("the KV write or decode attention kernel cannot run here (numba missing, or a check failed)")
    gemm = torch_dtype == torch.bfloat16 and bf16_gemm.prepare(1)
    lines = []
    with torch.inference_mode():
        for n in rows:
            ops = {}
            if gemm:
                ops["linear"] = _linear(n, calls, repeats)
            ops["kv_write"] = _kv_write(n, torch_dtype, calls, repeats)
            ops["decode_attention_args"] = _decode_attention(n, torch_dtype, calls, repeats)
            lines += [{"bench": "call", "op": op, "rows": n, "dtype": dtype, **t} for op, t in ops.items()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the median is printed")
    parser.add_argument("--cpu", type=int, default=0, help="pin this process to CPU")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    for line in run(args.dtype, args.rows, args.calls, args.repeats):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
