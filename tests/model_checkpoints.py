"""Small Llama checkpoints for the model tests, their transformers reference, and a greedy driver.

Weights use initializer_range=0.3: at the default 0.02 a small random model's top
logits nearly tie, and summation order alone flips greedy choices.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional, Sequence

import torch

from models.batch import ModelBatch, ModelOutput, SamplingOptions, SequenceChunk

TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.3,
    rms_norm_eps=1e-5,
)

# Everything uneven at tp=2, pp=2: vocab % 2, layers % 2, one kv head for two ranks, intermediate % 2.
ODD: dict[str, Any] = dict(TINY, vocab_size=257, num_hidden_layers=3, num_key_value_heads=1, intermediate_size=101)

LLAMA3_ROPE: dict[str, Any] = dict(
    TINY,
    rope_theta=500000.0,
    # A short original context so positions in the tests reach the rescaled frequencies.
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    ),
)

PROMPTS: list[list[int]] = [
    [1, 5, 9, 33, 2, 7, 100],
    [3, 4],
    list(range(200, 219)),
    [9],
    [17, 42, 42, 17, 250, 11, 64, 128, 3, 0, 77, 91, 13, 5, 8, 21, 34, 55, 89, 144, 233] + list(range(1, 14)),
]


def build_checkpoint(
    path: os.PathLike | str,
    *,
    seed: int = 0,
    max_shard_size: Optional[str] = None,
    **config: Any,
) -> str:
    """Writes a random LlamaForCausalLM (float32) with `TINY` overridden by `config` to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **config}))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return os.fspath(path)


@functools.lru_cache(maxsize=8)
def reference_model(path: str) -> Any:
    """The checkpoint loaded by transformers, in float32, greedy with no stop token."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the scheduler stops sequences, not the worker
    model.generation_config.pad_token_id = 0
    return model


def reference_greedy(path: str, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Prompt plus greedy continuation per prompt, from transformers' generate()."""
    model = reference_model(path)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            tokens = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
            out.append(tokens[0].tolist())
    return out


def reference_last_logits(path: str, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Float32 logits [len(prompts), vocab] at each prompt's last position."""
    model = reference_model(path)
    with torch.no_grad():
        return torch.stack([model(torch.tensor([list(p)])).logits[0, -1] for p in prompts])


def block_tables(lengths: Sequence[int], block_size: int) -> list[list[int]]:
    """Disjoint block tables covering `lengths` positions, handed out from block 0 up."""
    tables, next_block = [], 0
    for n in lengths:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    return tables


def prefill_batch(
    prompts: Sequence[Sequence[int]],
    tables: Sequence[list[int]],
    batch_id: int = 0,
    sampling: SamplingOptions = SamplingOptions(),
) -> ModelBatch:
    return ModelBatch(
        batch_id, [SequenceChunk(i, list(p), 0, tables[i], sampling=sampling) for i, p in enumerate(prompts)]
    )


def run_greedy(
    step: Callable[[ModelBatch], ModelOutput],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    block_size: int,
) -> list[list[int]]:
    """Prefills every prompt in one batch, then decodes all sequences together, one token per step."""
    tables = block_tables([len(p) + max_new_tokens for p in prompts], block_size)
    seqs = [list(p) for p in prompts]
    batch = prefill_batch(prompts, tables)
    for n in range(max_new_tokens):
        out = step(batch)
        assert out.seq_ids == list(range(len(prompts)))
        for seq, token in zip(seqs, out.token_ids):
            seq.append(token)
        batch = ModelBatch(
            n + 1,
            [SequenceChunk(i, [s[-1]], len(s) - 1, tables[i], num_generated=n + 1) for i, s in enumerate(seqs)],
        )
    return seqs
