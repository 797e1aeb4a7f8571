"""tools/bench_pipeline.py's per-phase figures, computed from a timeline written out by hand."""

from __future__ import annotations

import pytest

from tools import bench_pipeline


def _s(*ms: float) -> tuple[float, ...]:
    return tuple(t / 1e3 for t in ms)


def test_phase_stats_name_the_slower_stage():
    # Two stages, two batches in flight. Stage 0 computes for 9.9 ms a batch, stage 1 for
    # 12 ms, so stage 1 sets the pace: each batch stage 0 finishes waits for it. Each rank's
    # (step start, inputs in, end); stage 1 takes batch 0's call at once and then waits
    # for its hidden states.
    stage0 = {0: _s(0, 0.1, 10), 1: _s(10.2, 10.3, 20.2), 2: _s(22.4, 22.5, 32.4), 3: _s(34.8, 34.9, 44.8)}
    stage1 = {0: _s(0.05, 10.1, 22.1), 1: _s(22.4, 22.5, 34.5), 2: _s(34.8, 34.9, 46.9), 3: _s(47.2, 47.3, 59.3)}
    # (submitted, result seen by the driver): batches 2 and 3 are the next steps of 0 and 1.
    engine = {0: _s(0, 22.3), 1: _s(0, 34.7), 2: _s(22.3, 47.1), 3: _s(34.7, 59.5)}

    out = bench_pipeline._phase_stats([0, 1, 2, 3], [stage0, stage1], 1, engine)

    assert out["batches"] == 4
    assert out["stage_ms_per_batch"] == [9.9, 12.0]
    # Batch 0 found stage 1 idle; 1, 2 and 3 waited 2.2, 2.4 and 2.4 ms for it.
    assert out["queue_ms"] == [pytest.approx(2.3)]
    # Stage 0 only counts 0 -> 1 (batches 2 and 3 were submitted after its previous step
    # ended); stage 1 spends 0.3 ms between each of its steps.
    assert out["gap_ms"] == [pytest.approx(0.2), pytest.approx(0.3)]
    # Submits at 0, 0, 22.3 and 34.7 ms.
    assert out["period_ms"] == pytest.approx(12.4)
    assert out["return_ms"] == pytest.approx(0.2)
    # Submit to stage 0's start: 0, 10.2 (batch 1 waited for batch 0), 0.1, 0.1.
    assert out["dispatch_ms"] == pytest.approx(0.1)


def test_a_run_line_takes_the_decode_figures_from_decode_batches_only():
    # The same timeline as above, plus a prompt batch (5) first: 512 tokens in 4 chunks.
    stage0 = {5: _s(-80, -79.9, -40), 0: _s(0, 0.1, 10), 1: _s(10.2, 10.3, 20.2), 2: _s(22.4, 22.5, 32.4),
              3: _s(34.8, 34.9, 44.8)}
    stage1 = {5: _s(-79.9, -39.8, -0.2), 0: _s(0.05, 10.1, 22.1), 1: _s(22.4, 22.5, 34.5), 2: _s(34.8, 34.9, 46.9),
              3: _s(47.2, 47.3, 59.3)}
    batches = [(5, *_s(-80, -0.1), 4, 512), (0, *_s(0, 22.3), 32, 32), (1, *_s(0, 34.7), 32, 32),
               (2, *_s(22.3, 47.1), 32, 32), (3, *_s(34.7, 59.5), 32, 32)]

    line = bench_pipeline._run_line(0.25, [stage0, stage1], batches)

    assert line["decode_stage_ms_per_batch"] == [9.9, 12.0]  # the prompt batch's 39.9 ms left out
    assert line["decode_period_ms"] == pytest.approx(12.4)
    # Compute (inputs in to end) of all five batches on both stages (39.9 + 4 x 9.9 ms and
    # 39.6 + 4 x 12 ms), over 2 x 0.25 s.
    assert line["work_s"] == pytest.approx(0.0795 + 0.0876, abs=1e-3)
    assert line["utilization"] == pytest.approx(line["work_s"] / 0.5, abs=2e-3)
    assert line["output_tokens_per_s"] == pytest.approx(bench_pipeline.NUM_PROMPTS * bench_pipeline.OUTPUT_LEN / 0.25)


def test_phase_stats_one_stage_has_no_queue():
    stage0 = {0: _s(0.5, 0.6, 10), 1: _s(10.5, 10.6, 20)}
    engine = {0: _s(0, 10.2), 1: _s(10.2, 20.2)}
    out = bench_pipeline._phase_stats([0, 1], [stage0], 1, engine)
    assert "queue_ms" not in out and "handoff_ms" not in out
    # Batch 1 was submitted after batch 0's step ended: no gap is counted.
    assert out["gap_ms"] == [None]
    assert out["period_ms"] == pytest.approx(10.2)


def test_pin_driver_pins_every_thread_of_the_process():
    import os
    import threading

    started, stop = threading.Event(), threading.Event()
    helper = threading.Thread(target=lambda: (started.set(), stop.wait()), daemon=True)
    helper.start()
    started.wait()
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    before = {tid: os.sched_getaffinity(tid) for tid in tids}
    cpu = min(os.sched_getaffinity(0))
    try:
        bench_pipeline._pin_driver(None)
        assert {tid: os.sched_getaffinity(tid) for tid in tids} == before
        bench_pipeline._pin_driver(cpu)
        assert os.sched_getaffinity(helper.native_id) == {cpu}
        assert os.sched_getaffinity(0) == {cpu}
        assert all(os.sched_getaffinity(tid) == {cpu} for tid in tids if os.path.exists(f"/proc/self/task/{tid}"))
    finally:
        for tid, cpus in before.items():
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                pass
        stop.set()
        helper.join()


def test_compute_and_utilization_split_the_overlap_into_work_and_busy_time():
    # One batch in flight: stage 0 computes 10 ms of each step after 0.1 ms of building
    # inputs, stage 1 waits for it and then computes 12 ms; two steps in a 45 ms run.
    one = [
        {0: _s(0, 0.1, 10.1), 1: _s(22.5, 22.6, 32.6)},
        {0: _s(0.05, 10.2, 22.2), 1: _s(22.55, 32.7, 44.7)},
    ]
    # Two in flight: four half-size steps of 6 and 7 ms (26 ms of work against 44 ms), 29 ms.
    two = [
        {0: _s(0, 0.1, 6.1), 1: _s(6.1, 6.2, 12.2), 2: _s(14.5, 14.6, 20.6), 3: _s(20.6, 20.7, 26.7)},
        {0: _s(0.05, 6.2, 13.2), 1: _s(13.2, 13.3, 20.3), 2: _s(20.3, 20.7, 27.7), 3: _s(27.7, 27.8, 34.8)},
    ]
    compute_one = bench_pipeline._compute_seconds(one)
    compute_two = bench_pipeline._compute_seconds(two)
    # Waiting for hidden states and building inputs are left out.
    assert compute_one == [pytest.approx(0.020), pytest.approx(0.024)]
    assert compute_two == [pytest.approx(0.024), pytest.approx(0.028)]
    run_one, run_two = 0.045, 0.035
    util_one = bench_pipeline._utilization(compute_one, run_one)
    util_two = bench_pipeline._utilization(compute_two, run_two)
    assert util_one == pytest.approx(0.044 / 0.090)
    assert util_two == pytest.approx(0.052 / 0.070)
    # The speed ratio is the work ratio times the utilization ratio, whatever the runs.
    work_ratio = sum(compute_one) / sum(compute_two)
    assert run_one / run_two == pytest.approx(work_ratio * util_two / util_one)
    # --alternate's summary of that pair: two smaller batches cost more work (ratio below
    # 1) and keep the stages busier (ratio above 1); their product is the speed ratio.
    out = bench_pipeline._overlap(
        {2: [1 / run_two], 1: [1 / run_one]},
        {2: [sum(compute_two)], 1: [sum(compute_one)]},
        {2: [util_two], 1: [util_one]},
    )
    assert out["pair_ratios"] == [round(run_one / run_two, 3)]
    assert out["pair_work_ratios"] == [round(0.044 / 0.052, 3)]
    assert out["pair_utilization_ratios"] == [round(util_two / util_one, 3)]
    assert out["pair_ratios"][0] == pytest.approx(out["pair_work_ratios"][0] * out["pair_utilization_ratios"][0], abs=2e-3)
    assert out["utilization_medians"] == {"2": round(util_two, 3), "1": round(util_one, 3)}


def test_phase_seconds_split_a_run_where_the_last_prompt_batch_came_back():
    # (batch id, submitted, seen, chunks, tokens): two prompt batches (each 4 chunks of 128
    # tokens, the second with 4 decode rows too), then decode batches of 32 rows.
    batches = [
        (0, *_s(0, 90), 4, 512), (1, *_s(1, 130), 8, 516),
        (2, *_s(90, 110), 32, 32), (3, *_s(130, 150), 32, 32), (4, *_s(110, 170), 32, 32),
    ]
    assert bench_pipeline._phase_seconds(batches) == {"prefill": 0.13, "decode": 0.04}
    # A run with no prompt batch is all decode.
    assert bench_pipeline._phase_seconds(batches[2:]) == {"prefill": 0.0, "decode": pytest.approx(0.08)}


def test_phase_ratios_pair_the_runs_in_order_per_phase():
    lines = [
        {"max_inflight": 2, "phase_s": {"prefill": 0.5, "decode": 0.8}},
        {"max_inflight": 1, "phase_s": {"prefill": 0.9, "decode": 1.2}},
        {"max_inflight": 1, "phase_s": {"prefill": 1.0, "decode": 1.4}},
        {"max_inflight": 2, "phase_s": {"prefill": 0.55, "decode": 0.7}},
        {"max_inflight": 2, "phase_s": {"prefill": 0.5, "decode": 0.75}},
        {"max_inflight": 1, "phase_s": {"prefill": 0.95, "decode": 1.25}},
    ]
    out = bench_pipeline._phase_ratios(lines)
    assert out["pair_phase_ratios"] == {
        "prefill": [round(0.9 / 0.5, 3), round(1.0 / 0.55, 3), round(0.95 / 0.5, 3)],
        "decode": [round(1.2 / 0.8, 3), round(1.4 / 0.7, 3), round(1.25 / 0.75, 3)],
    }
    assert out["phase_ratio_medians"] == {"prefill": round(1.0 / 0.55, 3), "decode": round(1.25 / 0.75, 3)}
