"""tools/bench_step.py --parts: each part of a decode step timed on its own, callees left out."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from models import kv_cache, llama, prepack
from models import worker as worker_module
from tools import bench_step

PARTS = {"linears", "lm_head", "decode_attention", "kv_writes", "rms_norm", "rotary", "argmax", "step_inputs", "other"}


def test_a_part_counts_its_own_time_not_its_callees():
    timers = bench_step.StepParts()

    def inner() -> None:
        time.sleep(0.05)

    timed_inner = timers._timed("inner", inner)

    def outer_named(name: str) -> None:
        time.sleep(0.02)
        timed_inner()

    # A part may also be named from the call's arguments, as the projections are.
    timed_outer = timers._timed(lambda args: args[0], outer_named)
    timed_outer("outer")  # timing is off: nothing is counted
    assert not timers.seconds
    timers.timing = True
    timed_outer("outer")
    timed_outer("outer")
    assert 0.1 <= timers.seconds["inner"] < 0.2
    # Without the 0.1 s of inner, which the inclusive time would hold.
    assert 0.04 <= timers.seconds["outer"] < 0.09
    assert timers.per_step(2) == {
        "inner": round(1e3 * timers.seconds["inner"] / 2, 3),
        "outer": round(1e3 * timers.seconds["outer"] / 2, 3),
    }


def _timed_functions() -> tuple:
    """The model's functions that --parts wraps, as they are now."""
    return (
        prepack.PackedLinear.forward,
        nn.Linear.forward,
        kv_cache.LayerKV.write,
        kv_cache.LayerKV.decode_attention,
        llama.RMSNorm.forward,
        llama._rotate,
        llama.rotary_cos_sin,
        llama.row_argmax,
        worker_module.prepare_step,
        worker_module.LlamaWorker.execute_model,
    )


def test_parts_of_real_decode_steps_and_the_model_left_as_it_was():
    originals = _timed_functions()
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        # 4 prompts, 14 tokens each: the first comes from the prompt step, then 13 decode
        # steps, the last 3 of them timed.
        line = bench_step.run(
            1, [min(cpus)], "float32", 256, False, parts=True, num_prompts=4, output_len=14
        )
    finally:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
    assert line["decode_steps"] == 13
    # Of this workload (4 x 14 tokens), not the default one.
    assert abs(line["output_tokens_per_s"] - 4 * 14 / line["total_s"]) <= 0.01 * line["output_tokens_per_s"] + 0.1
    assert line["parts_steps"] == 13 - bench_step.PARTS_FROM_STEP
    parts = line["parts_ms_per_step"]
    assert set(parts) == PARTS
    assert all(ms > 0 for ms in parts.values()), parts
    # The decoder layers' 56 projections outweigh the head's one over 4 rows.
    assert parts["linears"] > parts["lm_head"]
    assert list(parts.values()) == sorted(parts.values(), reverse=True)
    assert _timed_functions() == originals
