"""Offline throughput of each parallel layout on one fixed workload, plus the transformers baseline.

Workload: 64 prompts of 128 random token ids, 64 output tokens each (ignore_eos),
greedy, bfloat16, the built-in default model, after a 4-request warm-up. Each
configuration runs in its own process, alone, and prints one JSON line:

  {"config": "tp2", "tp": 2, "pp": 1, "output_tokens_per_s": ..., "requests_per_s": ...,
   "total_tokens_per_s": ..., "startup_s": ..., "peak_rss_mb": ..., "gflops": ..., ...}

With --repeats N the configurations run N rounds, interleaved (every other round in
reverse order, so that a machine drifting within a round does not favour the ones that
run first); each run's line carries its "round", and then come one line per
configuration with the medians over the rounds ("statistic": "median", ranges beside
them) and one "summary": "targets" line: PP2 over PP2 with one batch in flight, the
fastest layout over the transformers baseline, and that layout's GFLOP/s and share of
the compute roof given by --roof-gflops.

Usage:
    python tools/bench_throughput.py                     # every configuration
    python tools/bench_throughput.py --configs tp2 pp2   # some of them
    python tools/bench_throughput.py --plot bench.png    # also draw a bar chart (matplotlib)
    python tools/bench_throughput.py --dtype float32     # on a CPU without native bf16
    python tools/bench_throughput.py --repeats 3 --roof-gflops 390   # medians and the targets
    python tools/bench_throughput.py --repeats 3 --roof-gflops auto  # the roof measured here first

Engine options (--max-num-batched-tokens, --layer-split) apply to every engine
configuration; the baseline ignores them. Without them a pipeline gets the engine's
default layer split and token budget (512 with pp > 1, 8192 otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Optional, Union

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]

from run_llama import positive_int  # noqa: E402

if TYPE_CHECKING:
    from models.config import LlamaArgs

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, WARMUP = 64, 128, 64, 4


@dataclasses.dataclass(frozen=True)
class Workload:
    """The timed run's shape: prompts of `input_len` random ids, `output_len` tokens each (the issue's by default)."""

    num_prompts: int = NUM_PROMPTS
    input_len: int = INPUT_LEN
    output_len: int = OUTPUT_LEN

# name -> LLM options (tp, pp, threads per rank, CPUs per rank, batches in flight)
CONFIGS: dict[str, dict] = {
    "tp1_1thread": dict(tp=1, pp=1, num_threads=1, cpus_per_rank=1),
    "tp1_2threads": dict(tp=1, pp=1, num_threads=2, cpus_per_rank=2),
    "pp2": dict(tp=1, pp=2, num_threads=1, cpus_per_rank=1),
    "tp2": dict(tp=2, pp=1, num_threads=1, cpus_per_rank=1),
    "tp2pp2": dict(tp=2, pp=2, num_threads=1, cpus_per_rank=0),
    "pp2_inflight1": dict(tp=1, pp=2, num_threads=1, cpus_per_rank=1, max_inflight=1),
    "hf_baseline": {},
}


# The engine's features that are on by default and that the benchmarks can turn off:
# (flag, the LLM option it sets to False, help).
ENGINE_SWITCHES = (
    ("--no-prepack", "prepack_weights", "plain F.linear weights on the ranks (models/prepack.py off)"),
    ("--no-decode-kernel", "decode_kernel", "SDPA for decode attention (models/decode_attention.py off)"),
    ("--no-move-mlp", "move_boundary_mlp", "the boundary MLP always on its own stage (LLM move_boundary_mlp=False)"),
    ("--no-move-attention", "move_boundary_attention", "only the boundary MLP may move (LLM move_boundary_attention=False)"),
    ("--no-move-back", "move_boundary_back", "the last stage's first attention half never runs on the stage before (LLM move_boundary_back=False)"),
    ("--no-shm-handoff", "shm_handoff", "hidden states between stages through gloo send/recv (LLM shm_handoff=False)"),
    ("--no-norm-rope", "norm_rope_kernels", "torch's ops for RMSNorm and rotary embeddings (LLM norm_rope_kernels=False)"),
    ("--no-kv-write", "kv_write_kernel", "torch's indexing ops to store keys and values (LLM kv_write_kernel=False)"),
    ("--no-bf16-gemm", "bf16_gemm_kernel", "oneDNN's GEMM for bf16 linears (LLM bf16_gemm_kernel=False)"),
    ("--no-prompt-attention", "prompt_attention_kernel", "SDPA for bf16 prompt attention (LLM prompt_attention_kernel=False)"),
    ("--no-pin-driver", "pin_driver", "this process's engine loop and reply router left to the OS (LLM pin_driver=False)"),
)


def _switch_dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_engine_switches(parser: argparse.ArgumentParser) -> None:
    """Adds every ENGINE_SWITCHES flag to `parser`."""
    for flag, _, text in ENGINE_SWITCHES:
        parser.add_argument(flag, action="store_true", help=text)


def _switches_given(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, option) of each ENGINE_SWITCHES flag set in the parsed `args`."""
    return [(flag, option) for flag, option, _ in ENGINE_SWITCHES if getattr(args, _switch_dest(flag))]


def switched_off(args: argparse.Namespace) -> dict[str, bool]:
    """The LLM options that the parsed ENGINE_SWITCHES flags turn off."""
    return {option: False for _, option in _switches_given(args)}


def _workload(vocab_size: int, shape: Workload = Workload()):
    import prompt_sets

    return prompt_sets.random_prompts(shape.num_prompts + WARMUP, shape.input_len, shape.output_len, vocab_size, seed=0)


def workload_flops(args: "LlamaArgs", shape: Workload = Workload()) -> float:
    """FLOPs of the workload's matrix products on a model with the architecture `args`.

    Each request feeds its prompt and all but its last output token through every layer's
    linears and attention (a token at position p attends to p + 1 positions), and takes
    the LM head once per sampled token (the last prompt position, then each decode step).
    The warm-up is not counted; neither are norms, rotary and the other elementwise ops.
    """
    hidden, layers = args.hidden_size, args.num_hidden_layers
    q_dim = args.num_attention_heads * args.head_dim
    kv_dim = args.num_key_value_heads * args.head_dim
    linear_params = layers * (hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * args.intermediate_size)
    fed = shape.input_len + shape.output_len - 1
    attention = layers * 4 * q_dim * fed * (fed + 1) / 2  # scores and weighted sums, 2 FLOPs a multiply-add
    per_request = 2 * linear_params * fed + attention + 2 * hidden * args.vocab_size * shape.output_len
    return shape.num_prompts * per_request


def _result(
    name: str, options: dict, dtype: str, elapsed: float, startup: float, rss_mb: float, extra: dict, shape: Workload, flops: float
) -> dict:
    out_tokens = shape.num_prompts * shape.output_len
    return {
        "config": name,
        **{k: v for k, v in options.items()},
        "num_prompts": shape.num_prompts,
        "input_len": shape.input_len,
        "output_len": shape.output_len,
        "dtype": dtype,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(shape.num_prompts / elapsed, 2),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "total_tokens_per_s": round((out_tokens + shape.num_prompts * shape.input_len) / elapsed, 1),
        "startup_s": round(startup, 2),
        "peak_rss_mb": round(rss_mb, 1),
        "workload_gflop": round(flops / 1e9, 1),
        "gflops": round(flops / elapsed / 1e9, 1),
        **extra,
    }


def run_engine(name: str, dtype: str, engine_options: dict, shape: Workload = Workload()) -> dict:
    from scheduling import LLM, SamplingParams

    options = {**CONFIGS[name], **engine_options}
    t0 = time.perf_counter()
    with LLM(model=None, dtype=dtype, **options) as llm:
        startup = time.perf_counter() - t0
        specs = _workload(llm.args.vocab_size, shape)
        params = SamplingParams(max_tokens=shape.output_len, ignore_eos=True)
        llm.generate([s.prompt_token_ids for s in specs[:WARMUP]], params)
        before = llm.supervisor.collective_rpc("get_stats")
        t1 = time.perf_counter()
        outputs = llm.generate([s.prompt_token_ids for s in specs[WARMUP:]], params)
        elapsed = time.perf_counter() - t1
        assert all(len(o.token_ids) == shape.output_len for o in outputs)
        stats = llm.supervisor.collective_rpc("get_stats")
        options["layer_split"] = list(llm.layer_split)
        options["max_num_batched_tokens"] = llm.scheduler.max_num_batched_tokens
        flops = workload_flops(llm.args, shape)
    rank_rss = [round(s["peak_rss_bytes"] / 2**20, 1) for s in stats]
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    def timed(key: str) -> list[float]:  # per rank, seconds over the timed run
        return [round(b[key] - a[key], 3) for a, b in zip(before, stats)]

    extra = {
        "rss_per_rank_mb": rank_rss,
        "driver_rss_mb": round(own, 1),
        "stage_busy_s": timed("execute_seconds"),  # inside steps
        "stage_recv_s": timed("recv_seconds"),  # of those, waiting for the previous stage
        "allreduce_s": timed("allreduce_seconds"),  # tp all-reduces through shared memory
        "allreduce_wait_s": timed("allreduce_wait_seconds"),  # of those, waiting for a peer
        "kv_mirror_mb": [round(s["kv_mirror_bytes"] / 2**20, 1) for s in stats],
        "packed_weights": [s["packed_weights"] for s in stats],
    }
    return _result(name, options, dtype, elapsed, startup, max(rank_rss), extra, shape, flops)


def run_hf_baseline(name: str, dtype: str, shape: Workload = Workload()) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from models.config import LlamaArgs
    from models.default_model import default_model_dir

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(default_model_dir(), dtype=getattr(torch, dtype)).eval()
    startup = time.perf_counter() - t0
    specs = _workload(model.config.vocab_size, shape)
    ids = torch.tensor([s.prompt_token_ids for s in specs])
    kwargs = dict(max_new_tokens=shape.output_len, min_new_tokens=shape.output_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:WARMUP], attention_mask=torch.ones_like(ids[:WARMUP]), **kwargs)
        t1 = time.perf_counter()
        out = model.generate(ids[WARMUP:], attention_mask=torch.ones_like(ids[WARMUP:]), **kwargs)
        elapsed = time.perf_counter() - t1
    assert out.shape[1] == shape.input_len + shape.output_len
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    flops = workload_flops(LlamaArgs.from_dict(model.config.to_dict()), shape)
    options = {"tp": 1, "pp": 1, "num_threads": 2, "processes": 1}
    return _result(name, options, dtype, elapsed, startup, rss, {}, shape, flops)


# Figures a median line takes from the runs of one configuration, and those it gives a [min, max] range.
MEDIAN_KEYS = ("elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "startup_s", "gflops")
RANGE_KEYS = ("output_tokens_per_s", "startup_s")
# Per-run figures that describe one run only (per rank or per phase): left out of the median line.
PER_RUN_KEYS = ("round", "rss_per_rank_mb", "driver_rss_mb", "stage_busy_s", "stage_recv_s", "allreduce_s",
                "allreduce_wait_s", "kv_mirror_mb", "packed_weights")


def median_lines(lines: list[dict]) -> list[dict]:
    """One line per configuration (in first-run order): the medians of its runs' figures.

    Each carries "statistic": "median", "runs", a "<figure>_range" [min, max] for the
    RANGE_KEYS, and peak_rss_mb as the largest of its runs'.
    """
    by_config: dict[str, list[dict]] = {}
    for line in lines:
        by_config.setdefault(line["config"], []).append(line)
    out = []
    for name, runs in by_config.items():
        line = {k: v for k, v in runs[0].items() if k not in PER_RUN_KEYS}
        line["statistic"] = "median"
        line["runs"] = len(runs)
        for key in MEDIAN_KEYS:
            values = [run[key] for run in runs]
            line[key] = round(statistics.median(values), 3 if key == "elapsed_s" else 2)
            if key in RANGE_KEYS:
                line[f"{key}_range"] = [min(values), max(values)]
        line["peak_rss_mb"] = max(run["peak_rss_mb"] for run in runs)
        out.append(line)
    return out


# --roof-gflops auto: the matmul that measures the roof (large enough to run near it).
ROOF_SHAPE = (2048, 2048, 2048)


def measure_roof(dtype: str, shape: tuple[int, int, int] = ROOF_SHAPE, iters: int = 10, repeats: int = 5) -> dict:
    """This machine's matmul roof in `dtype`, measured now: torch.mm in one one-thread process per CPU
    this process may use, all at once (tools/bench_matmul.py --together); the roof is their sum."""
    from bench_matmul import together

    line = together(sorted(os.sched_getaffinity(0)), dtype, list(shape), iters, repeats)
    line.pop("bench")
    return {**line, "roof_gflops": round(sum(line["together_gflops"]), 1)}


def _roof_arg(text: str) -> Union[float, str]:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GFLOP/s or 'auto', got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive GFLOP/s, got {text!r}")
    return value


def targets(
    lines: list[dict], medians: list[dict], roof_gflops: Optional[float] = None, roof: Optional[dict] = None
) -> dict:
    """The issue's targets, from the median lines (and the runs, for the overlap round by round).

    pp2_overlap: PP2's output tokens/s over PP2 with one batch in flight (target 1.7);
    best_over_baseline: the fastest engine layout over transformers (target 2); best_gflops
    and, given the roof (a figure, or `roof` as `measure_roof` gives it, which is then
    reported too), best_roof_fraction. A figure whose configurations did not run is left out.
    """
    if roof is not None:
        roof_gflops = roof["roof_gflops"]
    speed = {line["config"]: line["output_tokens_per_s"] for line in medians}
    out: dict[str, Any] = {"summary": "targets", "statistic": "median", "runs": max((m["runs"] for m in medians), default=0)}
    if "pp2" in speed and "pp2_inflight1" in speed:
        out["pp2_overlap"] = round(speed["pp2"] / speed["pp2_inflight1"], 3)
        rounds: dict[int, dict[str, float]] = {}
        for line in lines:
            rounds.setdefault(line.get("round", 0), {})[line["config"]] = line["output_tokens_per_s"]
        out["pp2_overlap_by_round"] = [
            round(r["pp2"] / r["pp2_inflight1"], 3) for _, r in sorted(rounds.items()) if "pp2" in r and "pp2_inflight1" in r
        ]
    engines = [line for line in medians if line["config"] != "hf_baseline"]
    if engines:
        best = max(engines, key=lambda line: line["output_tokens_per_s"])
        out["best_config"] = best["config"]
        out["best_output_tokens_per_s"] = best["output_tokens_per_s"]
        if "hf_baseline" in speed:
            out["baseline_output_tokens_per_s"] = speed["hf_baseline"]
            out["best_over_baseline"] = round(best["output_tokens_per_s"] / speed["hf_baseline"], 3)
        out["workload_gflop"] = best["workload_gflop"]
        out["best_gflops"] = best["gflops"]
        if roof_gflops:
            out["roof_gflops"] = roof_gflops
            out["best_roof_fraction"] = round(best["gflops"] / roof_gflops, 3)
            if roof is not None:
                out["roof"] = roof
    return out


def plot(lines: list[dict], path: str) -> None:
    """A bar chart of output tokens/s, one bar per line; median lines get whiskers from their range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [line["config"] for line in lines]
    values = [line["output_tokens_per_s"] for line in lines]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar(names, values, color=["#888" if n == "hf_baseline" else "#3a7" for n in names])
    ranges = [line.get("output_tokens_per_s_range") for line in lines]
    if all(ranges):
        below = [v - r[0] for v, r in zip(values, ranges)]
        above = [r[1] - v for v, r in zip(values, ranges)]
        ax.errorbar(names, values, yerr=[below, above], fmt="none", ecolor="#333", capsize=4)
    ax.bar_label(bars, fmt="%.0f", label_type="center")
    ax.set_ylabel("output tokens/s")
    first = lines[0]
    runs = f", medians of {first['runs']} runs" if first.get("runs", 1) > 1 else ""
    ax.set_title(
        f"{first['num_prompts']} prompts x {first['input_len']} in, {first['output_len']} out, {first['dtype']}, "
        f"default 56M model, 2 cores{runs}",
        fontsize=9,
    )
    plt.xticks(rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _forwarded(args: argparse.Namespace) -> list[str]:
    out = ["--dtype", args.dtype]
    if args.max_num_batched_tokens:
        out += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.layer_split:
        out += ["--layer-split", *map(str, args.layer_split)]
    if args.kv_mirror_mb is not None:
        out += ["--kv-mirror-mb", str(args.kv_mirror_mb)]
    out += ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    return out + [flag for flag, _ in _switches_given(args)]


def _run_one(name: str, args: argparse.Namespace) -> dict:
    """Runs configuration `name` in a process of its own; its JSON line."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--one", name, *_forwarded(args)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"configuration {name} failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--plot", metavar="FILE", help="write a bar chart of output tokens/s (medians with --repeats)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the issue's workload is bfloat16; float32 where the CPU has no native bf16")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="rounds of every configuration, interleaved; then median lines and the targets line")
    parser.add_argument("--roof-gflops", type=_roof_arg,
                        help="the machine's compute roof, for the targets line's share of it: GFLOP/s (e.g. 390 "
                             "for bf16 on the 2-core EPYC of ../shared/reference/machine.md), or 'auto' to measure "
                             "it before the runs (torch.mm on every CPU at once, tools/bench_matmul.py --together)")
    parser.add_argument("--num-prompts", type=positive_int, default=NUM_PROMPTS, help="timed prompts (the issue's: 64)")
    parser.add_argument("--input-len", type=positive_int, default=INPUT_LEN, help="prompt tokens (the issue's: 128)")
    parser.add_argument("--output-len", type=positive_int, default=OUTPUT_LEN, help="output tokens (the issue's: 64)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="the engine's token budget per batch")
    parser.add_argument("--layer-split", type=int, nargs="+", metavar="N", help="decoder layers per stage (pp > 1; default the engine's)")
    parser.add_argument("--kv-mirror-mb", type=int, help="per rank, MiB of the dense decode KV copy (0: off; default the engine's)")
    add_engine_switches(parser)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration here
    args = parser.parse_args()
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # Before the runs, not minutes later when the chart is drawn.
        parser.error("--plot needs matplotlib: pip install -e '.[plot]'")
    shape = Workload(args.num_prompts, args.input_len, args.output_len)
    engine_options: dict = switched_off(args)
    if args.max_num_batched_tokens:
        engine_options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_mirror_mb is not None:
        engine_options["kv_mirror_bytes"] = args.kv_mirror_mb * 2**20
    if args.one:
        if args.layer_split and CONFIGS.get(args.one, {}).get("pp", 1) > 1:
            engine_options["layer_split"] = args.layer_split
        if args.one == "hf_baseline":
            line = run_hf_baseline(args.one, args.dtype, shape)
        else:
            line = run_engine(args.one, args.dtype, engine_options, shape)
        print(json.dumps(line), flush=True)
        return
    roof = None
    if args.roof_gflops == "auto" and args.repeats > 1:  # only the targets line uses it
        roof = measure_roof(args.dtype)
    lines = []
    for round_ in range(args.repeats):
        order = args.configs if round_ % 2 == 0 else args.configs[::-1]
        for name in order:
            line = _run_one(name, args)
            if args.repeats > 1:
                line["round"] = round_
            lines.append(line)
            print(json.dumps(line), flush=True)
    shown = lines
    if args.repeats > 1:
        shown = median_lines(lines)
        for line in shown:
            print(json.dumps(line), flush=True)
        given = None if args.roof_gflops == "auto" else args.roof_gflops
        print(json.dumps(targets(lines, shown, given, roof)), flush=True)
    if args.plot:
        plot(shown, args.plot)


if __name__ == "__main__":
    main()
