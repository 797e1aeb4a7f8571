"""Where one decoder layer's time goes: its keys and values, its attention half, its MLP half.

The shares the pipeline's boundary cost model uses (models.config: DECODE_MLP_SHARE,
PROMPT_MLP_SHARE, DECODE_KV_SHARE, PROMPT_KV_SHARE). Runs layer 0 of the default model
in this process (one thread, packed weights, the KV mirror and decode kernel as the
engine sets them) on the throughput workload's two step shapes, and prints one JSON
line per shape:

  {"bench": "layer_parts", "shape": "decode", "rows": 32, "context": 160, "layer_ms": ...,
   "kv_ms": ..., "attention_half_ms": ..., "mlp_half_ms": ..., "kv_share": ..., "mlp_share": ...}

kv is what a pipeline stage still does for a layer it lends whole to the next stage:
the input norm, the key and value projections, rotating the keys, writing the cache.
Medians of `--reps` runs. Run it alone on the machine.
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

from models.batch import ModelBatch, SequenceChunk  # noqa: E402
from models.config import Layout, load_config, resolve_dtype  # noqa: E402
from models.default_model import default_model_dir  # noqa: E402
from models.kv_cache import PagedKVCache  # noqa: E402
from models.llama import rotary_cos_sin  # noqa: E402
from models.loader import load_stage  # noqa: E402
from models.prepack import prepack_stage  # noqa: E402
from models.step import prepare_step  # noqa: E402

BLOCK = 16


def run(shape: str, rows: int, context: int, dtype: str, reps: int) -> dict:
    path = default_model_dir()
    args = load_config(path)
    torch_dtype = resolve_dtype(dtype, args)
    layout = Layout(args)
    stage, _ = load_stage(layout, path, torch_dtype)
    prepack_stage(stage)
    layer = stage.layers["0"]
    # Decode steps advance one position per run (so the mirror holds each row's context,
    # as in a running decode, instead of refilling it); prompt steps repeat.
    runs = 4 * (reps + 3) + 1  # four parts timed, each after 3 warm-up runs, and the first fill
    blocks = -(-(context + runs + 1) // BLOCK)
    num_blocks = rows * blocks
    cache = PagedKVCache(
        [0], num_blocks, BLOCK, layout.num_local_kv_heads, args.head_dim, torch_dtype,
        mirror_bytes=256 * 2**20, mirror_entries=1,
    )
    kv_cache = cache.layer(0)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(rows)]

    def inputs(n: int) -> tuple:
        """Run n's step and its rotary tables."""
        if shape == "decode":
            chunks = [SequenceChunk(i, [7], context + n, tables[i]) for i in range(rows)]
        else:  # prompt: `rows` tokens in whole prompts of `context` tokens
            chunks = [SequenceChunk(i, [7] * context, 0, tables[i]) for i in range(rows // context)]
        step = prepare_step(ModelBatch(n, chunks), block_size=BLOCK, num_blocks=num_blocks, vocab_size=args.vocab_size)
        return (step, *rotary_cos_sin(step.positions, stage.inv_freq, torch_dtype))

    parts: dict[str, Callable[..., object]] = {
        "layer": lambda step, cos, sin: layer(x, cos, sin, step, kv_cache),
        "kv": lambda step, cos, sin: kv_cache.write(*layer.input_kv(x, cos, sin)[1], step.slot_mapping, step.decode),
        "attention_half": lambda step, cos, sin: layer.attention_half(x, cos, sin, step, kv_cache),
        "mlp_half": lambda step, cos, sin: layer.mlp_half(x),
    }
    results = {}
    with torch.inference_mode():
        step, cos, sin = inputs(0)
        x = torch.randn(step.num_tokens, args.hidden_size).to(torch_dtype)
        if shape == "decode":  # the mirror starts holding every row's context
            cache.begin_step(step)
            layer(x, cos, sin, step, kv_cache)
            cache.end_step(step)
        n = 1
        for name, part in parts.items():
            samples = []
            for i in range(reps + 3):  # 3 warm-up runs
                step, cos, sin = inputs(n)  # built outside the timed part
                n += 1
                cache.begin_step(step)
                start = time.perf_counter()
                part(step, cos, sin)
                elapsed = time.perf_counter() - start
                cache.end_step(step)
                if i >= 3:
                    samples.append(elapsed)
            results[name] = round(1e3 * statistics.median(samples), 3)
    return {
        "bench": "layer_parts",
        "shape": shape,
        "rows": int(x.shape[0]),
        "context": context,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "layer_ms": results["layer"],
        "kv_ms": results["kv"],
        "attention_half_ms": results["attention_half"],
        "mlp_half_ms": results["mlp_half"],
        "kv_share": round(results["kv"] / results["layer"], 3),
        "mlp_share": round(results["mlp_half"] / results["layer"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--cpu", type=int, default=0, help="the CPU to pin this process to")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    # The throughput workload's steps: 32-row decode batches (PP2's two in flight) over
    # ~160 positions, and 512-token prompt steps of 128-token prompts.
    for shape, rows, context in (("decode", 32, 160), ("prompt", 512, 128)):
        print(json.dumps(run(shape, rows, context, args.dtype, args.reps)), flush=True)


if __name__ == "__main__":
    main()
