"""The batch format that `LlamaWorker.execute_model` takes and returns.

One `ModelBatch` is broadcast to every rank of the gang. Each rank takes what it
needs: stage 0 embeds the token ids, every stage writes its layers' keys and values
into the paged KV cache at the slots named by each chunk's block table, and the
last stage samples one token per chunk whose `sample` flag is set.

KV layout is paged: the cache holds `num_blocks` blocks of `block_size` token
positions per layer. The scheduler owns the block tables; position `p` of a
sequence lives in block `block_table[p // block_size]` at offset
`p % block_size`. Freeing blocks needs no message: a block is valid only while a
block table names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class SamplingOptions:
    """What the sampler needs for one sequence.

    temperature 0 means greedy. top_k 0 and top_p 1.0 switch those filters off.
    With a seed, the draw for the n-th generated token uses a generator seeded
    from (seed, n), so a sequence recomputed after preemption or a restart draws
    the same tokens.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    logprobs: bool = False


@dataclass
class SequenceChunk:
    """The tokens of one sequence that one step feeds through the model."""

    seq_id: int
    token_ids: list[int]
    # Tokens of this sequence already in the KV cache; the first of token_ids sits
    # at this position.
    start_pos: int
    # KV blocks covering positions [0, start_pos + len(token_ids)).
    block_table: list[int]
    # Sample a next token after the last of token_ids (False for a prefill chunk
    # that is not the last of its prompt).
    sample: bool = True
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    # Tokens generated so far for this sequence (seeds the per-request generator).
    num_generated: int = 0


@dataclass
class ModelBatch:
    """One step of the engine: prefill chunks and decode tokens may mix."""

    batch_id: int
    chunks: list[SequenceChunk]


@dataclass
class ModelOutput:
    """What the last stage returns: one entry per chunk with `sample` set, in batch order."""

    batch_id: int
    seq_ids: list[int]
    token_ids: list[int]
    logprobs: Optional[list[float]] = None
