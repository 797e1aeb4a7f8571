"""One rank's step times on the throughput workload, in this process (no actors, no messages).

Drives a single `LlamaWorker` (TP1, PP1) with the engine's `Scheduler` over the
fixed workload of tools/bench_throughput.py (64 prompts of 128 random ids, 64 output
tokens, greedy) and prints one JSON line per run:
  {"bench": "step", "threads": T, "kv_mirror_mb": M, "prefill_s": ..., "decode_ms_per_step": ...,
   "total_s": ..., "output_tokens_per_s": ..., "profile": {op: share of decode time, ...}}
`--profile` runs torch.profiler over decode steps 20-39 and reports the largest ops'
shares of their self time (numba's kernels are not ops: they are missing from it).
`--parts` instead times the parts of every decode step from the 10th on, kernels
included, and adds "parts_ms_per_step": the mean milliseconds a step spends in the
decoder layers' projections ("linears"), the LM head's, decode attention, writing keys
and values, RMSNorm, rotary embeddings (angles and rotation), the greedy argmax,
building the step's inputs, and everything else ("other": residual adds, SiLU,
the embedding, Python). Each part counts its own time, not that of the parts it calls;
the timers cost about 1 us a call. Run it at two row counts (`--max-num-seqs 32`, `64`)
to see which parts grow with the rows and which are paid once a step. Two copies
pinned to different cores (`--cpu 0`, `--cpu 1`) show how much one busy core slows
the other. Run it alone otherwise.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import resource
import statistics
import sys
import time
from typing import Any, Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]

import torch  # noqa: E402

from actors.context import ActorContext  # noqa: E402
from bench_throughput import INPUT_LEN, NUM_PROMPTS, OUTPUT_LEN  # noqa: E402
from models.default_model import default_model_dir  # noqa: E402
from models.worker import LlamaWorker  # noqa: E402
from scheduling.llm import DEFAULT_KV_CACHE_BYTES, default_max_num_batched_tokens  # noqa: E402
from scheduling.request import Request  # noqa: E402
from scheduling.sampling_params import SamplingParams  # noqa: E402
from scheduling.scheduler import Scheduler  # noqa: E402

PROFILED_STEPS = range(20, 40)
# --parts leaves out the first decode steps (warm-up of caches and allocator).
PARTS_FROM_STEP = 10


class StepParts:
    """Exclusive wall time per part of a model step, from timers wrapped around the model's functions.

    A part's time excludes that of any timed part it calls (the LM head's projection
    inside the greedy sampler counts as "lm_head", not "argmax"). `timing` switches the
    timers on and off between steps; `patched` installs them for the duration of a block.
    """

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.timing = False
        self._stack: list[list[float]] = []  # per open timed call: [start, time of timed callees]

    def _timed(self, part: str | Callable[[tuple], str], fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` timed as `part`: a name, or a function of the call's arguments that gives one."""
        name_of = part if callable(part) else (lambda _: part)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.timing:
                return fn(*args, **kwargs)
            frame = [time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.perf_counter() - frame[0]
                self.seconds[name_of(args)] += spent - frame[1]
                if self._stack:
                    self._stack[-1][1] += spent

        return timed

    @contextlib.contextmanager
    def patched(self, worker: LlamaWorker) -> Iterator["StepParts"]:
        from torch import nn

        from models import kv_cache, llama, prepack
        from models import worker as worker_module

        head = worker.stage.lm_head if worker.stage is not None else None

        def linear(args: tuple) -> str:  # args[0]: the projection module
            return "lm_head" if args[0] is head else "linears"

        targets = [
            (prepack.PackedLinear, "forward", linear),
            (nn.Linear, "forward", linear),
            (kv_cache.LayerKV, "decode_attention", "decode_attention"),
            (kv_cache.LayerKV, "write", "kv_writes"),
            (llama.RMSNorm, "forward", "rms_norm"),
            (llama, "_rotate", "rotary"),
            (llama, "rotary_cos_sin", "rotary"),
            (llama, "row_argmax", "argmax"),
            (worker_module, "prepare_step", "step_inputs"),
            (LlamaWorker, "execute_model", "other"),
        ]
        saved = []
        for owner, name, part in targets:
            fn = getattr(owner, name)
            saved.append((owner, name, fn))
            setattr(owner, name, self._timed(part, fn))
        try:
            yield self
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)

    def per_step(self, steps: int) -> dict[str, float]:
        """Mean milliseconds per step of each part, largest first."""
        return {k: round(1e3 * v / steps, 3) for k, v in self.seconds.most_common()}


def run(
    threads: int, cpus: list[int], dtype: str, kv_mirror_mb: int, profile: bool,
    prepack: bool = True, keep_memory: bool = True, decode_kernel: bool = True, top: int = 8,
    kv_write_kernel: bool = True, bf16_gemm_kernel: bool = True, prompt_attention_kernel: bool = True,
    max_num_seqs: int = 256, parts: bool = False, num_prompts: int = NUM_PROMPTS, output_len: int = OUTPUT_LEN,
) -> dict:
    import prompt_sets

    os.sched_setaffinity(0, set(cpus))
    ctx = ActorContext(pp=0, tp=0, tp_size=1, pp_size=1, master_addr="127.0.0.1", master_port=0)
    worker = LlamaWorker(
        ctx, default_model_dir(), dtype=dtype, num_threads=threads,
        kv_cache_bytes=DEFAULT_KV_CACHE_BYTES, kv_mirror_bytes=kv_mirror_mb * 2**20,
        prepack_weights=prepack, keep_freed_memory=keep_memory, decode_kernel=decode_kernel,
        kv_write_kernel=kv_write_kernel, bf16_gemm_kernel=bf16_gemm_kernel,
        prompt_attention_kernel=prompt_attention_kernel,
    )
    worker.init_distributed()
    info = worker.load_model()
    # The engine's single-stage defaults (LLM's max_num_seqs and token budget).
    sched = Scheduler(max_num_seqs, default_max_num_batched_tokens(1), info["num_blocks"], info["block_size"], 2048)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    for i, spec in enumerate(prompt_sets.random_prompts(num_prompts, INPUT_LEN, output_len, worker.args.vocab_size, seed=0)):
        sched.add_request(Request(str(i), list(spec.prompt_token_ids), params))

    prefill_s, decode_s = 0.0, []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    timers = StepParts()
    timed_steps = 0
    start = time.perf_counter()
    with timers.patched(worker) if parts else contextlib.nullcontext():
        while sched.has_unfinished():
            batch = sched.schedule()
            decode = all(len(c.token_ids) == 1 for c in batch.chunks)
            if profiler is not None and decode and len(decode_s) == PROFILED_STEPS.start:
                profiler.start()
            timers.timing = decode and len(decode_s) >= PARTS_FROM_STEP
            timed_steps += timers.timing
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
        "kv_write_kernel": info["kv_write_kernel"],
        "bf16_gemm_kernel": info["bf16_gemm_kernel"],
        "prompt_attention_kernel": info["prompt_attention_kernel"],
        "keeps_freed_memory": worker.keeps_freed_memory,
        "prefill_s": round(prefill_s, 3),
        "decode_steps": len(decode_s),
        "decode_ms_per_step": round(1e3 * statistics.median(decode_s), 1),
        "total_s": round(total, 3),
        "output_tokens_per_s": round(num_prompts * output_len / total, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if parts:
        line["parts_ms_per_step"] = timers.per_step(timed_steps) if timed_steps else {}
        line["parts_steps"] = timed_steps
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
    parser.add_argument("--parts", action="store_true",
                        help="mean ms per decode step of each part (linears, LM head, decode attention, ...)")
    parser.add_argument("--no-prepack", action="store_true", help="plain F.linear weights (models/prepack.py off)")
    parser.add_argument("--no-decode-kernel", action="store_true", help="SDPA for decode attention (models/decode_attention.py off)")
    parser.add_argument("--no-kv-write", action="store_true", help="torch's indexing ops to store keys and values (models/kv_write.py off)")
    parser.add_argument("--no-bf16-gemm", action="store_true", help="oneDNN's GEMM for bf16 linears (models/bf16_gemm.py off)")
    parser.add_argument(
        "--no-prompt-attention", action="store_true", help="SDPA for bf16 prompt attention (models/prompt_attention.py off)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences per batch (so decode rows per step: at most 64 here)")
    parser.add_argument("--release-memory", action="store_true", help="glibc's default malloc (models/host_memory.py off)")
    args = parser.parse_args()
    cpus = args.cpu or list(range(args.threads))
    line = run(
        args.threads, cpus, args.dtype, args.kv_mirror_mb, args.profile,
        prepack=not args.no_prepack, keep_memory=not args.release_memory, decode_kernel=not args.no_decode_kernel,
        kv_write_kernel=not args.no_kv_write, bf16_gemm_kernel=not args.no_bf16_gemm,
        prompt_attention_kernel=not args.no_prompt_attention,
        top=args.top, max_num_seqs=args.max_num_seqs, parts=args.parts,
    )
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
