"""How fast a gang notices a dead rank and is serving again, on the built-in default model.

Under policy "restart", SIGKILLs one rank in the middle of a `generate` run and
polls `Supervisor.status()` every millisecond. Prints one JSON line per run:
  {"bench": "recovery", "tp": 1, "pp": 2, "killed": [0, 0], "detection_ms": ..., "recovery_s": ...}

detection: from the kill to the supervisor leaving state "running";
recovery: from the kill to the new epoch running again (gang started, setup replayed).
That outputs are identical to a fault-free run is tested (tests/test_faults_matrix.py) on
float32 checkpoints whose logits are well separated; the default model's random bf16
weights give near-tied logits, where recomputing a request changes summation order.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors import SupervisionPolicy  # noqa: E402
from scheduling import LLM, SamplingParams  # noqa: E402

PROMPTS = [[1, 100 + i, 200 + i, 300 + i] for i in range(8)]
PARAMS = SamplingParams(max_tokens=48, ignore_eos=True)


def one_run(llm: LLM, rank: tuple[int, int]) -> dict:
    sup = llm.supervisor
    epoch = sup.epoch
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(outputs=llm.generate(PROMPTS, PARAMS, use_tqdm=False)))
    start_batches = llm.engine.stats()["num_batches"]
    runner.start()
    while llm.engine.stats()["num_batches"] < start_batches + 6:
        time.sleep(0.001)
    killed_at = time.monotonic()
    os.kill(sup.pids[sup.rank_of(*rank)], signal.SIGKILL)
    while sup.status()["state"] == "running":
        time.sleep(0.001)
    detected = time.monotonic()
    while sup.status()["state"] != "running" or sup.epoch == epoch:
        time.sleep(0.001)
    recovered = time.monotonic()
    runner.join()
    return {
        "bench": "recovery",
        "tp": sup.tp_size,
        "pp": sup.pp_size,
        "killed": list(rank),
        "detection_ms": round((detected - killed_at) * 1e3, 1),
        "recovery_s": round(recovered - killed_at, 3),
        "completed": all(len(o.token_ids) == PARAMS.max_tokens for o in result["outputs"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    policy = SupervisionPolicy("restart", max_restarts=args.runs)
    with LLM(tp=args.tp, pp=args.pp, policy=policy, kv_cache_bytes=64 << 20) as llm:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)  # warm-up
        ranks = [(pp, 0) for pp in range(args.pp)]
        for i in range(args.runs):
            print(json.dumps(one_run(llm, ranks[i % len(ranks)])), flush=True)


if __name__ == "__main__":
    main()
