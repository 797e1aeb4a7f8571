"""Offline throughput of each parallel layout on one fixed workload, plus the transformers baseline.

Workload: 64 prompts of 128 random token ids, 64 output tokens each (ignore_eos),
greedy, bfloat16, the built-in default model, after a 4-request warm-up. Each
configuration runs in its own process, alone, and prints one JSON line:

  {"config": "tp2", "tp": 2, "pp": 1, "output_tokens_per_s": ..., "requests_per_s": ...,
   "total_tokens_per_s": ..., "startup_s": ..., "peak_rss_mb": ..., ...}

Usage:
    python tools/bench_throughput.py                     # every configuration
    python tools/bench_throughput.py --configs tp2 pp2   # some of them
    python tools/bench_throughput.py --plot bench.png    # also draw a bar chart (matplotlib)
    python tools/bench_throughput.py --dtype float32     # on a CPU without native bf16

Engine options (--max-num-batched-tokens, --layer-split) apply to every engine
configuration; the baseline ignores them. Without them a pipeline gets the engine's
default layer split and token budget (512 with pp > 1, 8192 otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, WARMUP = 64, 128, 64, 4

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


def _workload(vocab_size: int):
    import prompt_sets

    return prompt_sets.random_prompts(NUM_PROMPTS + WARMUP, INPUT_LEN, OUTPUT_LEN, vocab_size, seed=0)


def _result(name: str, options: dict, dtype: str, elapsed: float, startup: float, rss_mb: float, extra: dict) -> dict:
    out_tokens = NUM_PROMPTS * OUTPUT_LEN
    return {
        "config": name,
        **{k: v for k, v in options.items()},
        "num_prompts": NUM_PROMPTS,
        "input_len": INPUT_LEN,
        "output_len": OUTPUT_LEN,
        "dtype": dtype,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(NUM_PROMPTS / elapsed, 2),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "total_tokens_per_s": round((out_tokens + NUM_PROMPTS * INPUT_LEN) / elapsed, 1),
        "startup_s": round(startup, 2),
        "peak_rss_mb": round(rss_mb, 1),
        **extra,
    }


def run_engine(name: str, dtype: str, engine_options: dict) -> dict:
    from scheduling import LLM, SamplingParams

    options = {**CONFIGS[name], **engine_options}
    t0 = time.perf_counter()
    with LLM(model=None, dtype=dtype, **options) as llm:
        startup = time.perf_counter() - t0
        specs = _workload(llm.args.vocab_size)
        params = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True)
        llm.generate([s.prompt_token_ids for s in specs[:WARMUP]], params)
        before = llm.supervisor.collective_rpc("get_stats")
        t1 = time.perf_counter()
        outputs = llm.generate([s.prompt_token_ids for s in specs[WARMUP:]], params)
        elapsed = time.perf_counter() - t1
        assert all(len(o.token_ids) == OUTPUT_LEN for o in outputs)
        stats = llm.supervisor.collective_rpc("get_stats")
        options["layer_split"] = list(llm.layer_split)
        options["max_num_batched_tokens"] = llm.scheduler.max_num_batched_tokens
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
    return _result(name, options, dtype, elapsed, startup, max(rank_rss), extra)


def run_hf_baseline(name: str, dtype: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from models.default_model import default_model_dir

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(default_model_dir(), dtype=getattr(torch, dtype)).eval()
    startup = time.perf_counter() - t0
    specs = _workload(model.config.vocab_size)
    ids = torch.tensor([s.prompt_token_ids for s in specs])
    kwargs = dict(max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:WARMUP], attention_mask=torch.ones_like(ids[:WARMUP]), **kwargs)
        t1 = time.perf_counter()
        out = model.generate(ids[WARMUP:], attention_mask=torch.ones_like(ids[WARMUP:]), **kwargs)
        elapsed = time.perf_counter() - t1
    assert out.shape[1] == INPUT_LEN + OUTPUT_LEN
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return _result(name, {"tp": 1, "pp": 1, "num_threads": 2, "processes": 1}, dtype, elapsed, startup, rss, {})


def plot(lines: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [line["config"] for line in lines]
    values = [line["output_tokens_per_s"] for line in lines]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar(names, values, color=["#888" if n == "hf_baseline" else "#3a7" for n in names])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{NUM_PROMPTS} prompts x {INPUT_LEN} in, {OUTPUT_LEN} out, {lines[0]['dtype']}, default 56M model, 2 cores")
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
    return out + [flag for flag, _ in _switches_given(args)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--plot", metavar="FILE", help="write a bar chart of output tokens/s")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the issue's workload is bfloat16; float32 where the CPU has no native bf16")
    parser.add_argument("--max-num-batched-tokens", type=int, help="the engine's token budget per batch")
    parser.add_argument("--layer-split", type=int, nargs="+", metavar="N", help="decoder layers per stage (pp > 1; default the engine's)")
    parser.add_argument("--kv-mirror-mb", type=int, help="per rank, MiB of the dense decode KV copy (0: off; default the engine's)")
    add_engine_switches(parser)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration here
    args = parser.parse_args()
    engine_options: dict = switched_off(args)
    if args.max_num_batched_tokens:
        engine_options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_mirror_mb is not None:
        engine_options["kv_mirror_bytes"] = args.kv_mirror_mb * 2**20
    if args.one:
        if args.layer_split and CONFIGS.get(args.one, {}).get("pp", 1) > 1:
            engine_options["layer_split"] = args.layer_split
        if args.one == "hf_baseline":
            line = run_hf_baseline(args.one, args.dtype)
        else:
            line = run_engine(args.one, args.dtype, engine_options)
        print(json.dumps(line), flush=True)
        return
    lines = []
    for name in args.configs:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--one", name, *_forwarded(args)],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            raise SystemExit(f"configuration {name} failed with exit code {proc.returncode}")
        line = json.loads(proc.stdout.strip().splitlines()[-1])
        lines.append(line)
        print(json.dumps(line), flush=True)
    if args.plot:
        plot(lines, args.plot)


if __name__ == "__main__":
    main()
