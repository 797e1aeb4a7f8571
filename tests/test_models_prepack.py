"""Linear weights packed once for oneDNN (models/prepack.py) compute what F.linear computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from actors.context import ActorContext
from models.config import Layout, load_config
from models.loader import load_stage
from models.parallel import TPGroup, VocabParallelLMHead
from models.prepack import PackedLinear, PackedWeight, prepack_stage, prepack_supported
from models.worker import LlamaWorker
from tests.model_checkpoints import PROMPTS, block_tables, build_checkpoint, prefill_batch

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not prepack_supported(torch.float32, "cpu"), reason="this torch build has no oneDNN packing"),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "untied": build_checkpoint(root / "untied", seed=4),
        "tied": build_checkpoint(root / "tied", seed=5, tie_word_embeddings=True),
    }


@pytest.mark.parametrize("rows", [1, 3, 17, 64, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_for_any_row_count(rows, bias):
    torch.manual_seed(rows)
    w, x = torch.randn(96, 40), torch.randn(rows, 40)
    b = torch.randn(96) if bias else None
    packed = PackedWeight(w, b)
    torch.testing.assert_close(packed.linear(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    # A strided view and a 3-D input, as attention and MLP code pass them.
    torch.testing.assert_close(packed.linear(x[::2]), F.linear(x[::2], w, b), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, rows, 40)
    torch.testing.assert_close(packed.linear(x3), F.linear(x3, w, b), atol=1e-5, rtol=1e-5)


def test_packed_bfloat16_stays_close_to_float32():
    if not prepack_supported(torch.bfloat16, "cpu"):
        pytest.skip("no bfloat16 packing in this build")
    torch.manual_seed(0)
    w, x = torch.randn(64, 32), torch.randn(5, 32)
    got = PackedWeight(w.bfloat16()).linear(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x, w), atol=0.15, rtol=0.02)


def test_wrong_width_input_is_rejected():
    packed = PackedWeight(torch.randn(8, 4))
    with pytest.raises(ValueError, match="has 5 features, the packed weight takes 4"):
        packed.linear(torch.randn(2, 5))


def test_packed_linear_keeps_the_forward_hooks_of_the_linear_it_replaces():
    linear = nn.Linear(6, 3, bias=False)
    linear.register_forward_hook(lambda _m, _inputs, out: out * 2)  # as a row-parallel all-reduce
    x = torch.randn(4, 6)
    with torch.no_grad():
        expected = linear(x)
        torch.testing.assert_close(PackedLinear(linear)(x), expected)


def test_float16_and_other_devices_are_not_packed():
    assert not prepack_supported(torch.float16, "cpu")
    assert not prepack_supported(torch.float32, "meta")
    assert not prepack_supported(torch.float32, "cuda")


def _stage(checkpoint: str):
    args = load_config(checkpoint)
    layout = Layout(args, tp=0, tp_size=1, pp=0, pp_size=1)
    stage, _ = load_stage(layout, checkpoint, torch.float32)
    return stage


def test_prepack_stage_packs_every_linear_and_leaves_a_tied_head(checkpoints):
    stage = _stage(checkpoints["untied"])
    layers = len(stage.layers)
    assert prepack_stage(stage) == 7 * layers + 1  # q k v o gate up down per layer, and the head
    assert not any(isinstance(m, nn.Linear) for m in stage.modules())

    tied = _stage(checkpoints["tied"])
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert prepack_stage(tied) == 7 * layers  # a packed head would be a second copy of the embedding
    assert tied.lm_head.weight is tied.embed_tokens.weight


def test_vocab_parallel_head_packs_its_real_rows_and_pads_like_the_plain_one():
    torch.manual_seed(0)
    # A last shard of 5 real rows padded to 8, as tp splits a vocabulary that does not divide.
    head = VocabParallelLMHead(12, 8, 13, TPGroup(0, 1, None), 8, 13)
    with torch.no_grad():
        head.weight.copy_(torch.randn(8, 12))
        head.weight[5:] = 0  # the loader leaves padding rows at zero
    h = torch.randn(4, 12)
    with torch.inference_mode():
        plain_logits, plain_ids = head(h), head.argmax(h)
        assert head.prepack()
        assert head.weight is None and not head.prepack()
        torch.testing.assert_close(head(h), plain_logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(head.argmax(h), plain_ids)


def test_worker_with_packed_weights_matches_the_plain_one(checkpoints):
    ctx = ActorContext(pp=0, tp=0, tp_size=1, pp_size=1, master_addr="127.0.0.1", master_port=0)
    results = {}
    for prepack in (True, False):
        worker = LlamaWorker(ctx, model=checkpoints["untied"], kv_cache_bytes=2**20, block_size=8, prepack_weights=prepack)
        info = worker.load_model()
        try:
            tables = block_tables([len(p) for p in PROMPTS], 8)
            logits = worker.compute_logits(prefill_batch(PROMPTS, tables))
            results[prepack] = (info["packed_weights"], logits)
        finally:
            worker.shutdown()
    assert results[True][0] > 0 and results[False][0] == 0
    torch.testing.assert_close(results[True][1], results[False][1], atol=1e-5, rtol=1e-5)
