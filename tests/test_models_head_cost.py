"""HeadCostMeter: the LM head's cost in decoder layers, from the last stage's own step times."""

from __future__ import annotations

import pytest

from models.head_cost import HeadCostMeter


def test_the_cost_is_the_head_time_per_layer_time_of_the_step():
    meter = HeadCostMeter(window=4, min_rows=8, min_samples=3)
    # 3 layers took 6 ms (2 ms each), the head 5 ms: 2.5 layers.
    meter.observe(rows=32, layers_run=3.0, layers_seconds=0.006, head_seconds=0.005)
    meter.observe(rows=32, layers_run=3.0, layers_seconds=0.006, head_seconds=0.005)
    assert meter.value is None  # too few steps yet
    # A BACK step ran 2.33 layers' worth in 4.66 ms: still 2 ms a layer, so the head's 4 ms is 2 layers.
    meter.observe(rows=32, layers_run=2.33, layers_seconds=0.00466, head_seconds=0.004)
    assert meter.value == pytest.approx(2.5)  # the median of 2.5, 2.5, 2.0


def test_small_steps_are_left_out_and_old_ones_age_out():
    meter = HeadCostMeter(window=3, min_rows=8, min_samples=1)
    meter.observe(rows=4, layers_run=3.0, layers_seconds=0.003, head_seconds=0.1)  # overheads mostly: ignored
    assert meter.value is None
    for head_ms in (3.0, 3.0, 3.0, 1.0, 1.0):
        meter.observe(rows=8, layers_run=3.0, layers_seconds=0.003, head_seconds=head_ms / 1e3)
    assert meter.value == pytest.approx(1.0)  # the window holds 3.0, 1.0, 1.0
    meter.observe(rows=8, layers_run=0.0, layers_seconds=0.003, head_seconds=0.001)  # nothing to compare with
    meter.observe(rows=8, layers_run=3.0, layers_seconds=0.0, head_seconds=0.001)
    assert meter.value == pytest.approx(1.0)


def test_a_window_smaller_than_the_samples_needed_is_refused():
    with pytest.raises(ValueError, match="min_samples"):
        HeadCostMeter(window=2, min_samples=3)
