"""Fused q/k/v and gate/up projections (models/fuse.py) compute what the separate linears compute."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from actors.context import ActorContext
from models.batch import ModelBatch, SequenceChunk
from models.config import load_config
from models.fuse import fuse_projections
from models.llama import FeedForward
from models.worker import LlamaWorker
from tests.model_checkpoints import PROMPTS, block_tables, build_checkpoint, prefill_batch, reference_greedy

pytestmark = pytest.mark.timeout(120)

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "fuse", seed=6)


def test_fused_mlp_equals_the_separate_one():
    torch.manual_seed(0)

    class Args:
        hidden_size, intermediate_size = 48, 80

    mlp = FeedForward(Args())
    x = torch.randn(7, 48)
    with torch.inference_mode():
        plain = mlp(x)
        assert fuse_projections(mlp) == 1
        assert mlp.gate_up_proj is not None and not hasattr(mlp, "gate_proj") and not hasattr(mlp, "up_proj")
        torch.testing.assert_close(mlp(x), plain, atol=1e-6, rtol=1e-6)
        assert fuse_projections(mlp) == 0  # already fused


def test_hooked_projections_are_left_alone():
    class Args:
        hidden_size, intermediate_size = 16, 32

    mlp = FeedForward(Args())
    mlp.up_proj.register_forward_hook(lambda _m, _i, out: out)
    assert fuse_projections(mlp) == 0 and isinstance(mlp.up_proj, nn.Linear)


def test_worker_with_fused_projections_matches_the_separate_one_and_transformers(checkpoint):
    ctx = ActorContext(pp=0, tp=0, tp_size=1, pp_size=1, master_addr="127.0.0.1", master_port=0)
    results = {}
    for fuse in (True, False):
        worker = LlamaWorker(
            ctx, model=checkpoint, kv_cache_bytes=2**20, block_size=8, fuse_projections=fuse, prepack_weights=False
        )
        info = worker.load_model()
        try:
            stage = worker.stage
            assert stage is not None
            params = sum(p.numel() for p in stage.parameters())
            tables = block_tables([len(p) + NEW_TOKENS for p in PROMPTS], 8)
            prefill = worker.compute_logits(prefill_batch(PROMPTS, tables))
            # Greedy decode through the KV cache: the decode path's attention and MLP too.
            seqs = [list(p) for p in PROMPTS]
            batch = prefill_batch(PROMPTS, tables, batch_id=100)
            for n in range(NEW_TOKENS):
                out = worker.execute_model(batch)
                for seq, token in zip(seqs, out.token_ids):
                    seq.append(token)
                batch = ModelBatch(
                    101 + n,
                    [SequenceChunk(i, [s[-1]], len(s) - 1, tables[i], num_generated=n + 1) for i, s in enumerate(seqs)],
                )
            results[fuse] = (info["fused_modules"], params, prefill, seqs)
        finally:
            worker.shutdown()
    layers = load_config(checkpoint).num_hidden_layers
    assert results[True][0] == 2 * layers and results[False][0] == 0
    assert results[True][1] == results[False][1]  # each weight held once
    torch.testing.assert_close(results[True][2], results[False][2], atol=1e-5, rtol=1e-5)
    assert results[True][3] == results[False][3] == reference_greedy(checkpoint, PROMPTS, NEW_TOKENS)
