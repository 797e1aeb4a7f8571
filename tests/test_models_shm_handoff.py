"""The shared-memory handoff of hidden states between two pipeline ranks, run in real actor processes."""

from __future__ import annotations

import os
import signal
import time

import pytest

from actors import ActorDied, Supervisor

WORKER = "tests.workers:HandoffWorker"
CAPACITY = 4096  # ring bytes: small, so messages wrap around and the larger ones go in pieces


@pytest.fixture(scope="module")
def pair():
    with Supervisor(WORKER, {"capacity": CAPACITY}, pp_size=2, start_timeout=60) as sup:
        assert sup.collective_rpc("attached") == [True, True]
        yield sup


def test_messages_arrive_in_order_and_bit_exact_across_wraps_and_pieces(pair):
    # Sizes in bytes from a few to 10x the ring, float32 and bfloat16 alternating.
    sizes = [1, 3, 100, 1000, 1023, 5000, 10 * CAPACITY // 4 + 3]
    results = pair.collective_rpc("stream", args=(300, 1, sizes), timeout=120)
    (_, sent, _), (wrong, received, _) = results
    assert wrong == 0 and sent == received


@pytest.mark.parametrize("group", [(3, 1), (1, 4), (5, 2)])
def test_messages_sent_and_received_several_at_a_time_are_the_same_bytes(pair, group):
    # One send call of several tensors rings the doorbell once; the receiver may take them
    # in other groupings, across wraps and pieces.
    sizes = [1, 100, 1023, 5000, 10 * CAPACITY // 4 + 3]
    (_, sent, _), (wrong, received, _) = pair.collective_rpc("stream", args=(61, 4, sizes, 0.0, group), timeout=120)
    assert wrong == 0 and sent == received


def test_a_waiting_receiver_blocks_instead_of_spinning(pair):
    # The sender starts 0.5 s late: the receiver spends that in select(), not on the CPU.
    (_, sent, _), (wrong, received, cpu_s) = pair.collective_rpc("stream", args=(3, 2, [64], 0.5), timeout=60)
    assert wrong == 0 and sent == received
    assert cpu_s < 0.15


def test_the_files_are_removed_once_both_ranks_have_them(pair):
    paths = pair.collective_rpc("path")
    assert len(set(paths)) == 1 and os.path.basename(paths[0]).startswith("pipeactors-handoff-")
    assert not os.path.exists(paths[0]) and not os.path.exists(paths[0] + ".bell")


def test_a_receiver_whose_sender_closed_raises_naming_it():
    with Supervisor(WORKER, {"capacity": CAPACITY}, pp_size=2, start_timeout=60) as sup:
        start = time.monotonic()
        sent, received = sup.collective_rpc("send_then_close", args=(100,), timeout=30)
        assert time.monotonic() - start < 10
    assert sent == "sent"
    assert received == "shared-memory handoff: the sending rank 0 is gone"


def test_a_sender_whose_receiver_closed_raises_naming_it():
    with Supervisor(WORKER, {"capacity": CAPACITY}, pp_size=2, start_timeout=60) as sup:
        sup.collective_rpc("close_receiver")
        start = time.monotonic()
        answer = sup.collective_rpc("send_past_a_closed_receiver", args=(4 * CAPACITY,), timeout=30)[0]
        assert time.monotonic() - start < 10
    assert answer == "shared-memory handoff: the receiving rank 1 is gone"


def test_a_silent_sender_times_out_naming_it():
    with Supervisor(WORKER, {"capacity": CAPACITY, "timeout_s": 0.5}, pp_size=2, start_timeout=60) as sup:
        start = time.monotonic()
        answers = sup.collective_rpc("recv_alone", timeout=30)
        assert time.monotonic() - start < 10
    assert answers == ["absent", "shared-memory handoff: rank 0 sent nothing for 0.5s"]


def test_ranks_that_cannot_create_the_files_both_fall_back():
    with Supervisor(WORKER, {"directory": "/nonexistent-dir"}, pp_size=2, start_timeout=60) as sup:
        assert sup.collective_rpc("attached") == [False, False]


def test_a_killed_sender_fails_the_call_and_leaves_no_file():
    sup = Supervisor(WORKER, {"capacity": CAPACITY}, pp_size=2, start_timeout=60)
    try:
        path = sup.collective_rpc("path")[0]
        os.kill(sup.collective_rpc("pid")[0], signal.SIGKILL)
        with pytest.raises(ActorDied):
            sup.collective_rpc("stream", args=(5, 3, [256]), timeout=30)
    finally:
        sup.close()
    assert not os.path.exists(path) and not os.path.exists(path + ".bell")
