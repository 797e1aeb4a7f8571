"""tools/bench_norm_rope.py: the whole model's steps timed with the norm and rotary kernels and without, alternating."""

from __future__ import annotations

import importlib.util

import pytest

from models import norm_rope
from tools import bench_norm_rope

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba not installed")


def test_one_line_per_shape_with_both_ways_timed(monkeypatch):
    calls = {True: 0, False: 0}
    run_rotary = norm_rope._run_rotary
    norm_rope.prepare()  # its check calls _run_rotary too: built before the count starts

    def counted(*args):  # noqa: ANN002 - passes through
        calls[norm_rope.enabled()] += 1
        return run_rotary(*args)

    monkeypatch.setattr(norm_rope, "_run_rotary", counted)
    lines = bench_norm_rope.run("float32", reps=1)
    assert [(line["shape"], line["rows"]) for line in lines] == [("prompt", 512), ("decode", 32), ("decode", 64)]
    for line in lines:
        assert line["bench"] == "norm_rope" and line["dtype"] == "float32"
        assert line["kernels_ms"] > 0 and line["torch_ops_ms"] > 0
        assert line["saved"] == round(1 - line["kernels_ms"] / line["torch_ops_ms"], 3)
    # The kernels ran on the steps timed with them only, and are on again afterwards.
    assert calls[True] > 0 and calls[False] == 0 and norm_rope.enabled()


def test_ops_mode_times_each_op_both_ways_per_row_count():
    lines = bench_norm_rope.run_ops("float32", calls=3)
    assert [line["rows"] for line in lines] == [1, 32, 64, 512]
    for line in lines:
        assert line["bench"] == "norm_rope_ops" and line["dtype"] == "float32"
        assert len(line["norm_us"]) == len(line["rotary_us"]) == 2
        assert min(line["norm_us"] + line["rotary_us"]) > 0
    assert norm_rope.enabled()
