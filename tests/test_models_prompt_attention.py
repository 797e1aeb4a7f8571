"""The bf16 prompt attention kernel (models/prompt_attention.py) computes causal attention as SDPA does."""

from __future__ import annotations

import pytest
import torch

from actors.context import ActorContext
from models import prompt_attention
from models.batch import ModelBatch, SequenceChunk
from models.numba_kernels import pool_size
from models.worker import LlamaWorker
from tests.kernel_threads import assert_pool_only_with_threads
from tests.model_checkpoints import TINY, block_tables, build_checkpoint, prefill_batch, reference_last_logits

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not prompt_attention.prepare(1), reason="no avx512_bf16 or no numba on this machine"),
]


@pytest.fixture(autouse=True)
def inference():
    # The kernel has no backward: it serves only without autograd, as a rank runs. The
    # switch is process-wide: a worker loaded earlier in this process may have turned it off.
    before = prompt_attention.enabled()
    prompt_attention.set_enabled(True)
    with torch.no_grad():
        yield
    prompt_attention.set_enabled(before)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    # One thread runs every chunk on the caller's thread; two split the chunks over numba's pool.
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    if request.param > 1 and pool_size() > 1:
        assert prompt_attention._parallel_kernel() is not None  # built and checked, not fallen back
    yield request.param
    torch.set_num_threads(before)


def _chunks(lengths: list[int]) -> tuple[list[int], list[int]]:
    stops = torch.tensor(lengths).cumsum(0).tolist()
    return [e - n for e, n in zip(stops, lengths)], stops


def _inputs(lengths: list[int], heads: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return tuple(torch.randn(total, n, dim, generator=g).bfloat16() for n in (heads, kv_heads, kv_heads))


# Chunk lengths around the 32-key panels, the key pairs and the 64-row blocks.
@pytest.mark.parametrize("lengths", [[1], [2, 3], [31, 32, 33], [64, 65], [128, 7, 200]])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 4, 32), (8, 4, 64), (8, 2, 128)])
def test_equals_sdpa_for_any_chunk_length_and_grouping(lengths, heads, kv_heads, dim, threads):
    q, k, v = _inputs(lengths, heads, kv_heads, dim, seed=sum(lengths) + heads + dim)
    starts, stops = _chunks(lengths)
    out = torch.empty_like(q)
    assert prompt_attention.attend_prompts(q, k, v, out, starts, stops, dim**-0.5)
    want = prompt_attention._reference(q, k, v, starts, stops, dim**-0.5)
    # bf16 probabilities and one bf16 rounding of the result, as SDPA's CPU kernel: a few bf16 ulps.
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    sdpa_error = (prompt_attention._reference(q.float(), k.float(), v.float(), starts, stops, dim**-0.5).bfloat16().float() - want)
    assert (out.float() - want).abs().mean() < 4 * sdpa_error.abs().mean() + 1e-3  # no worse on average than rounding
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 32), (8, 2, 128)])
def test_chunks_after_a_cached_prefix(heads, kv_heads, dim, threads):
    # Queries [0, 10) over keys [0, 50): 40 keys before the chunk; [10, 80) over [50, 150);
    # [80, 81) over [150, 151): a chunk of one query that is its whole context.
    g = torch.Generator().manual_seed(heads + dim)
    q = torch.randn(81, heads, dim, generator=g).bfloat16()
    k, v = (torch.randn(160, kv_heads, dim, generator=g).bfloat16() for _ in range(2))
    starts, stops, key_starts, key_counts = [0, 10, 80], [10, 80, 81], [0, 50, 150], [50, 100, 1]
    out = torch.empty_like(q)
    assert prompt_attention.attend_prompts(q, k, v, out, starts, stops, dim**-0.5, key_starts, key_counts)
    want = prompt_attention._reference(q, k, v, starts, stops, dim**-0.5, key_starts, key_counts)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def test_only_the_chunks_rows_are_written():
    q, k, v = _inputs([10, 20, 5], 4, 2, 32, seed=1)
    out = torch.full_like(q, 7.0)
    assert prompt_attention.attend_prompts(q, k, v, out, [0, 30], [10, 35], 0.2)
    assert (out[10:30] == 7.0).all()
    want = prompt_attention._reference(q, k, v, [0, 30], [10, 35], 0.2)
    torch.testing.assert_close(out[:10].float(), want[:10], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out[30:].float(), want[30:], rtol=2e-2, atol=2e-2)


def test_declines_what_it_cannot_run():
    q, k, v = _inputs([8], 4, 2, 32, seed=2)
    out = torch.zeros_like(q)
    assert not prompt_attention.attend_prompts(q, k, v, out, [], [], 0.2)  # no chunks
    assert not prompt_attention.attend_prompts(q.float(), k.float(), v.float(), out.float(), [0], [8], 0.2)
    q16, k16, v16 = _inputs([8], 4, 2, 16, seed=3)  # heads of 16 values: not a whole panel
    assert not prompt_attention.fits(16) and prompt_attention.fits(64)
    assert not prompt_attention.attend_prompts(q16, k16, v16, torch.zeros_like(q16), [0], [8], 0.2)
    assert not prompt_attention.attend_prompts(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, out, [0], [8], 0.2)
    with torch.enable_grad():
        assert not prompt_attention.attend_prompts(q, k, v, out, [0], [8], 0.2)
    prompt_attention.set_enabled(False)
    assert not prompt_attention.attend_prompts(q, k, v, out, [0], [8], 0.2)
    assert (out == 0).all()


def test_mismatched_shapes_raise():
    q, k, v = _inputs([8], 4, 2, 32, seed=4)
    with pytest.raises(ValueError, match="do not match keys"):
        prompt_attention.attend_prompts(q, k[:, :1].contiguous(), v, torch.empty_like(q), [0], [8], 0.2)
    with pytest.raises(ValueError, match=r"query rows \[0, 8\) over key rows \[0, 8\) does not fit 8 queries and 4 keys"):
        prompt_attention.attend_prompts(q, k[:4].contiguous(), v[:4].contiguous(), torch.empty_like(q), [0], [8], 0.2)
    with pytest.raises(ValueError, match="keys must be at least as many as queries"):
        prompt_attention.attend_prompts(q, k, v, torch.empty_like(q), [0], [8], 0.2, [0], [5])


def test_a_bf16_model_with_it_computes_what_it_computes_with_sdpa(tmp_path):
    # Heads of 32 values (hidden 128 over 4 heads), so that the kernel serves the prompt steps.
    path = build_checkpoint(tmp_path / "ckpt", seed=6, **dict(TINY, hidden_size=128, intermediate_size=192))
    prompts = [[1, 5, 9, 2, 7] * 9, [3, 4], list(range(10, 80))]
    ctx = ActorContext(pp=0, tp=0, tp_size=1, pp_size=1, master_addr="127.0.0.1", master_port=0)
    threads = torch.get_num_threads()
    logits = {}
    try:
        for kernel in (True, False):
            worker = LlamaWorker(
                ctx, path, dtype="bfloat16", kv_cache_bytes=2**20, block_size=8, prompt_attention_kernel=kernel
            )
            assert worker.load_model()["prompt_attention_kernel"] == kernel
            logits[kernel] = worker.compute_logits(prefill_batch(prompts, block_tables([len(p) for p in prompts], 8)))
            worker.shutdown()
    finally:
        torch.set_num_threads(threads)
        prompt_attention.set_enabled(True)
    # A prompt split in two steps: its second chunk attends the cached first one too.
    long_prompt = list(range(10, 80))
    for kernel in (True, False):
        worker = LlamaWorker(ctx, path, dtype="bfloat16", kv_cache_bytes=2**20, block_size=8, prompt_attention_kernel=kernel)
        worker.load_model()
        table = block_tables([len(long_prompt)], 8)[0]
        worker.compute_logits(ModelBatch(0, [SequenceChunk(0, long_prompt[:30], 0, table, sample=False)]))
        split = worker.compute_logits(ModelBatch(1, [SequenceChunk(0, long_prompt[30:], 30, table)]))
        worker.shutdown()
        torch.set_num_threads(threads)
        torch.testing.assert_close(split[0], logits[kernel][2], rtol=0, atol=0.05 * logits[kernel][2].abs().max().item())
    prompt_attention.set_enabled(True)
    expected = reference_last_logits(path, prompts)
    # bf16 through four layers of this checkpoint strays up to ~7% of the largest logit
    # from float32 either way; the kernel and SDPA stray alike and pick the same tokens.
    scale = expected.abs().max()
    assert (logits[True] - expected).abs().max() < 0.1 * scale
    assert (logits[True] - logits[False]).abs().max() < 0.05 * scale
    assert (logits[True].argmax(-1) == logits[False].argmax(-1)).all()


_USE_KERNEL = """
from models import prompt_attention

assert prompt_attention.prepare(threads)
q, k, v = torch.randn(40, 4, 32).bfloat16(), torch.randn(40, 2, 32).bfloat16(), torch.randn(40, 2, 32).bfloat16()
for _ in range(3):
    assert prompt_attention.attend_prompts(q, k, v, torch.empty_like(q), [0, 9, 30], [9, 30, 40], 0.2)
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_keeps_the_rank_thread_count(threads: int) -> None:
    assert_pool_only_with_threads(_USE_KERNEL, "prompt_attention._parallel_kernel", "()", threads)
