"""One rank's step times on the throughput workload, in this process (no actors, no messages).

Drives a single `LlamaWorker` (TP1, PP1) with the engine's `Scheduler` over the
fixed workload of tools/bench_throughput.py (64 prompts of 128 random ids, 64 output
tokens, greedy) and prints one JSON line per run:
  {"bench": "step", "threads": T, "kv_mirror_mb": M, "prefill_s": ..., "decode_ms_per_step": ...,
   "total_s": ..., "output_tokens_per_s": ..., "profile": {op: share of decode time, ...}}
`--profile` runs torch.profiler over decode steps 20-39 and reports the largest ops'
shares of their self time. Two copies pinned to different cores (`--cpu 0`, `--cpu 1`)
show how much one busy core slows the other. Run it alone otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch

from actors.context import ActorContext
from bench_throughput import INPUT_LEN, NUM_PROMPTS, OUTPUT_LEN
from models.default_model import default_model_dir
from models.worker import LlamaWorker
from scheduling.llm import DEFAULT_KV_CACHE_BYTES, default_max_num_batched_tokens
from scheduling.request import Request
from scheduling.sampling_params import SamplingParams
from scheduling.scheduler import Scheduler

PROFILED_STEPS = range(20, 40)


def run(
    threads: int, cpus: list[int], dtype: str, kv_mirror_mb: int, profile: bool,
    prepack: bool = True, keep_memory: bool = True, decode_kernel: bool = True, top: int = 8,
    max_num_seqs: int = 256,
) -> dict:
    import prompt_sets

    os.sched_setaffinity(0, set(cpus))
    ctx = ActorContext(pp=0, tp=0, tp_size=1, pp_size=1, master_addr="127.0.0.1", master_port=0)
    worker = LlamaWorker(
        ctx, default_model_dir(), dtype=dtype, num_threads=threads,
        kv_cache_bytes=DEFAULT_KV_CACHE_BYTES, kv_mirror_bytes=kv_mirror_mb * 2**20,
        prepack_weights=prepack, keep_freed_memory=keep_memory, decode_kernel=decode_kernel,
    )
    worker.init_distributed()
    info = worker.load_model()
    # The engine's single-stage defaults (LLM's max_num_seqs and token budget).
    sched = Scheduler(max_num_seqs, default_max_num_batched_tokens(1), info["num_blocks"], info["block_size"], 2048)
    params = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True)
    for i, spec in enumerate(prompt_sets.random_prompts(NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, worker.args.vocab_size, seed=0)):
        sched.add_request(Request(str(i), list(spec.prompt_token_ids), params))

    prefill_s, decode_s = 0.0, []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    start = time.perf_counter()
    while sched.has_unfinished():
        batch = sched.schedule()
        decode = all(len(c.token_ids) == 1 for c in batch.chunks)
        if profiler is not None and decode and len(decode_s) == PROFILED_STEPS.start:
            profiler.start()
        t = time.perf_counter()
        output = worker.execute_model(batch)
        dt = time.perf_counter() - t
        if profiler is not None and decode and len(decode_s) == PROFILED_STEPS.stop - 1:
            profiler.stop()
        if decode:
            decode_s.append(dt)
        else:
            prefill_s += dt
        sched.update(batch, output)
    total = time.perf_counter() - start
    worker.shutdown()

    line = {
        "bench": "step",
        "threads": threads,
        "cpus": cpus,
        "dtype": str(worker.dtype).removeprefix("torch."),
        "kv_mirror_mb": kv_mirror_mb,
        "packed_weights": info["packed_weights"],
        "max_num_seqs": max_num_seqs,
        "decode_kernel": decode_kernel,
        "keeps_freed_memory": worker.keeps_freed_memory,
        "prefill_s": round(prefill_s, 3),
        "decode_steps": len(decode_s),
        "decode_ms_per_step": round(1e3 * statistics.median(decode_s), 1),
        "total_s": round(total, 3),
        "output_tokens_per_s": round(NUM_PROMPTS * OUTPUT_LEN / total, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if profiler is not None:
        events = profiler.key_averages()
        whole = sum(e.self_cpu_time_total for e in events)
        largest = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        line["profile"] = {e.key: round(e.self_cpu_time_total / whole, 3) for e in largest}
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpu", type=int, nargs="+", help="CPUs to pin to (default the first --threads)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-mirror-mb", type=int, default=256, help="0: gather from the paged cache every step")
    parser.add_argument("--profile", action="store_true", help="op shares of decode steps 20-39")
    parser.add_argument("--top", type=int, default=8, help="with --profile, how many ops to list")
    parser.add_argument("--no-prepack", action="store_true", help="plain F.linear weights (models/prepack.py off)")
    parser.add_argument("--no-decode-kernel", action="store_true", help="SDPA for decode attention (models/decode_attention.py off)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences per batch (so decode rows per step: at most 64 here)")
    parser.add_argument("--release-memory", action="store_true", help="glibc's default malloc (models/host_memory.py off)")
    args = parser.parse_args()
    cpus = args.cpu or list(range(args.threads))
    line = run(
        args.threads, cpus, args.dtype, args.kv_mirror_mb, args.profile,
        prepack=not args.no_prepack, keep_memory=not args.release_memory, decode_kernel=not args.no_decode_kernel,
        top=args.top, max_num_seqs=args.max_num_seqs,
    )
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
