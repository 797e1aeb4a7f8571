"""tools/bench_throughput.py: its engine switches, the workload's FLOP count, the median and targets lines, and a real run."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import subprocess
import sys

import pytest

from scheduling import LLM
from tools import bench_throughput


def parser_with_switches() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    bench_throughput.add_engine_switches(parser)
    for name in ("--dtype", "--max-num-batched-tokens", "--layer-split", "--kv-mirror-mb"):
        parser.add_argument(name)
    for name, default in (("--num-prompts", 64), ("--input-len", 128), ("--output-len", 64)):
        parser.add_argument(name, type=int, default=default)
    return parser


def test_every_switch_turns_off_an_option_that_llm_takes_and_defaults_on():
    defaults = inspect.signature(LLM.__init__).parameters
    for flag, option, _ in bench_throughput.ENGINE_SWITCHES:
        assert defaults[option].default is True, option
        args = parser_with_switches().parse_args([flag])
        assert bench_throughput.switched_off(args) == {option: False}
    assert bench_throughput.switched_off(parser_with_switches().parse_args([])) == {}


def test_the_switches_reach_each_configuration_s_own_process_unchanged():
    flags = [flag for flag, _, _ in bench_throughput.ENGINE_SWITCHES]
    args = parser_with_switches().parse_args(["--dtype", "bfloat16", *flags])
    forwarded = bench_throughput._forwarded(args)
    workload = ["--num-prompts", "64", "--input-len", "128", "--output-len", "64"]
    assert forwarded == ["--dtype", "bfloat16", *workload, *flags]
    again = parser_with_switches().parse_args(forwarded)
    assert bench_throughput.switched_off(again) == bench_throughput.switched_off(args)


def test_the_workload_flops_count_every_linear_attention_and_the_lm_head_of_the_model():
    import torch
    from transformers import LlamaForCausalLM

    from models.config import LlamaArgs
    from models.default_model import default_model_config

    config = default_model_config()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Counted from transformers' own modules: every nn.Linear in the layers, and the head.
    layer_params = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    head_params = model.lm_head.weight.numel()
    shape = bench_throughput.Workload(num_prompts=3, input_len=5, output_len=4)
    fed = 5 + 4 - 1  # the last output token is sampled, never fed
    scores = config.num_hidden_layers * 4 * config.num_attention_heads * config.head_dim * sum(range(1, fed + 1))
    expected = 3 * (2 * layer_params * fed + scores + 2 * head_params * 4)

    args = LlamaArgs.from_dict(config.to_dict())
    assert bench_throughput.workload_flops(args, shape) == pytest.approx(expected, rel=1e-12)
    # The workload on the default model: the 0.72 TFLOP that
    # ../shared/reference/machine.md counts from linears alone, plus attention's 2%.
    assert 0.72e12 < bench_throughput.workload_flops(args) < 0.75e12


def _run(config: str, round_: int, speed: float, **extra) -> dict:
    elapsed = 64 * 64 / speed
    return {"config": config, "tp": 1, "pp": 2 if config.startswith("pp2") else 1, "round": round_, "elapsed_s": elapsed,
            "requests_per_s": 64 / elapsed, "output_tokens_per_s": speed, "total_tokens_per_s": 3 * speed,
            "startup_s": 2.0 + round_, "peak_rss_mb": 500.0 + round_, "workload_gflop": 730.0,
            "gflops": 730.0 / elapsed, "stage_busy_s": [1.0, 2.0], **extra}


def test_median_lines_and_the_targets_line():
    runs = [
        _run("pp2", 0, 1300.0), _run("pp2_inflight1", 0, 700.0), _run("tp2", 0, 1250.0), _run("hf_baseline", 0, 600.0),
        _run("hf_baseline", 1, 620.0), _run("tp2", 1, 1400.0), _run("pp2_inflight1", 1, 650.0), _run("pp2", 1, 1200.0),
        _run("pp2", 2, 1350.0), _run("pp2_inflight1", 2, 690.0), _run("tp2", 2, 1310.0), _run("hf_baseline", 2, 590.0),
    ]

    medians = bench_throughput.median_lines(runs)

    assert [m["config"] for m in medians] == ["pp2", "pp2_inflight1", "tp2", "hf_baseline"]
    pp2 = medians[0]
    assert pp2["statistic"] == "median" and pp2["runs"] == 3
    assert pp2["output_tokens_per_s"] == 1300.0 and pp2["output_tokens_per_s_range"] == [1200.0, 1350.0]
    assert pp2["startup_s"] == 3.0 and pp2["startup_s_range"] == [2.0, 4.0]
    assert pp2["peak_rss_mb"] == 502.0  # the largest, not a median
    assert pp2["elapsed_s"] == pytest.approx(64 * 64 / 1300.0, abs=1e-3)
    assert "round" not in pp2 and "stage_busy_s" not in pp2  # one run's own figures

    summary = bench_throughput.targets(runs, medians, roof_gflops=390.0)

    assert summary["summary"] == "targets" and summary["runs"] == 3
    assert summary["pp2_overlap"] == pytest.approx(1300 / 690, abs=1e-3)  # of the medians
    assert summary["pp2_overlap_by_round"] == [pytest.approx(r, abs=1e-3) for r in (1300 / 700, 1200 / 650, 1350 / 690)]
    assert summary["best_config"] == "tp2"  # 1310 at the median; the baseline never counts as a layout
    assert summary["best_over_baseline"] == pytest.approx(1310 / 600, abs=1e-3)
    assert summary["best_gflops"] == pytest.approx(730.0 / (64 * 64 / 1310.0), abs=0.01)
    assert summary["best_roof_fraction"] == pytest.approx(summary["best_gflops"] / 390.0, abs=1e-3)


def test_the_targets_line_leaves_out_what_did_not_run():
    runs = [_run("tp2", 0, 1250.0), _run("tp2", 1, 1300.0)]
    summary = bench_throughput.targets(runs, bench_throughput.median_lines(runs))
    assert summary["best_config"] == "tp2"
    for missing in ("pp2_overlap", "best_over_baseline", "roof_gflops", "best_roof_fraction"):
        assert missing not in summary


def test_a_measured_roof_is_the_sum_of_every_cpu_at_once_and_goes_into_the_targets_line(monkeypatch):
    monkeypatch.setattr("bench_matmul.TOGETHER_START_S", 3.0)
    roof = bench_throughput.measure_roof("float32", shape=(8, 64, 64), iters=20, repeats=2)
    cpus = sorted(os.sched_getaffinity(0))
    assert roof["cpus"] == cpus and len(roof["together_gflops"]) == len(cpus) and "bench" not in roof
    assert roof["roof_gflops"] == pytest.approx(sum(roof["together_gflops"]), abs=0.1) and roof["alone_gflops"] > 0
    runs = [_run("tp2", 0, 1250.0), _run("tp2", 1, 1300.0)]
    summary = bench_throughput.targets(runs, bench_throughput.median_lines(runs), roof=roof)
    assert summary["roof_gflops"] == roof["roof_gflops"] and summary["roof"] == roof
    assert summary["best_roof_fraction"] == pytest.approx(summary["best_gflops"] / roof["roof_gflops"], abs=1e-3)


def test_the_roof_is_a_positive_figure_or_auto():
    assert bench_throughput._roof_arg("auto") == "auto" and bench_throughput._roof_arg("390") == 390.0
    for bad in ("0", "-5", "fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_throughput._roof_arg(bad)


def test_plot_without_matplotlib_is_a_usage_error_before_anything_runs(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    monkeypatch.setattr(bench_throughput, "_run_one", lambda *a: pytest.fail("a configuration ran"))
    monkeypatch.setattr(sys, "argv", ["bench_throughput.py", "--configs", "tp2", "--plot", "chart.png"])
    with pytest.raises(SystemExit) as exc:
        bench_throughput.main()
    assert exc.value.code == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_repeated_runs_interleave_and_end_with_medians_and_targets(script_env, tmp_path):
    chart = tmp_path / "chart.png"
    # The chart only where the plot extra is installed (CI installs the test extra alone).
    plotting = importlib.util.find_spec("matplotlib") is not None
    script = os.path.join(os.getcwd(), "tools", "bench_throughput.py")
    small = ["--num-prompts", "3", "--input-len", "8", "--output-len", "3"]
    proc = subprocess.run(
        [sys.executable, script, "--configs", "tp1_1thread", "hf_baseline", "--repeats", "2", "--roof-gflops", "100",
         *(["--plot", str(chart)] if plotting else []), *small],
        env=script_env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    runs, medians, summary = lines[:4], lines[4:6], lines[6]
    assert len(lines) == 7
    # The second round runs the configurations in reverse order.
    assert [(r["config"], r["round"]) for r in runs] == [
        ("tp1_1thread", 0), ("hf_baseline", 0), ("hf_baseline", 1), ("tp1_1thread", 1)
    ]
    for run in runs:
        assert (run["num_prompts"], run["input_len"], run["output_len"]) == (3, 8, 3)
        # elapsed_s is rounded to the millisecond, which on a run of tens of ms is more than 2%:
        # compare in seconds, within that rounding.
        assert 9 / run["output_tokens_per_s"] == pytest.approx(run["elapsed_s"], rel=0.001, abs=0.0006)
    assert [m["config"] for m in medians] == ["tp1_1thread", "hf_baseline"]
    for median in medians:
        own = [r["output_tokens_per_s"] for r in runs if r["config"] == median["config"]]
        assert median["runs"] == 2 and median["output_tokens_per_s_range"] == sorted(own)
        assert median["output_tokens_per_s"] == pytest.approx(sum(own) / 2, abs=0.01)  # two runs: their mean
    speeds = {m["config"]: m["output_tokens_per_s"] for m in medians}
    assert summary["best_config"] == "tp1_1thread"
    assert summary["best_over_baseline"] == pytest.approx(speeds["tp1_1thread"] / speeds["hf_baseline"], abs=1e-3)
    assert summary["best_roof_fraction"] == pytest.approx(medians[0]["gflops"] / 100, abs=1e-3)
    assert chart.exists() == plotting and (not plotting or chart.stat().st_size > 0)
