"""Picks one token per sampled row from full-vocabulary logits (last stage, output rank only).

Per row, as in transformers' generate: temperature 0 is greedy (argmax); otherwise
logits / temperature, then top-k (keep the k largest; 0 = off), then top-p (keep
the smallest set of most likely tokens whose probability reaches p; 1.0 = off),
then one draw from the softmax. The draw is an exponential race,
argmax(probs / E) with E ~ Exp(1), which samples from probs exactly.

A row with a seed draws E from a generator seeded with `mix_seed(seed, n)`, n the
number of tokens the sequence generated so far, so a sequence recomputed after
preemption or restart draws the same tokens. Rows without a seed share one
generator owned by the caller.

The optional logprob is that of the sampled token under the model's unmodified
distribution (log_softmax of the raw logits, before temperature and filters).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from models.argmax import row_argmax
from models.batch import SamplingOptions

__all__ = ["is_greedy", "mix_seed", "sample", "top_k_top_p_mask"]

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, n: int) -> int:
    """A 64-bit generator seed from (seed, n): splitmix64 of the pair, so nearby pairs give unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + n + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def is_greedy(options: SamplingOptions) -> bool:
    """True when the row's token is the argmax of its logits and no logprob is wanted (no full logits needed)."""
    return not _draws(options) and not options.logprobs


def _draws(options: SamplingOptions) -> bool:
    # temperature 0 or top_k 1 leave only the argmax.
    return options.temperature > 0 and options.top_k != 1


def top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Boolean [N, V]: True for the tokens the filters remove. top_k [N] (0 = off), top_p [N] (1.0 = off)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    # Ties with the k-th value stay in, as in transformers' TopKLogitsWarper.
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    remove_sorted = sorted_logits < kth
    probs = sorted_logits.masked_fill(remove_sorted, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # A token goes when the more likely ones already reach top_p; the most likely always stays.
    remove_sorted |= (mass_before >= top_p[:, None]) & (ranks > 0)
    return torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)


def sample(
    logits: torch.Tensor,
    options: Sequence[SamplingOptions],
    num_generated: Sequence[int],
    generator: Optional[torch.Generator] = None,
) -> tuple[list[int], Optional[list[float]]]:
    """Token ids [N] for logits [N, V], and their logprobs when any row asks for them."""
    logits = logits.float()
    tokens = row_argmax(logits)  # max(dim).indices: first index on ties, NaN wins
    random_rows = [i for i, o in enumerate(options) if _draws(o)]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        picked = [options[i] for i in random_rows]
        temperature = torch.tensor([o.temperature for o in picked], device=logits.device)
        scaled = logits[rows] / temperature[:, None]
        if any(o.top_k > 0 or o.top_p < 1.0 for o in picked):
            top_k = torch.tensor([max(o.top_k, 0) for o in picked], device=logits.device)
            top_p = torch.tensor([o.top_p for o in picked], device=logits.device)
            scaled = scaled.masked_fill(top_k_top_p_mask(scaled, top_k, top_p), float("-inf"))
        probs = scaled.softmax(dim=-1)
        noise = torch.empty(probs.shape, dtype=torch.float32)  # generators live on the CPU
        unseeded = [j for j, o in enumerate(picked) if o.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=generator)
        for j, o in enumerate(picked):
            if o.seed is not None:
                g = torch.Generator().manual_seed(mix_seed(o.seed, num_generated[random_rows[j]]))
                noise[j].exponential_(generator=g)
        tokens[rows] = (probs / noise.to(probs.device)).argmax(dim=-1)
    logprobs = None
    if any(o.logprobs for o in options):
        logprobs = logits.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0].tolist()
    return tokens.tolist(), logprobs
