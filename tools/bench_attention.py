"""Decode attention against the memory it reads: SDPA over KV-mirror-shaped keys and values.

Shapes are the default model's decode step on the throughput workload: 64 sequences,
4 kv heads of 2 query heads each, head_dim 64, 176 positions attended out of a mirror
row of 208, 8 layers. One JSON line per case, milliseconds per layer (median of 7):
  sdpa_cycled:    F.scaled_dot_product_attention, the 8 layers' buffers taken in turn,
                  as a decode step does (each layer's keys come from memory);
  sdpa_one_layer: the same on one layer's buffer over and over (it stays in cache);
  bmm:            q @ k^T, softmax in float32, @ v as two batched matmuls, cycled;
  kernel:         models/decode_attention.py's numba kernel (what decode steps use), cycled;
  copy_kv:        only copying the same keys and values out, cycled: the read floor
                  an attention kernel that streams the mirror once would approach.
Then one line per thread count with a large tensor's read bandwidth (a float32 sum).
Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from models.decode_attention import mirror_decode_attention

ROWS, KV_HEADS, GROUPS, HEAD_DIM, LENGTH, LEN_CAP, LAYERS = 64, 4, 2, 64, 176, 208, 8


def _ms_per_call(fn: Callable[[int], object], layers: int, repeats: int = 7, rounds: int = 5) -> float:
    for i in range(layers * 3):
        fn(i % layers)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(rounds):
            for i in range(layers):
                fn(i)
        times.append((time.perf_counter() - start) / (rounds * layers))
    return 1e3 * statistics.median(times)


def attention_cases(dtype: torch.dtype) -> list[dict]:
    # Mirror layout: [2 (k, v), rows, kv_heads, len_cap, head_dim], attended over [:LENGTH].
    kv = [torch.randn(2, ROWS, KV_HEADS, LEN_CAP, HEAD_DIM, dtype=dtype) for _ in range(LAYERS)]
    q = [torch.randn(ROWS, KV_HEADS, GROUPS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS)]
    mask = torch.ones(ROWS, 1, 1, LENGTH, dtype=torch.bool)
    mask[: ROWS // 8, ..., LENGTH - 30 :] = False  # some shorter sequences, as in a real step
    additive = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    scale = HEAD_DIM**-0.5
    out = torch.empty(2, ROWS, KV_HEADS, LENGTH, HEAD_DIM, dtype=dtype)

    def sdpa(i: int) -> torch.Tensor:
        k, v = kv[i][0, :, :, :LENGTH], kv[i][1, :, :, :LENGTH]
        return F.scaled_dot_product_attention(q[i], k, v, attn_mask=mask, scale=scale)

    def bmm(i: int) -> torch.Tensor:
        k, v = kv[i][0, :, :, :LENGTH], kv[i][1, :, :, :LENGTH]
        scores = torch.matmul(q[i], k.transpose(-1, -2)).float().mul_(scale).add_(additive)
        return torch.matmul(scores.softmax(-1).to(dtype), v)

    rows = torch.arange(ROWS)
    counts = mask[:, 0, 0].sum(-1)

    def kernel(i: int) -> torch.Tensor:
        return mirror_decode_attention(q[i], kv[i][0], kv[i][1], rows, counts, scale)

    expected = sdpa(0).float()
    for got in (bmm(0).float(), kernel(0).float()):
        assert torch.allclose(got, expected, atol=0.05, rtol=0.05), (got - expected).abs().max()
    cases = {
        "sdpa_cycled": _ms_per_call(sdpa, LAYERS),
        "sdpa_one_layer": _ms_per_call(lambda i: sdpa(0), LAYERS),
        "bmm": _ms_per_call(bmm, LAYERS),
        "kernel": _ms_per_call(kernel, LAYERS),
        "copy_kv": _ms_per_call(lambda i: out.copy_(kv[i][:, :, :, :LENGTH]), LAYERS),
    }
    kv_mb = out.numel() * out.element_size() / 1e6
    return [
        {"bench": "attention", "case": name, "dtype": str(dtype).removeprefix("torch."), "kv_mb_per_layer": round(kv_mb, 1),
         "ms_per_layer": round(ms, 3)}
        for name, ms in cases.items()
    ]


def read_bandwidth(threads: int, mb: int = 512) -> dict:
    torch.set_num_threads(threads)
    x = torch.randn(mb * 2**20 // 4)
    ms = _ms_per_call(lambda i: x.sum(), 1)
    return {"bench": "read_bandwidth", "threads": threads, "mb": mb, "gb_per_s": round(mb * 2**20 / ms / 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts for the bandwidth lines")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for line in attention_cases(getattr(torch, args.dtype)):
        print(json.dumps(line), flush=True)
    for threads in args.threads:
        print(json.dumps(read_bandwidth(threads)), flush=True)


if __name__ == "__main__":
    main()
