"""The main job: run a Llama checkpoint over a prompt set with chosen TP/PP and report throughput.

By default: the built-in default model (random weights, so its text is noise)
over ShareGPT V3 prompts with their real answer lengths. Prints the first few
generations, then

    Throughput: X requests/s, Y total tokens/s, Z output tokens/s

and one JSON line with the same figures and the configuration.

Examples:
    python tools/run_llama.py --tp 2 --pp 2
    python tools/run_llama.py --dataset random --input-len 128 --output-len 64 --num-prompts 64
    python tools/run_llama.py --model /path/to/hf-llama --dtype bfloat16 --max-tokens 32
    python tools/run_llama.py --pp 2 --policy restart --inject-fault 0,0:execute_model:5:crash
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (also used by tools/bench_throughput.py)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Run a Llama model over prompts with TP/PP actors.")
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: the built-in default model)")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "random"])
    parser.add_argument("--num-prompts", type=positive_int, default=32)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (random dataset)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens (random dataset)")
    parser.add_argument("--max-tokens", type=int, default=None, help="cap every request's output length")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate the full output length")
    parser.add_argument("--seed", type=int, default=0, help="prompt sampling and per-request sampling seed")
    parser.add_argument("--kv-cache-mb", type=int, default=256, help="KV cache budget per rank, MiB")
    parser.add_argument(
        "--kv-mirror-mb",
        type=int,
        default=None,
        help="per rank, MiB for the dense decode copy of keys/values kept across steps (default: --kv-cache-mb on CPU; 0: off)",
    )
    parser.add_argument("--no-prepack", action="store_true", help="plain F.linear weights on the ranks (models/prepack.py off)")
    parser.add_argument("--no-decode-kernel", action="store_true", help="SDPA for decode attention (models/decode_attention.py off)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--compile-workers",
        type=int,
        default=None,
        help="processes compiling the ranks' numba kernels on a first start (default one per CPU; 0: each rank its own)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per batch (default 8192 with one stage, 512 with --pp > 1)",
    )
    parser.add_argument("--show", type=int, default=2, help="print this many generations")
    parser.add_argument("--policy", default="fail", choices=["fail", "restart"], help="supervision policy")
    parser.add_argument(
        "--inject-fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="pp,tp:method:at_call:action[:seconds][@epoch], e.g. 0,0:execute_model:5:crash (repeatable)",
    )
    parser.add_argument("--step-timeout", type=float, default=None, help="deadline of each model step, s")
    parser.add_argument(
        "--backend", default="mp", choices=["mp", "ray"],
        help="mp: worker processes of this one; ray: Ray actors (pip install 'pipeactors[ray]')",
    )
    parser.add_argument(
        "--ray-address", default=None,
        help="Ray cluster to join (default: the one Ray finds, else a local one)",
    )
    parser.add_argument("--ray-cpus-per-rank", type=float, default=1.0, help="logical CPUs each Ray actor reserves")
    parser.add_argument(
        "--ray-spread-stages", action="store_true", help="put each pipeline stage on a different Ray node"
    )
    parser.add_argument(
        "--layer-split", type=int, nargs="+", default=None, metavar="N",
        help="decoder layers per pipeline stage, e.g. --pp 2 --layer-split 5 3 (default: balanced by estimated cost)",
    )
    parser.add_argument("--log-level", default="WARNING")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import prompt_sets
    from actors import Fault, FaultPlan, RayOptions
    from scheduling import LLM, SamplingParams

    ray_options = None
    if args.backend == "ray":
        ray_options = RayOptions(
            num_cpus=args.ray_cpus_per_rank, spread_stages=args.ray_spread_stages, address=args.ray_address
        )
    fault_plan = FaultPlan([Fault.parse(spec) for spec in args.inject_fault]) if args.inject_fault else None
    t0 = time.perf_counter()
    with LLM(
        model=args.model,
        tp=args.tp,
        pp=args.pp,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_mb * 2**20,
        kv_mirror_bytes=args.kv_mirror_mb * 2**20 if args.kv_mirror_mb is not None else None,
        prepack_weights=not args.no_prepack,
        decode_kernel=not args.no_decode_kernel,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        step_timeout=args.step_timeout,
        policy=args.policy,
        fault_plan=fault_plan,
        backend=args.backend,
        ray_options=ray_options,
        layer_split=args.layer_split,
        compile_workers=args.compile_workers,
    ) as llm:
        startup_s = time.perf_counter() - t0
        if args.dataset == "sharegpt":
            specs = prompt_sets.load_sharegpt(llm.tokenizer, args.num_prompts, seed=args.seed)
        else:
            specs = prompt_sets.random_prompts(
                args.num_prompts, args.input_len, args.output_len, llm.args.vocab_size, seed=args.seed
            )
        params = [
            SamplingParams(
                max_tokens=min(s.output_len, args.max_tokens) if args.max_tokens else s.output_len,
                temperature=args.temperature,
                seed=args.seed + i if args.temperature > 0 else None,
                ignore_eos=args.ignore_eos or args.dataset == "random",
            )
            for i, s in enumerate(specs)
        ]
        t1 = time.perf_counter()
        outputs = llm.generate([s.prompt_token_ids for s in specs], params)
        elapsed = time.perf_counter() - t1
        status = llm.supervisor.status()

    prompt_tokens = sum(len(s.prompt_token_ids) for s in specs)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    for spec, out in list(zip(specs, outputs))[: args.show]:
        prompt = spec.prompt if spec.prompt else f"<{len(spec.prompt_token_ids)} token ids>"
        print(f"--- prompt ({len(spec.prompt_token_ids)} tokens): {prompt[:200]!r}")
        print(f"--- output ({len(out.token_ids)} tokens, {out.finish_reason}): {(out.text or '')[:300]!r}")
    result = {
        "model": args.model or "default",
        "tp": args.tp,
        "pp": args.pp,
        "dtype": llm.dtype,
        "layer_split": list(llm.layer_split),
        "max_num_batched_tokens": llm.scheduler.max_num_batched_tokens,
        "backend": args.backend,
        "dataset": args.dataset,
        "num_prompts": len(specs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 3),
        "startup_s": round(startup_s, 3),
        "requests_per_s": round(len(specs) / elapsed, 3),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / elapsed, 1),
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
        "restarts": status["restarts"],
    }
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tokens_per_s']:.2f} total tokens/s, "
        f"{result['output_tokens_per_s']:.2f} output tokens/s"
    )
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
