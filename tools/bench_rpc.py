"""Round-trip time of a no-op collective_rpc, and pipelined submit throughput.

Prints one JSON line per configuration:
  {"bench": "collective_rpc_noop", "backend": B, "world_size": W, "startup_s": ..., "p50_us": ..., "p99_us": ..., "calls": N}
  {"bench": "pipelined_submit", "backend": B, "world_size": W, "calls_per_s": ..., "calls": 1000}
With --backend ray it first starts a local Ray instance (no dashboard) and prints
  {"bench": "ray_init", "seconds": ...}
startup_s is the Supervisor's construction: every actor started and ready.

Run it alone on the machine: any other load changes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors import Supervisor  # noqa: E402


class NoopWorker:
    """The cheapest possible worker: measures the runtime alone."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx

    def noop(self) -> None:
        return None


LAYOUTS = {1: (1, 1), 2: (2, 1), 4: (2, 2)}


def bench_world(world: int, calls: int, submits: int, backend: str = "mp") -> list[dict]:
    tp, pp = LAYOUTS[world]
    t0 = time.perf_counter()
    with Supervisor("tools.bench_rpc:NoopWorker", tp_size=tp, pp_size=pp, backend=backend) as sup:
        startup = time.perf_counter() - t0
        for _ in range(200):  # warm-up
            sup.collective_rpc("noop")
        samples = []
        for _ in range(calls):
            t0 = time.perf_counter()
            sup.collective_rpc("noop")
            samples.append(time.perf_counter() - t0)
        samples.sort()
        rtt = {
            "bench": "collective_rpc_noop",
            "backend": backend,
            "world_size": world,
            "tp": tp,
            "pp": pp,
            "startup_s": round(startup, 3),
            "p50_us": round(statistics.median(samples) * 1e6, 1),
            "p99_us": round(samples[int(len(samples) * 0.99)] * 1e6, 1),
            "calls": calls,
        }
        t0 = time.perf_counter()
        futures = [sup.submit("noop") for _ in range(submits)]
        for f in futures:
            f.result()
        elapsed = time.perf_counter() - t0
        thr = {
            "bench": "pipelined_submit",
            "backend": backend,
            "world_size": world,
            "tp": tp,
            "pp": pp,
            "max_inflight": sup.max_inflight,
            "calls_per_s": round(submits / elapsed, 1),
            "calls": submits,
        }
    return [rtt, thr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], choices=sorted(LAYOUTS))
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--submits", type=int, default=1000)
    parser.add_argument("--backend", default="mp", choices=["mp", "ray"])
    args = parser.parse_args()
    if args.backend == "ray":
        import ray

        from actors import RayOptions
        from actors.context import RankMap
        from actors.ray_gang import local_ray_cpus

        biggest = max(args.worlds)
        cpus = local_ray_cpus(RayOptions(), RankMap(tp_size=LAYOUTS[biggest][0], pp_size=LAYOUTS[biggest][1]))
        t0 = time.perf_counter()
        ray.init(num_cpus=cpus, include_dashboard=False)  # the size the backend would give it
        print(json.dumps({"bench": "ray_init", "seconds": round(time.perf_counter() - t0, 3)}), flush=True)
    for world in args.worlds:
        for line in bench_world(world, args.calls, args.submits, args.backend):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
