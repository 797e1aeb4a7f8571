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
    x = None
    runs_done = [0]

    def inputs() -> tuple:
        n = runs_done[0]
        runs_done[0] += 1
        if shape == "decode":
            chunks = [SequenceChunk(i, [7], context + n, tables[i]) for i in range(rows)]
        else:  # prompt: `rows` tokens in whole prompts of `context` tokens
            chunks = [SequenceChunk(i, [7] * context, 0, tables[i]) for i in range(rows // context)]
        step = prepare_step(ModelBatch(n, chunks), block_size=BLOCK, num_blocks=num_blocks, vocab_size=args.vocab_size)
        cos, sin = rotary_cos_sin(step.positions, stage.inv_freq, torch_dtype)
        return step, cos, sin

    with torch.inference_mode():
        step, cos, sin = inputs()
        x = torch.randn(step.num_tokens, args.hidden_size).to(torch_dtype)
        if shape == "decode":  # the mirror starts holding every row's context
            cache.begin_step(step)
            layer(x, cos, sin, step, kv_cache)
            cache.end_step(step)

        def timed(part: Callable[[tuple], object]) -> Callable[[int], object]:
            def one(_: int) -> None:
                step, cos, sin = inputs()  # built outside the timed part
                cache.begin_step(step)
                start = time.perf_counter()
                part((step, cos, sin))
                elapsed[0] += time.perf_counter() - start
                cache.end_step(step)
            return one

        results = {}
        for name, part in (
            ("layer", lambda a: layer(x, *a[1:], a[0], kv_cache)),
            ("kv", lambda a: kv_cache.write(*layer.input_kv(x, a[1], a[2])[1], a[0].slot_mapping)),
            ("attention_half", lambda a: layer.attention_half(x, a[1], a[2], a[0], kv_cache)),
            ("mlp_half", lambda a: layer.mlp_half(x)),
        ):
            elapsed = [0.0]
            samples = []
            fn = timed(part)
            for i in range(reps + 3):
                elapsed[0] = 0.0
                fn(i)
                if i >= 3:
                    samples.append(elapsed[0])
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
