"""The sharded Llama across actor processes (actors.Supervisor), against transformers.

One gang per layout, shared by the tests of that layout (a class-scoped fixture).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors import ActorStartupError, RemoteError, Supervisor
from models.batch import ModelBatch, SequenceChunk
from models.loader import CheckpointError
from tests.conftest import child_pids
from tests.model_checkpoints import (
    ODD,
    PROMPTS,
    block_tables,
    build_checkpoint,
    prefill_batch,
    reference_greedy,
    reference_last_logits,
    run_greedy,
)

pytestmark = pytest.mark.timeout(300)

BLOCK = 8
NEW_TOKENS = 6
WORKER = "models.worker:LlamaWorker"


@dataclass(frozen=True)
class Case:
    checkpoint: str
    tp: int
    pp: int
    layer_split: Optional[tuple[int, ...]] = None

    def __str__(self) -> str:
        split = f"-split{'_'.join(map(str, self.layer_split))}" if self.layer_split else ""
        return f"{self.checkpoint}-tp{self.tp}pp{self.pp}{split}"


CASES = [
    Case("sharded", 1, 1),
    Case("sharded", 2, 1),
    Case("sharded", 1, 2),
    Case("sharded", 2, 2),
    # vocab % tp, layers % pp, one kv head for two tp ranks, intermediate % tp.
    Case("odd", 2, 2),
    # LM head on the last stage from the embedding tensor; an uneven split given by hand.
    Case("tied", 2, 2, layer_split=(1, 3)),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    return {
        "sharded": build_checkpoint(root / "sharded", max_shard_size="100KB"),
        "odd": build_checkpoint(root / "odd", seed=4, **ODD),
        "tied": build_checkpoint(root / "tied", seed=2, tie_word_embeddings=True),
    }


def worker_kwargs(path: str, **extra: Any) -> dict[str, Any]:
    return dict(model=path, kv_cache_bytes=2**20, block_size=BLOCK, **extra)


def leftover_children(grace: float = 5.0) -> list[int]:
    deadline = time.monotonic() + grace
    while child_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    return child_pids()


def execute(sup: Supervisor):
    return lambda batch: sup.submit("execute_model", args=(batch,)).result(timeout=120)


@pytest.fixture(scope="class", params=CASES, ids=str)
def gang(request, checkpoints):
    case: Case = request.param
    kwargs = worker_kwargs(checkpoints[case.checkpoint], layer_split=case.layer_split)
    with Supervisor(worker=WORKER, worker_kwargs=kwargs, tp_size=case.tp, pp_size=case.pp, start_timeout=120.0) as sup:
        sup.collective_rpc("init_distributed")
        infos = sup.collective_rpc("load_model")
        yield case, checkpoints[case.checkpoint], sup, infos
    assert not leftover_children(), "the gang left processes behind"


class TestLayout:
    """One gang per layout (class-scoped: torn down before the tests below start their own)."""

    def test_greedy_tokens_match_transformers(self, gang):
        _, path, sup, _ = gang
        assert run_greedy(execute(sup), PROMPTS, NEW_TOKENS, BLOCK) == reference_greedy(path, PROMPTS, NEW_TOKENS)

    def test_last_position_logits_match_transformers(self, gang):
        _, path, sup, _ = gang
        tables = block_tables([len(p) for p in PROMPTS], BLOCK)
        logits = sup.submit("compute_logits", args=(prefill_batch(PROMPTS, tables),)).result(timeout=120)
        torch.testing.assert_close(logits, reference_last_logits(path, PROMPTS), atol=1e-4, rtol=0)

    def test_pp_size_batches_in_flight_give_the_same_tokens(self, gang):
        """Two interleaved groups of sequences, the next batch submitted before the last one returned."""
        case, path, sup, _ = gang
        groups = [PROMPTS[0::2], PROMPTS[1::2]]
        tables = block_tables([len(p) + NEW_TOKENS for p in PROMPTS], BLOCK)
        group_tables = [tables[0::2], tables[1::2]]
        seqs = [[list(p) for p in g] for g in groups]
        batch_id = 0

        def batch_for(g: int, n: int) -> ModelBatch:
            nonlocal batch_id
            batch_id += 1
            if n == 0:
                chunks = [SequenceChunk(i, list(p), 0, group_tables[g][i]) for i, p in enumerate(groups[g])]
            else:
                chunks = [
                    SequenceChunk(i, [s[-1]], len(s) - 1, group_tables[g][i], num_generated=n)
                    for i, s in enumerate(seqs[g])
                ]
            return ModelBatch(batch_id, chunks)

        pending = {g: sup.submit("execute_model", args=(batch_for(g, 0),)) for g in (0, 1)}
        for n in range(1, NEW_TOKENS + 1):
            for g in (0, 1):
                out = pending[g].result(timeout=120)
                for seq, token in zip(seqs[g], out.token_ids):
                    seq.append(token)
                if n < NEW_TOKENS:
                    pending[g] = sup.submit("execute_model", args=(batch_for(g, n),))
        expected = reference_greedy(path, PROMPTS, NEW_TOKENS)
        assert seqs == [expected[0::2], expected[1::2]]

    def test_ranks_report_their_share_and_one_cache_size(self, gang):
        case, _, sup, infos = gang
        assert len({info["num_blocks"] for info in infos}) == 1
        stats = sup.collective_rpc("get_stats")
        assert [s["rank"] for s in stats] == [(pp, tp) for pp in range(case.pp) for tp in range(case.tp)]
        layers = sorted({s["layers"] for s in stats})
        assert layers[0][0] == 0 and all(a[1] == b[0] for a, b in zip(layers, layers[1:]))
        if case.layer_split:
            assert [b - a for a, b in layers] == list(case.layer_split)
        assert all(s["peak_rss_bytes"] > 0 and s["num_params"] > 0 for s in stats)
        # Pipeline waits: a first stage never receives; a later one has waited for its inputs.
        for s in stats:
            assert s["send_wait_seconds"] >= 0 and s["execute_seconds"] > 0
            assert (s["recv_seconds"] == 0) if s["first_stage"] else (s["recv_seconds"] > 0)
        health = sup.collective_rpc("check_health")
        assert all(h["loaded"] and h["distributed"] for h in health)


def test_tp_larger_than_heads_fails_startup_naming_the_rank(tmp_path):
    path = build_checkpoint(tmp_path / "one_head", num_attention_heads=1, num_key_value_heads=1, hidden_size=32)
    start = time.monotonic()
    with pytest.raises(ActorStartupError) as info:
        Supervisor(worker=WORKER, worker_kwargs=worker_kwargs(path), tp_size=2, pp_size=1, start_timeout=120.0)
    message = str(info.value)
    assert "tp_size=2 is larger than num_attention_heads=1" in message
    assert "rank (pp=0, tp=" in message
    assert time.monotonic() - start < 60
    assert not leftover_children()


def test_wrong_shape_on_one_stage_fails_load_naming_that_rank(checkpoints, tmp_path):
    path = tmp_path / "broken"
    shutil.copytree(checkpoints["odd"], path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.2.mlp.down_proj.weight"  # layer 2 is on stage 1 of 2
    tensors[name] = tensors[name][:, :50].contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with Supervisor(worker=WORKER, worker_kwargs=worker_kwargs(os.fspath(path)), tp_size=1, pp_size=2) as sup:
        sup.collective_rpc("init_distributed")
        with pytest.raises(RemoteError) as info:
            sup.collective_rpc("load_model")
    err = info.value
    assert isinstance(err, CheckpointError)
    assert err.rank == (1, 0)
    assert f"'{name}'" in str(err) and "has shape [64, 50], expected [64, 101]" in str(err)
    assert "rank (pp=1, tp=0)" in str(err)


class _FakeTP:
    """Two tp ranks in one process: rank 0's gather concatenates what rank 1 gave."""

    def __init__(self, rank: int, sent: list) -> None:
        self.rank, self.size, self.sent = rank, 2, sent

    def gather_to_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.rank == 1:
            self.sent.append(x)
            return x
        return torch.cat([x, self.sent.pop()], dim=dim)


def test_shard_argmax_is_the_full_vocabulary_argmax():
    from models.parallel import VocabParallelLMHead

    vocab, dim, rows = 9, 4, 5  # the second shard holds ids 5..8 plus one zero padding row
    full = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(0))
    h = torch.randn(6, dim, generator=torch.Generator().manual_seed(1))
    full[:] = -full.abs()  # every real logit of a positive row is negative: a padding logit (0) would win
    h[:3] = h[:3].abs()
    full[2] = full[7] = torch.tensor([-5.0, 0.0, 0.0, 0.0])  # ids 2 and 7 tie for row 3: the first must win
    h[3] = torch.tensor([-1.0, 0.0, 0.0, 0.0])
    sent: list = []
    heads = []
    for rank, (lo, hi) in enumerate([(0, 5), (5, 9)]):
        head = VocabParallelLMHead(dim, rows, vocab, _FakeTP(rank, sent), lo, hi)
        with torch.no_grad():
            head.weight.zero_()
            head.weight[: hi - lo] = full[lo:hi]
        heads.append(head)
    expected = (h @ full.T).max(dim=-1).indices
    assert expected[3] == 2 and (h[3] @ full.T)[7] == (h[3] @ full.T)[2]
    assert ((h[:3] @ full.T) < 0).all()
    with torch.no_grad():
        assert heads[1].argmax(h) is None
        got = heads[0].argmax(h)
    assert got.tolist() == expected.tolist()
