"""All-reduce latency between 2 TP ranks on one host: gloo against models.shm_allreduce.

Prints one JSON line per (size, implementation):
  {"bench": "allreduce", "impl": "shm", "kib": 64, "p50_ms": ..., "mean_ms": ..., "iters": N}

Each rank is pinned to its own core, as the engine pins TP ranks. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors import Supervisor  # noqa: E402


class AllReduceBench:
    """One rank: a gloo group plus the shared-memory all-reduce over the same ranks."""

    def __init__(self, ctx, capacity: int) -> None:
        import torch
        import torch.distributed as dist

        from models.shm_allreduce import ShmAllReduce
        from models.worker import SHM_SPIN_S

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=ctx.init_method, rank=ctx.global_rank, world_size=ctx.world_size)
        # The same brief spin the worker uses when every rank has a core of its own.
        self.shm = ShmAllReduce.create(None, ctx.global_rank, ctx.world_size, capacity=capacity, spin_s=SHM_SPIN_S)

    def time_it(self, numel: int, iters: int, impl: str) -> tuple[float, float]:
        import torch
        import torch.distributed as dist

        x = torch.randn(numel).bfloat16()
        reduce = dist.all_reduce if impl == "gloo" else self.shm.all_reduce
        samples = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            reduce(x)
            samples.append(time.perf_counter() - t0)
        samples.sort()
        return samples[len(samples) // 2] * 1e3, sum(samples) / len(samples) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kib", type=int, nargs="+", default=[4, 64, 1024, 8192])
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    with Supervisor(
        "tools.bench_allreduce:AllReduceBench", {"capacity": 4 << 20}, tp_size=2, cpus=lambda r: [cpus[r % len(cpus)]]
    ) as sup:
        for kib in args.kib:
            numel = kib * 1024 // 2  # bfloat16
            iters = 200 if kib <= 1024 else 20
            for impl in ("gloo", "shm"):
                p50, mean = sup.collective_rpc("time_it", args=(numel, iters, impl))[0]
                line = {"bench": "allreduce", "impl": impl, "kib": kib, "p50_ms": round(p50, 3),
                        "mean_ms": round(mean, 3), "iters": iters}
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
