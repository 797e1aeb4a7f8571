"""tools/bench_matmul.py's --model-rows mode: every linear of the default model, cold weights, per row count."""

from __future__ import annotations

import json
import os

import pytest
import torch

from models.default_model import default_model_dir
from models.prepack import prepack_supported
from tools import bench_matmul

pytestmark = pytest.mark.skipif(not prepack_supported(torch.float32, "cpu"), reason="this torch build has no oneDNN packing")


def test_model_linears_cover_every_weight_of_the_default_model():
    from safetensors import safe_open

    # Counted from the checkpoint itself: every projection and the LM head (the embedding is a lookup).
    with safe_open(os.path.join(default_model_dir(), "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if n.endswith("proj.weight") or n == "lm_head.weight"]
        params = sum(f.get_slice(n).get_shape()[0] * f.get_slice(n).get_shape()[1] for n in names)
    lines = bench_matmul.bench_model_linears(torch.float32, [1, 3], repeats=1)
    assert [line["rows"] for line in lines] == [1, 3]
    for line in lines:
        assert line["weights"] == len(names)
        assert line["weights_mb"] == round(4 * params / 2**20, 1)
        assert line["ms"] > 0 and line["gflops"] > 0
        # The figures agree with each other: the FLOPs of `rows` rows over the weights in `ms`.
        assert abs(line["gflops"] - 2 * line["rows"] * params / (line["ms"] * 1e6)) <= 0.02 * line["gflops"] + 0.2


def test_model_rows_prints_one_json_line_per_row_count(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench_matmul.py", "--model-rows", "2", "--dtypes", "float32", "--repeats", "1"])
    threads = torch.get_num_threads()
    try:
        bench_matmul.main()
    finally:
        torch.set_num_threads(threads)  # main() sets this process's count
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["bench"], line["rows"], line["dtype"]) for line in lines] == [("model_linears", 2, "float32")]


def test_together_times_the_matmul_alone_then_on_every_cpu_at_once(monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    cpus = [cpus[0], cpus[-1]]  # one CPU twice on a one-core machine: then it cannot scale
    monkeypatch.setattr(bench_matmul, "TOGETHER_START_S", 3.0)
    line = bench_matmul.together(cpus, "float32", [8, 64, 64], iters=20, repeats=2)
    assert line["bench"] == "matmul_scaling" and line["cpus"] == cpus and line["dtype"] == "float32"
    assert line["alone_gflops"] > 0 and len(line["together_gflops"]) == 2 and min(line["together_gflops"]) > 0
    assert line["scaling"] == round(sum(line["together_gflops"]) / line["alone_gflops"], 3)


def test_together_fails_on_a_cpu_it_cannot_pin_to(monkeypatch):
    # The module's check afterwards finds no child left (the others are killed on the way out).
    monkeypatch.setattr(bench_matmul, "TOGETHER_START_S", 0.0)
    with pytest.raises(RuntimeError, match="exited with"):
        bench_matmul.together([sorted(os.sched_getaffinity(0))[0], 10**6], "float32", [8, 64, 64], iters=5, repeats=1)
