"""The numba decode-attention kernel (models/decode_attention.py) must equal SDPA, and be optional."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from models import decode_attention
from models.batch import ModelBatch, SequenceChunk
from models.config import LlamaArgs
from models.kv_cache import PagedKVCache
from models.llama import Attention
from models.step import prepare_step
from tests.kernel_threads import assert_pool_only_with_threads

pytestmark = [
    pytest.mark.timeout(120),  # the first call compiles the kernels when numba's cache is cold
    # numba is a dependency: where it is installed the kernel must build (its self-check
    # failing would otherwise turn every test here into a silent SDPA fallback).
    pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed"),
]


def test_the_kernel_builds_and_passes_its_self_check() -> None:
    assert decode_attention.available()


def test_the_kernel_softmax_stays_within_a_few_ulp_of_an_exact_one() -> None:
    import numpy as np

    from models.decode_attention_kernels import softmax_rows

    # Rows of a decode step's length whose scores span float32's whole exp range below
    # the row maximum, and past it (where e^x is not a normal float32: 0).
    x = np.linspace(-95.0, 0.0, 176 * 2000).astype(np.float32)
    rows = np.random.default_rng(0).permutation(x).reshape(2000, 176)
    rows[:, 0] = 0.0
    rows[1::2] /= 20  # and rows of close scores
    got = rows.copy()
    softmax_rows(got, rows.shape[1], np.empty(rows.shape[1], np.int32), np.float32(1.0))
    exact = np.exp(rows.astype(np.float64) - rows.max(axis=1, keepdims=True))
    exact /= exact.sum(axis=1, keepdims=True)
    normal = exact > np.finfo(np.float32).tiny
    rel = np.abs(got - exact)[normal] / exact[normal]
    # np.exp with a float32 sum is within 2.7 ulp on these rows; the polynomial adds about one.
    assert rel.max() < 4.5 * np.finfo(np.float32).eps
    assert (got[~normal] <= np.finfo(np.float32).tiny).all()
    # As np.exp would: -inf scores weigh 0, a NaN or a second +inf makes the row NaN.
    special = np.array([[0.0, -np.inf, 3.0], [1.0, np.nan, 2.0], [np.inf, 1.0, np.inf]], np.float32)
    softmax_rows(special, 3, np.empty(3, np.int32), np.float32(1.0))
    assert special[0, 1] == 0.0 and abs(special[0].sum() - 1.0) < 1e-6
    assert np.isnan(special[1]).all() and np.isnan(special[2]).all()


def _sdpa(q: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, scale: float):
    # Per sequence, so that no padding or mask is involved in the reference.
    outs = []
    for i in range(q.shape[0]):
        r, n = int(rows[i]), int(counts[i])
        k, v = kbuf[r, :, :n].float(), vbuf[r, :, :n].float()
        outs.append(F.scaled_dot_product_attention(q[i].float(), k, v, scale=scale))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_equals_sdpa_per_sequence(dtype: torch.dtype, groups: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(groups)
    heads, dim, cap, buffer_rows = 3, 64, 50, 9
    kv = torch.randn(2, buffer_rows, heads, cap, dim, generator=gen).to(dtype)
    rows = torch.tensor([7, 0, 3, 8, 2, 5])  # not in buffer order, some rows unused
    counts = torch.tensor([50, 1, 17, 33, 2, 49])  # full row, a single key, ...
    q = (torch.randn(len(rows), heads, groups, dim, generator=gen) * 3).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = decode_attention.mirror_decode_attention(q, kv[0], kv[1], rows, counts, 0.125)
    finally:
        torch.set_num_threads(before)
    assert got is not None and got.dtype == dtype and got.shape == q.shape
    want = _sdpa(q, kv[0], kv[1], rows, counts, 0.125).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


_USE_KERNEL = """
from models import decode_attention

kv = torch.randn(2, 4, 2, 32, 16, dtype=torch.bfloat16)
for _ in range(3):
    out = decode_attention.mirror_decode_attention(
        torch.randn(4, 2, 2, 16), kv[0], kv[1], torch.arange(4), torch.tensor([32, 5, 1, 20]), 0.25
    )
    assert out is not None
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_keeps_the_rank_thread_count(threads: int) -> None:
    assert_pool_only_with_threads(_USE_KERNEL, "decode_attention._parallel_kernel", "(torch.bfloat16)", threads)


def test_keys_past_a_sequence_count_are_never_read() -> None:
    kv = torch.randn(2, 2, 1, 8, 16)
    kv[:, :, :, 5:] = float("nan")  # beyond the counts: stale or never written
    q = torch.randn(2, 1, 2, 16)
    got = decode_attention.mirror_decode_attention(q, kv[0], kv[1], torch.tensor([1, 0]), torch.tensor([5, 3]), 0.25)
    assert got is not None and torch.isfinite(got).all()


def test_a_mismatched_query_shape_is_a_clear_error() -> None:
    kv = torch.randn(2, 2, 2, 8, 16)
    with pytest.raises(ValueError, match="do not match"):
        decode_attention.mirror_decode_attention(
            torch.randn(2, 3, 2, 16), kv[0], kv[1], torch.tensor([0, 1]), torch.tensor([3, 3]), 0.25
        )


def test_counts_that_do_not_match_the_rows_are_a_clear_error() -> None:
    # The kernel reads rows and counts by address: their lengths are checked before.
    kv = torch.randn(2, 2, 2, 8, 16)
    q = torch.randn(2, 2, 2, 16)
    with pytest.raises(ValueError, match="do not match"):
        decode_attention.mirror_decode_attention(q, kv[0], kv[1], torch.tensor([0, 1]), torch.tensor([3]), 0.25)
    with pytest.raises(ValueError, match="do not match"):
        decode_attention.mirror_decode_attention(q, kv[0], kv[1], torch.tensor([[0, 1]]), torch.tensor([[3, 3]]), 0.25)


def test_values_of_another_dtype_than_the_keys_are_left_to_sdpa() -> None:
    # Read through the keys' dtype they would be garbage: no kernel call at all.
    kv = torch.randn(2, 2, 2, 8, 16)
    got = decode_attention.mirror_decode_attention(
        torch.randn(2, 2, 2, 16), kv[0], kv[1].bfloat16(), torch.tensor([0, 1]), torch.tensor([3, 3]), 0.25
    )
    assert got is None


def test_float16_and_non_cpu_keys_are_left_to_sdpa() -> None:
    kv = torch.randn(2, 2, 2, 8, 16).half()
    got = decode_attention.mirror_decode_attention(
        torch.randn(2, 2, 2, 16).half(), kv[0], kv[1], torch.tensor([0, 1]), torch.tensor([3, 3]), 0.25
    )
    assert got is None and not decode_attention.supports(kv[0])


@torch.inference_mode()  # as the worker runs its steps
def _decode_layer(decode_kernel: bool) -> torch.Tensor:
    """One attention layer over two prefilled sequences, then a decode step through the mirror."""
    args = LlamaArgs(
        vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    attn = Attention(args)
    cache = PagedKVCache([0], 16, 4, 2, 16, torch.float32, mirror_bytes=2**20, decode_kernel=decode_kernel)
    cos, sin = torch.ones(16, 16), torch.zeros(16, 16)  # no rotation: positions do not matter here
    prefill = prepare_step(
        ModelBatch(0, [SequenceChunk(0, [1] * 5, 0, [3, 1]), SequenceChunk(1, [1] * 7, 0, [0, 2])]),
        block_size=4, num_blocks=16, vocab_size=32,
    )
    cache.begin_step(prefill)
    attn(torch.randn(12, 64), cos[:12], sin[:12], prefill, cache.layer(0))
    cache.end_step(prefill)
    decode = prepare_step(
        ModelBatch(1, [SequenceChunk(1, [1], 7, [0, 2]), SequenceChunk(0, [1], 5, [3, 1])]),
        block_size=4, num_blocks=16, vocab_size=32,
    )
    cache.begin_step(decode)
    assert decode.decode.mirror is not None
    out = attn(torch.randn(2, 64), cos[:2], sin[:2], decode, cache.layer(0))
    cache.end_step(decode)
    return out


def test_attention_layer_gives_the_same_output_with_and_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = decode_attention.mirror_decode_attention
    monkeypatch.setattr(decode_attention, "mirror_decode_attention", lambda *a: calls.append(1) or real(*a))
    with_kernel = _decode_layer(True)
    assert calls, "the decode step did not go through the kernel"
    calls.clear()
    without = _decode_layer(False)
    assert not calls
    torch.testing.assert_close(with_kernel, without, rtol=1e-5, atol=1e-6)
    # Where numba cannot be used the same layer falls back to SDPA.
    monkeypatch.setattr(decode_attention, "_kernel", lambda dtype: None)
    fallback = _decode_layer(True)
    assert not calls
    torch.testing.assert_close(fallback, without, rtol=1e-5, atol=1e-6)


def test_a_query_that_needs_gradients_is_left_to_sdpa() -> None:
    kv = torch.randn(2, 2, 2, 8, 16)
    q = torch.randn(2, 2, 2, 16, requires_grad=True)
    assert decode_attention.mirror_decode_attention(q, kv[0], kv[1], torch.tensor([0, 1]), torch.tensor([3, 3]), 0.25) is None
