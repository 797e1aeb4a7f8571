"""The whole default model's step times with and without the RMSNorm and rotary kernels (models/norm_rope.py).

Runs the default model in this process (one thread unless `--threads`, packed weights, freed memory kept,
the KV mirror and the decode-attention kernel as the engine sets them) and alternates, step by step,
between the kernels and torch's ops (`norm_rope.set_enabled`), so both see the same
machine. Prints one JSON line per step shape:

  {"bench": "norm_rope", "dtype": "bfloat16", "shape": "decode", "rows": 32,
   "kernels_ms": ..., "torch_ops_ms": ..., "saved": 0.035}

Shapes: decode steps of 32 and 64 rows (PP2's batches with two and one in flight on the
throughput workload) over contexts from 128 positions up, and 512-token prompt steps of
128-token prompts. Medians of `--reps` steps each way. `--ops` times the ops alone
instead, per call: one RMSNorm of [rows, hidden] and the rotation of one step's queries
and keys, torch's ops against the kernels, for 1, 32, 64 and 512 rows:

  {"bench": "norm_rope_ops", "dtype": "bfloat16", "rows": 32, "norm_us": [torch, kernel],
   "rotary_us": [torch, kernel]}

Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from models import argmax, decode_attention, norm_rope  # noqa: E402
from models.batch import ModelBatch, SequenceChunk  # noqa: E402
from models.config import Layout, load_config, resolve_dtype  # noqa: E402
from models.default_model import default_model_dir  # noqa: E402
from models.host_memory import keep_freed_memory  # noqa: E402
from models.kv_cache import PagedKVCache  # noqa: E402
from models.llama import RMSNorm, apply_rotary, rotary_cos_sin, rope_inv_freq  # noqa: E402
from models.loader import load_stage  # noqa: E402
from models.prepack import prepack_stage  # noqa: E402
from models.step import prepare_step  # noqa: E402

BLOCK = 16
PROMPT_LEN = 128
MAX_ROWS = 64
WARMUP = 3


def run(dtype: str, reps: int) -> list[dict]:
    path = default_model_dir()
    args = load_config(path)
    torch_dtype = resolve_dtype(dtype, args)
    if not norm_rope.prepare():
        raise SystemExit("the norm and rotary kernels cannot run here (numba missing, or their check failed)")
    decode_attention.prepare(1)
    argmax.prepare()
    layout = Layout(args)
    stage, _ = load_stage(layout, path, torch_dtype)
    prepack_stage(stage)
    decode_steps = 2 * 2 * (reps + WARMUP)  # two shapes, each way
    blocks = -(-(PROMPT_LEN + decode_steps + 1) // BLOCK)
    num_blocks = MAX_ROWS * blocks
    cache = PagedKVCache(
        layout.cache_layers, num_blocks, BLOCK, layout.num_local_kv_heads, args.head_dim, torch_dtype,
        mirror_bytes=256 * 2**20, mirror_entries=1,
    )
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(MAX_ROWS)]
    batch_id = 0

    def step_ms(chunks: list[SequenceChunk]) -> float:
        nonlocal batch_id
        step = prepare_step(ModelBatch(batch_id, chunks), block_size=BLOCK, num_blocks=num_blocks, vocab_size=args.vocab_size)
        batch_id += 1
        start = time.perf_counter()
        h = stage(step.token_ids, step, cache)
        stage.greedy_tokens(h[step.sample_rows])
        return 1e3 * (time.perf_counter() - start)

    def prompts(first: int) -> list[SequenceChunk]:
        return [SequenceChunk(i, [7] * PROMPT_LEN, 0, tables[i]) for i in range(first, first + 4)]

    def compare(shape: str, rows: int, make) -> dict:  # noqa: ANN001 - chunks for the n-th step
        times: dict[bool, list[float]] = {True: [], False: []}
        try:
            for n in range(reps + WARMUP):
                for on in (True, False) if n % 2 == 0 else (False, True):
                    norm_rope.set_enabled(on)
                    ms = step_ms(make())
                    if n >= WARMUP:
                        times[on].append(ms)
        finally:
            norm_rope.set_enabled(True)
        # The share saved from the figures as printed, so that a reader gets the same from them.
        kernels, ops = round(statistics.median(times[True]), 2), round(statistics.median(times[False]), 2)
        return {
            "bench": "norm_rope",
            "dtype": str(torch_dtype).removeprefix("torch."),
            "shape": shape,
            "rows": rows,
            "kernels_ms": kernels,
            "torch_ops_ms": ops,
            "saved": round(1 - kernels / ops, 3),
        }

    lines = []
    with torch.inference_mode():
        # Prompt steps rewrite the same four sequences' slots; then every sequence gets its prompt.
        lines.append(compare("prompt", 4 * PROMPT_LEN, lambda: prompts(0)))
        for first in range(0, MAX_ROWS, 4):
            step_ms(prompts(first))
        position = PROMPT_LEN
        for rows in (32, MAX_ROWS):
            def decode(rows: int = rows) -> list[SequenceChunk]:
                nonlocal position
                position += 1
                return [SequenceChunk(i, [7], position - 1, tables[i]) for i in range(rows)]

            lines.append(compare("decode", rows, decode))
    return lines


def _call_us(fn, calls: int) -> float:  # noqa: ANN001 - a no-argument callable
    """Median over 5 rounds of the time per call, in microseconds."""
    for _ in range(20):
        fn()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append(1e6 * (time.perf_counter() - start) / calls)
    return round(statistics.median(rounds), 1)


def run_ops(dtype: str, calls: int = 500) -> list[dict]:
    """Per call: the default model's RMSNorm and rotation of queries and keys, torch's ops against the kernels."""
    args = load_config(default_model_dir())
    torch_dtype = resolve_dtype(dtype, args)
    if not norm_rope.prepare():
        raise SystemExit("the norm and rotary kernels cannot run here (numba missing, or their check failed)")
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(args.hidden_size, args.rms_norm_eps).to(torch_dtype)
    lines = []
    with torch.inference_mode():
        for rows in (1, 32, 64, 512):
            x = torch.randn(rows, args.hidden_size, generator=g).to(torch_dtype)
            q = torch.randn(rows, args.num_attention_heads, args.head_dim, generator=g).to(torch_dtype)
            k = torch.randn(rows, args.num_key_value_heads, args.head_dim, generator=g).to(torch_dtype)
            cos, sin = rotary_cos_sin(torch.arange(128, 128 + rows), rope_inv_freq(args), torch_dtype)
            times = {}
            try:
                for on in (False, True):
                    norm_rope.set_enabled(on)
                    if on:  # in place: rotating the same tensors again and again costs the same
                        rotate = lambda: (norm_rope.rotate_(q, cos, sin), norm_rope.rotate_(k, cos, sin))  # noqa: E731
                    else:
                        rotate = lambda: (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))  # noqa: E731
                    times[on] = (_call_us(lambda: norm(x), calls), _call_us(rotate, calls))
            finally:
                norm_rope.set_enabled(True)
            lines.append({
                "bench": "norm_rope_ops",
                "dtype": str(torch_dtype).removeprefix("torch."),
                "rows": rows,
                "norm_us": [times[False][0], times[True][0]],
                "rotary_us": [times[False][1], times[True][1]],
            })
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=30, help="steps each way per shape")
    parser.add_argument("--cpu", type=int, default=0, help="the first CPU to pin this process to")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, pinned to CPUs --cpu onwards (the kernels run on one)")
    parser.add_argument("--ops", action="store_true", help="time the ops alone, per call, instead of whole steps")
    args = parser.parse_args()
    os.sched_setaffinity(0, set(range(args.cpu, args.cpu + args.threads)))
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as a rank does (models/host_memory.py): torch's temporaries reuse warm pages
    for line in run_ops(args.dtype) if args.ops else run(args.dtype, args.reps):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
