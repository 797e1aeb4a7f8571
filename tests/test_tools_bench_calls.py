"""tools/bench_calls.py: one line per hot-path kernel call and row count, each a positive per-call time."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from models import bf16_gemm
from tools import bench_calls

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba not installed")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_line_per_call_and_row_count(dtype):
    before = torch.get_num_threads()
    lines = bench_calls.run(dtype, [1, 8], calls=5, repeats=2)
    assert torch.get_num_threads() == before  # run() leaves the process's threads alone
    ops = ["kv_write", "decode_attention_args"]
    if dtype == "bfloat16" and bf16_gemm.prepare(1):  # the GEMM kernel needs avx512_bf16
        ops = ["linear", *ops]
    assert [(line["op"], line["rows"]) for line in lines] == [(op, n) for n in (1, 8) for op in ops]
    for line in lines:
        assert line["bench"] == "call" and line["dtype"] == dtype and line["us"] > 0
        assert ("kernel_us" in line) == (line["op"] != "kv_write")
        if "kernel_us" in line:
            assert line["kernel_us"] > 0
