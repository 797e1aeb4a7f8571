"""The sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from models.batch import SamplingOptions
from models.sampler import sample, top_k_top_p_mask

pytestmark = pytest.mark.timeout(60)


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()[None, :]


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = sample(logits, [SamplingOptions()] * 5, [0] * 5)
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs is None


def test_top_k_one_is_greedy_even_when_sampling():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    opts = [SamplingOptions(temperature=2.0, top_k=1, seed=s) for s in range(4)]
    assert sample(logits, opts, [0] * 4)[0] == logits.argmax(-1).tolist()


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5]])
    removed = top_k_top_p_mask(logits, torch.tensor([3]), torch.tensor([1.0]))
    assert removed.tolist() == [[True, False, False, True, False]]


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.5, 1), (0.7, 2), (0.8, 2), (0.81, 3), (1.0, 4)],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    logits = probs_logits([0.15, 0.5, 0.05, 0.3])  # order by probability: 1, 3, 0, 2
    removed = top_k_top_p_mask(logits, torch.tensor([0]), torch.tensor([top_p]))[0]
    by_rank = [1, 3, 0, 2]
    assert [not removed[i] for i in by_rank] == [True] * kept + [False] * (4 - kept)


def test_draws_only_from_the_filtered_set():
    logits = probs_logits([0.15, 0.5, 0.05, 0.3]).expand(400, 4)
    opts = [SamplingOptions(temperature=1.0, top_k=3, top_p=0.7, seed=s) for s in range(400)]
    tokens, _ = sample(logits, opts, [0] * 400)
    assert set(tokens) == {1, 3}


def test_draws_follow_the_softmax_of_logits_over_temperature():
    n, temperature = 4000, 2.0
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = (probs.log() * temperature)[None, :].expand(n, 4)
    opts = [SamplingOptions(temperature=temperature, seed=s) for s in range(n)]
    tokens, _ = sample(logits, opts, [0] * n)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    # Four standard errors of a binomial proportion.
    assert ((freq - probs).abs() < 4 * (probs * (1 - probs) / n).sqrt()).all(), freq


def test_same_seed_and_position_draw_the_same_token():
    logits = torch.zeros(1, 1000)  # uniform: any change of stream shows
    opt = SamplingOptions(temperature=1.0, seed=1234)
    first = [sample(logits, [opt], [n])[0][0] for n in range(20)]
    again = [sample(logits, [opt], [n])[0][0] for n in range(20)]
    assert first == again
    assert len(set(first)) > 10  # each position draws afresh
    # Independent of the other rows in the batch.
    batch = sample(logits.expand(3, 1000), [SamplingOptions(temperature=1.0), opt, opt], [0, 5, 6])[0]
    assert batch[1:] == first[5:7]


def test_different_seeds_draw_differently():
    logits = torch.zeros(1, 1000)
    draws = {sample(logits, [SamplingOptions(temperature=1.0, seed=s)], [0])[0][0] for s in range(20)}
    assert len(draws) > 10


def test_unseeded_rows_use_the_given_generator():
    logits = torch.zeros(2, 1000)
    opts = [SamplingOptions(temperature=1.0)] * 2
    a = sample(logits, opts, [0, 0], torch.Generator().manual_seed(7))[0]
    b = sample(logits, opts, [0, 0], torch.Generator().manual_seed(7))[0]
    assert a == b


def test_logprobs_are_of_the_unmodified_distribution():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(3))
    opts = [SamplingOptions(logprobs=True), SamplingOptions(temperature=0.5, top_k=5, seed=1), SamplingOptions()]
    tokens, logprobs = sample(logits, opts, [0, 0, 0])
    expected = logits.log_softmax(-1)[torch.arange(3), torch.tensor(tokens)]
    assert logprobs == pytest.approx(expected.tolist(), abs=1e-6)
    assert all(lp <= 0 and math.isfinite(lp) for lp in logprobs)
