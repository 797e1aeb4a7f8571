"""Where a pipeline's time goes: each stage's work and idle time per phase, from the ranks' step timelines.

Runs the fixed workload of tools/bench_throughput.py (64 prompts of 128 random ids,
64 output tokens, greedy, the default model) through `LLM` with two pipeline stages,
one pinned core each, once with two batches in flight and once with one, and prints
one JSON line per run:

  {"bench": "pipeline", "max_inflight": 2, "output_tokens_per_s": ..., "run_s": ...,
   "phases": {"prefill": {"batches": 18, "stage_ms_per_batch": [134, 94], ...},
              "decode": {...}},
   "stage_busy_s": [...], "stage_idle_s": [...], "stage_compute_s": [...],
   "utilization": ..., "driver_turnaround_ms": ...}

"prefill" batches carry at least one prompt chunk (with the pipeline's 512-token
budget they also carry decode rows), "decode" batches one token per sequence. Per
stage: `stage_ms_per_batch` is compute (waiting for the previous stage left out),
`stage_idle_s` is time the stage was outside any step, `stage_compute_s` the run's sum
of compute, and `utilization` the share of all ranks' time over the run spent computing.
`driver_turnaround_ms` is the
median time from a batch's result reaching the driver to its next submit. Per phase,
the rest of a batch's round trip, medians: `dispatch_ms` (submit to the first stage's
step start), `inputs_ms` (the first stage's step start to its inputs built by
`prepare_step`), `handoff_ms` (from the later of the previous stage's end and this
stage's step start to its hidden states being in) and `return_ms` (the last stage's
end to the driver holding the result). Which stage sets the pace: `queue_ms` (per rank
after the first stage, how long a batch the previous stage had finished waited for this
one to be free; above 0, this stage is the slower), `gap_ms` (per rank, the time between
a step's end and the next step's start when that batch was already submitted) and
`period_ms` (submit to submit). The
timelines come from `LlamaWorker.get_step_trace` and `Engine.get_batch_trace`
(CLOCK_MONOTONIC, one clock for the host). The layer split and token budget are the
engine's defaults unless given. `--config` runs another layout of
tools/bench_throughput.py instead (once, with the engine's batches in flight); then
the per-stage lists hold one entry per rank in global-rank order, e.g. TP2's two ranks
of one stage. `--alternate ROUNDS` measures the overlap instead: one PP2 session whose
runs alternate between two batches in flight and one (`Engine.set_max_inflight`), one
line per run (with its `work_s`, both stages' compute, `utilization`, and its decode
steps' `decode_stage_ms_per_batch` and `decode_period_ms`), then
{"bench": "pipeline_overlap", "ratio_of_medians": ..., ...}. Each pair's ratio splits
exactly into `pair_work_ratios` (the one-batch run's work over the two-batch run's: below
1 when two smaller batches cost more) times `pair_utilization_ratios` (the two-batch
run's utilization over the one-batch run's: 2 for perfect overlap of two stages).
Each run line also splits its time in `phase_s` at the moment the driver held the last
prompt batch's result ("prefill", then "decode"), and the summary's `pair_phase_ratios`
and `phase_ratio_medians` give each phase's overlap: which phase falls short of 2.
`--alternate-back ROUNDS` compares the BACK move (the last stage's first attention half
run on stage 0 in decode-heavy steps) with none, in one PP2 session: each round runs the
four combinations of BACK allowed or not (`LlamaWorker.set_move_back`) and two or one
batches in flight, one line per run, then {"bench": "pipeline_move_back", "back": {overlap
of the runs with it}, "no_back": {...}, "back_over_no_back_2": [pairs], ...}. With BACK
forbidden the copy is still kept, so the keys still come back after every step.
`--pin-driver CPU` pins this process's threads (the engine's loop and the reply router)
to one CPU once the gang is up: which core the driver's work lands on. `LLM` pins them
itself by default (to the first stage's CPU in PP2, `scheduling.llm.driver_cpus`), and its
engine loop's pinning wins while `generate` runs: add `--no-pin-driver` to try another
CPU, or to leave them to the OS. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]

from bench_throughput import (  # noqa: E402
    CONFIGS,
    NUM_PROMPTS,
    OUTPUT_LEN,
    WARMUP,
    _workload,
    add_engine_switches,
    switched_off,
)


def _median_ms(values: list[float]) -> float:
    return round(1e3 * statistics.median(values), 3)


def _timelines(raw: list) -> list[dict]:
    """Per rank in global-rank order, {batch id: (step start, inputs in, end)} from `get_step_trace`."""
    return [{b: (s, r, e) for b, s, r, e in rank} for rank in raw]


def _compute_seconds(stages: list[dict]) -> list[float]:
    """Per rank, seconds of its steps from their inputs being in to their end.

    As in `stage_ms_per_batch`, building the step's inputs and waiting for the previous
    stage's hidden states are left out; a TP all-reduce's wait is not, it happens
    inside the step.
    """
    return [sum(e - r for _, r, e in stage.values()) for stage in stages]


def _utilization(compute: list[float], run_s: float) -> float:
    """The share of the ranks' time, over the run, that they spent computing."""
    return sum(compute) / (len(compute) * run_s)


def _phase_stats(batches: list[int], stages: list[dict], tp: int, engine: dict[int, tuple[float, float]]) -> dict:
    out: dict = {"batches": len(batches)}
    compute, waits = [], []
    for k, stage in enumerate(stages):
        work = [stage[b][2] - stage[b][1] for b in batches]
        # Ranks of the first stage build their inputs; the others wait for hidden states.
        wait = [stage[b][1] - stage[b][0] for b in batches] if k >= tp else [0.0] * len(batches)
        compute.append(round(1e3 * sum(work) / len(batches), 1))
        waits.append(round(sum(wait), 3))
    out["stage_ms_per_batch"] = compute
    out["stage_recv_wait_s"] = waits
    out["seconds"] = round(stages[0][batches[-1]][2] - stages[0][batches[0]][0], 3)
    # The parts of a batch's round trip that are not compute. With one batch per stage in
    # flight, a stage idles for whatever of them exceeds the other stage's slack.
    first, last = stages[:tp], stages[-tp:]
    out["dispatch_ms"] = _median_ms([min(r[b][0] for r in first) - engine[b][0] for b in batches])  # submit -> stage 0 starts
    out["inputs_ms"] = _median_ms([r[b][1] - r[b][0] for r in first for b in batches])  # stage 0 builds the step's inputs
    out["return_ms"] = _median_ms([engine[b][1] - max(r[b][2] for r in last) for b in batches])  # last stage ends -> driver has it
    handoff = []  # previous stage done and this one waiting -> its inputs are in
    queue = []  # per rank after the first stage: previous stage done -> this rank free (0 if idle)
    for k in range(tp, len(stages)):
        before = stages[(k // tp - 1) * tp : (k // tp) * tp]
        done = {b: max(r[b][2] for r in before) for b in batches}
        handoff += [stages[k][b][1] - max(done[b], stages[k][b][0]) for b in batches]
        queue.append(_median_ms([max(0.0, stages[k][b][0] - done[b]) for b in batches]))
    if handoff:
        out["handoff_ms"] = _median_ms(handoff)
        out["queue_ms"] = queue
    # Per rank, between two steps when the next batch was already submitted: the rank's
    # reply, reading the next call, and whatever else ran on its core meanwhile.
    gaps = []
    for stage in stages:
        steps = sorted(batches, key=lambda b: stage[b][0])
        between = [stage[b][0] - stage[a][2] for a, b in zip(steps, steps[1:]) if engine[b][0] <= stage[a][2]]
        gaps.append(_median_ms(between) if between else None)
    out["gap_ms"] = gaps
    submits = sorted(engine[b][0] for b in batches)
    if len(submits) > 1:
        out["period_ms"] = _median_ms([b - a for a, b in zip(submits, submits[1:])])  # submit to submit
    return out


def _pin_driver(cpu: Optional[int]) -> None:
    """Pins every thread of this process (the engine's caller and the reply router) to `cpu`.

    Called once the gang has started, so that the ranks keep the CPUs `LLM` planned from
    this process's affinity.
    """
    if cpu is None:
        return
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cpu})


def _traced_generate(llm, prompts: list, params) -> tuple[float, list[dict], list[tuple]]:
    """One timed `generate` of `prompts`: (seconds, the ranks' timelines as `_timelines` gives them, the engine's batch trace)."""
    llm.supervisor.collective_rpc("get_step_trace", kwargs={"clear": True})
    llm.engine.get_batch_trace(clear=True)
    start = time.perf_counter()
    llm.generate(prompts, params)
    run_s = time.perf_counter() - start
    return run_s, _timelines(llm.supervisor.collective_rpc("get_step_trace")), llm.engine.get_batch_trace()


def _is_prefill(chunks: int, tokens: int) -> bool:
    # More tokens than chunks: some chunk is a prompt's (decode chunks hold one token).
    return tokens > chunks


def _phase_seconds(batches: list[tuple]) -> dict[str, float]:
    """A run's wall time split at the moment the driver held its last prompt batch's result.

    "prefill": from the first submit to then (decode rows ride along in those batches);
    "decode": from then to the last result. The two add up to the run as the engine saw it.
    """
    start = min(submitted for _, submitted, _, _, _ in batches)
    end = max(seen for _, _, seen, _, _ in batches)
    prompts_done = max((seen for _, _, seen, chunks, tokens in batches if _is_prefill(chunks, tokens)), default=start)
    return {"prefill": round(prompts_done - start, 4), "decode": round(end - prompts_done, 4)}


def _phase_ratios(lines: list[dict]) -> dict:
    """Per phase, each pair's seconds with one batch in flight over its seconds with two, and their medians.

    `lines`: `alternate`'s run lines in the order they ran; the n-th run of each arm makes
    the n-th pair, as in `_overlap`. Which phase falls short of 2 is where the overlap is lost.
    """
    runs: dict[int, list[dict]] = {2: [], 1: []}
    for line in lines:
        runs[line["max_inflight"]].append(line["phase_s"])
    pairs = {
        phase: [round(one[phase] / two[phase], 3) for two, one in zip(runs[2], runs[1]) if two[phase] > 0]
        for phase in ("prefill", "decode")
    }
    return {
        "pair_phase_ratios": pairs,
        "phase_ratio_medians": {phase: round(statistics.median(r), 3) for phase, r in pairs.items() if r},
    }


def _run_line(run_s: float, stages: list[dict], batches: list[tuple]) -> dict:
    """An alternating run's figures: speed, both stages' compute, utilization, and its decode steps' stage times and period."""
    compute = _compute_seconds(stages)
    line = {
        "output_tokens_per_s": round(NUM_PROMPTS * OUTPUT_LEN / run_s, 1),
        "work_s": round(sum(compute), 3),
        "utilization": round(_utilization(compute, run_s), 3),
        "phase_s": _phase_seconds(batches),
    }
    decode = [b for b, _, _, chunks, tokens in batches if not _is_prefill(chunks, tokens)]
    if decode:
        engine = {b: (submitted, seen) for b, submitted, seen, _, _ in batches}
        phase = _phase_stats(decode, stages, 1, engine)
        line["decode_stage_ms_per_batch"] = phase["stage_ms_per_batch"]
        line["decode_period_ms"] = phase.get("period_ms")
    return line


def run(config: str, max_inflight: Optional[int], dtype: str, engine_options: dict, pin_driver: Optional[int] = None) -> dict:
    from scheduling import LLM, SamplingParams

    options = {**CONFIGS[config], **engine_options}
    if max_inflight is not None:
        options["max_inflight"] = max_inflight
    with LLM(model=None, dtype=dtype, **options) as llm:
        _pin_driver(pin_driver)
        specs = _workload(llm.args.vocab_size)
        params = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True)
        llm.generate([s.prompt_token_ids for s in specs[:WARMUP]], params)
        run_s, stages, batches = _traced_generate(llm, [s.prompt_token_ids for s in specs[WARMUP:]], params)
        layer_split = list(llm.layer_split)
        budget = llm.scheduler.max_num_batched_tokens
    engine = {b: (submitted, seen) for b, submitted, seen, _, _ in batches}
    phases = {}
    for name, prompt in (("prefill", True), ("decode", False)):
        ids = [b for b, _, _, chunks, tokens in batches if _is_prefill(chunks, tokens) == prompt]
        if ids:
            phases[name] = _phase_stats(ids, stages, options["tp"], engine)
    submits = sorted(submitted for _, submitted, _, _, _ in batches)
    turnaround = []
    for _, _, seen, _, _ in batches:
        later = bisect.bisect_left(submits, seen)
        if later < len(submits):
            turnaround.append(submits[later] - seen)
    busy = [sum(e - s for s, _, e in stage.values()) for stage in stages]
    compute = _compute_seconds(stages)
    return {
        "bench": "pipeline",
        "config": config,
        "tp": options["tp"],
        "pp": options["pp"],
        "max_inflight": max_inflight if max_inflight is not None else options["pp"],
        "dtype": dtype,
        "layer_split": layer_split,
        "max_num_batched_tokens": budget,
        "output_tokens_per_s": round(NUM_PROMPTS * OUTPUT_LEN / run_s, 1),  # the timed run is NUM_PROMPTS after the warm-up
        "run_s": round(run_s, 3),
        "phases": phases,
        "stage_busy_s": [round(b, 3) for b in busy],
        "stage_idle_s": [round(run_s - b, 3) for b in busy],
        "stage_compute_s": [round(c, 3) for c in compute],
        "utilization": round(_utilization(compute, run_s), 3),
        "driver_turnaround_ms": round(1e3 * statistics.median(turnaround), 2) if turnaround else None,
        "pin_driver": pin_driver,
    }


def _overlap(speeds: dict[int, list[float]], work: dict[int, list[float]], utilization: dict[int, list[float]]) -> dict:
    """The overlap figures of `alternate`'s runs, each dict keyed by batches in flight (2, 1), runs in pair order.

    Each pair's speed ratio is exactly its work ratio (work with one in flight over work
    with two: what two smaller batches cost extra) times its utilization ratio (with two
    over with one: how much more of the stages' time two batches keep busy).
    """
    pairs = [two / one for two, one in zip(speeds[2], speeds[1])]
    return {
        "inflight2_median": round(statistics.median(speeds[2]), 1),
        "inflight1_median": round(statistics.median(speeds[1]), 1),
        "ratio_of_medians": round(statistics.median(speeds[2]) / statistics.median(speeds[1]), 3),
        "pair_ratios": [round(p, 3) for p in pairs],
        "median_pair_ratio": round(statistics.median(pairs), 3),
        "pair_work_ratios": [round(one / two, 3) for two, one in zip(work[2], work[1])],
        "pair_utilization_ratios": [round(two / one, 3) for two, one in zip(utilization[2], utilization[1])],
        "utilization_medians": {str(k): round(statistics.median(v), 3) for k, v in utilization.items()},
    }


def _alternating(
    arms: list, rounds: int, dtype: str, engine_options: dict, configure, pin_driver: Optional[int] = None
) -> tuple[list[dict], dict, dict, dict]:
    """One PP2 session that runs every arm once a round, in order, the order reversed every other round,
    after an untimed pass over the workload.

    `configure(llm, arm)` sets the gang up for the arm between runs and returns the arm's
    fields for its line. Prints one line per run; returns the lines and, keyed by arm,
    each run's output tokens/s, work (seconds both stages computed) and utilization.
    """
    from scheduling import LLM, SamplingParams

    lines = []
    speeds: dict = {arm: [] for arm in arms}
    work: dict = {arm: [] for arm in arms}
    utilization: dict = {arm: [] for arm in arms}
    with LLM(model=None, dtype=dtype, **{**CONFIGS["pp2"], **engine_options}) as llm:
        _pin_driver(pin_driver)
        specs = _workload(llm.args.vocab_size)
        params = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True)
        prompts = [s.prompt_token_ids for s in specs[WARMUP:]]
        llm.generate([s.prompt_token_ids for s in specs[:WARMUP]], params)
        # One untimed pass of the whole workload: a session's first pass grows the ranks to
        # their working set (PP2: some 50,000 page faults, under a hundred in later passes) and
        # ran 2-20% slower than the next in probes, which counted against whichever arm ran first.
        configure(llm, arms[0])
        llm.generate(prompts, params)
        for r in range(rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                fields = configure(llm, arm)
                run_s, stages, batches = _traced_generate(llm, prompts, params)
                compute = _compute_seconds(stages)
                speeds[arm].append(NUM_PROMPTS * OUTPUT_LEN / run_s)
                work[arm].append(sum(compute))
                utilization[arm].append(_utilization(compute, run_s))
                line = {"bench": "pipeline_run", "round": r, **fields, **_run_line(run_s, stages, batches)}
                print(json.dumps(line), flush=True)
                lines.append(line)
    return lines, speeds, work, utilization


def _set_inflight(llm, inflight: int) -> dict:
    llm.engine.set_max_inflight(inflight)
    return {"max_inflight": inflight}


def alternate(rounds: int, dtype: str, engine_options: dict, pin_driver: Optional[int] = None) -> list[dict]:
    """PP2's overlap measured in one session: runs alternate between two batches in flight and one.

    On a machine whose speed drifts, pairs taken side by side in one process compare
    better than two separate runs: the same ranks, warm, a few seconds apart, the order
    flipped every round.
    """
    lines, speeds, work, utilization = _alternating([2, 1], rounds, dtype, engine_options, _set_inflight, pin_driver)
    summary = {
        "bench": "pipeline_overlap",
        "config": "pp2",
        "dtype": dtype,
        "rounds": rounds,
        "pin_driver": pin_driver,
        **_overlap(speeds, work, utilization),
        **_phase_ratios(lines),
    }
    print(json.dumps(summary), flush=True)
    return lines + [summary]


def _set_back_and_inflight(llm, arm: tuple[bool, int]) -> dict:
    back, inflight = arm
    able = llm.supervisor.collective_rpc("set_move_back", args=(back,))
    if back and not all(able):
        raise SystemExit("this layout keeps no copy to move attention back (LlamaWorker.set_move_back)")
    return {"move_back": back, **_set_inflight(llm, inflight)}


def alternate_back(rounds: int, dtype: str, engine_options: dict) -> list[dict]:
    """PP2 with and without BACK moves, each with two batches in flight and one, in one session (see the module docstring)."""
    names = {True: "back", False: "no_back"}
    arms = [(back, n) for back in names for n in (2, 1)]
    lines, speeds, work, utilization = _alternating(arms, rounds, dtype, engine_options, _set_back_and_inflight)
    summary: dict = {"bench": "pipeline_move_back", "dtype": dtype, "rounds": rounds}
    for back, name in names.items():
        pick = lambda d: {n: d[(back, n)] for n in (2, 1)}  # noqa: E731
        summary[name] = _overlap(pick(speeds), pick(work), pick(utilization))
    for n in (2, 1):
        summary[f"back_over_no_back_{n}"] = [round(a / b, 3) for a, b in zip(speeds[(True, n)], speeds[(False, n)])]
    print(json.dumps(summary), flush=True)
    return lines + [summary]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="pp2", choices=["pp2", "tp1_1thread", "tp1_2threads", "tp2", "tp2pp2"])
    parser.add_argument("--inflight", type=int, nargs="+", help="batches in flight, one run each (pp2: 2 and 1)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--alternate", type=int, metavar="ROUNDS",
                        help="pp2 only: in one session, ROUNDS pairs of runs with 2 and 1 batches in flight "
                             "(order flipped each round); one line per run, then the overlap")
    parser.add_argument("--alternate-back", type=int, metavar="ROUNDS",
                        help="pp2 only: in one session, ROUNDS rounds of the four runs with BACK moves allowed or "
                             "not and 2 or 1 batches in flight; one line per run, then both overlaps")
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--layer-split", type=int, nargs="+", metavar="N")
    parser.add_argument("--pin-driver", type=int, metavar="CPU",
                        help="once the gang is up, pin this process's threads (the driver) to CPU")
    add_engine_switches(parser)
    args = parser.parse_args()
    options: dict = switched_off(args)
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.layer_split:
        options["layer_split"] = args.layer_split
    if args.alternate:
        if args.config != "pp2":
            parser.error("--alternate measures pp2's overlap; leave --config at pp2")
        alternate(args.alternate, args.dtype, options, args.pin_driver)
        return
    if args.alternate_back:
        if args.config != "pp2":
            parser.error("--alternate-back measures pp2; leave --config at pp2")
        alternate_back(args.alternate_back, args.dtype, options)
        return
    inflights = args.inflight or ([2, 1] if args.config == "pp2" else [None])
    for inflight in inflights:
        print(json.dumps(run(args.config, inflight, args.dtype, options, args.pin_driver)), flush=True)


if __name__ == "__main__":
    main()
