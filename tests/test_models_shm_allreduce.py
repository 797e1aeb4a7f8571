"""The shared-memory all-reduce of TP ranks on one host, run in real actor processes."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from actors import ActorDied, Supervisor
from tests.workers import allreduce_inputs

WORKER = "tests.workers:AllReduceWorker"
CAPACITY = 4096  # bytes per slot: small, so tensors of a few KiB already go in pieces


def rank_order_sum(numel: int, dtype: torch.dtype, seed: int, size: int) -> torch.Tensor:
    parts = [allreduce_inputs(numel, dtype, seed, r) for r in range(size)]
    total = parts[0] + parts[1]
    for p in parts[2:]:
        total += p
    return total


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks_on_2cores"])
def gang(request):
    with Supervisor(WORKER, {"capacity": CAPACITY}, tp_size=request.param, start_timeout=60) as sup:
        assert all(sup.collective_rpc("attached"))
        yield sup


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_equals_the_rank_order_sum(gang, dtype):
    size = gang.world_size
    results = gang.collective_rpc("reduce", args=(1000, dtype, 7))
    expected = rank_order_sum(1000, dtype, 7, size)
    for got in results:
        assert torch.equal(got, expected)
    exact = sum(allreduce_inputs(1000, dtype, 7, r).double() for r in range(size))
    assert torch.allclose(results[0].double(), exact, rtol=2e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-2)


def test_every_rank_gets_bit_identical_results(gang):
    results = gang.collective_rpc("reduce", args=(777, torch.bfloat16, 11))
    raw = [r.view(torch.uint8) for r in results]
    assert all(torch.equal(raw[0], r) for r in raw[1:])


def test_tensor_larger_than_the_buffer_goes_in_pieces(gang):
    numel = 10 * CAPACITY // 4 + 3  # ten and a bit slots of float32
    results = gang.collective_rpc("reduce", args=(numel, torch.float32, 3))
    expected = rank_order_sum(numel, torch.float32, 3, gang.world_size)
    assert all(torch.equal(r, expected) for r in results)


def test_non_contiguous_tensor_is_reduced_in_place(gang):
    results = gang.collective_rpc("reduce", args=(300, torch.float32, 5), kwargs={"strided": True})
    assert all(torch.equal(r, rank_order_sum(300, torch.float32, 5, gang.world_size)) for r in results)


def test_many_iterations_of_mixed_sizes_stay_exact_and_in_step(gang):
    sizes = [random.Random(1).choice([1, 7, 512, 1024, 3000]) for _ in range(2000)]
    start = time.monotonic()
    results = gang.collective_rpc("reduce_many", args=(sizes, torch.bfloat16, 100), timeout=120)
    assert [wrong for wrong, _ in results] == [0] * gang.world_size
    assert len({digest for _, digest in results}) == 1
    assert time.monotonic() - start < 60  # more ranks than cores must not livelock


def test_the_file_is_unlinked_once_every_rank_has_mapped_it(gang):
    # From then on the memory lives only in the mappings and goes with the last process.
    paths = gang.collective_rpc("shm_path")
    assert len(set(paths)) == 1 and os.path.basename(paths[0]).startswith("pipeactors-allreduce-")
    assert not os.path.exists(paths[0])


def test_a_missing_peer_times_out_naming_it():
    with Supervisor(WORKER, {"capacity": CAPACITY, "timeout_s": 0.5}, tp_size=2, start_timeout=60) as sup:
        start = time.monotonic()
        answers = sup.collective_rpc("reduce_unless", args=(1,), timeout=30)
        assert time.monotonic() - start < 10
    assert answers[1] == "absent"
    assert "tp ranks [1] did not reach call 1" in answers[0]


def test_ranks_that_cannot_map_the_file_all_fall_back():
    with Supervisor(WORKER, {"directory": "/nonexistent-dir"}, tp_size=2, start_timeout=60) as sup:
        assert sup.collective_rpc("attached") == [False, False]


def test_a_killed_rank_fails_the_call_and_leaves_no_file():
    sup = Supervisor(WORKER, {"capacity": CAPACITY}, tp_size=2, start_timeout=60)
    try:
        path = sup.collective_rpc("shm_path")[0]
        os.kill(sup.collective_rpc("pid")[1], signal.SIGKILL)
        with pytest.raises(ActorDied):
            sup.collective_rpc("reduce", args=(4, torch.float32, 2), timeout=30)
    finally:
        sup.close()
    assert not os.path.exists(path)
