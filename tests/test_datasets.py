"""Prompt sets (tools/prompt_sets.py): ShareGPT sampling and filtering, random prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from models.default_model import BOS_ID, default_model_dir
from tools import prompt_sets
from tools.prompt_sets import PromptSpec, load_sharegpt, random_prompts, sharegpt_pairs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The same folder as test_default_model.py's fixture: the build runs once per session.
    return default_model_dir(tmp_path_factory.getbasetemp() / "pipeactors-cache")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


class WordTokenizer:
    """One token per whitespace-separated word, BOS (id 1) first: lengths are easy to pick."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [len(word) for word in text.split()]
        return [BOS_ID, *ids] if add_special_tokens else ids


def words(n: int) -> str:
    return " ".join(["w"] * n)


@pytest.fixture
def fake_pairs(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(pairs: list[tuple[str, str]]) -> None:
        monkeypatch.setattr(prompt_sets, "sharegpt_pairs", lambda: pairs)

    return install


# ----------------------------------------------------------------------------- real ShareGPT data


def test_real_file_yields_17400_prompt_answer_pairs() -> None:
    pairs = sharegpt_pairs()
    assert len(pairs) == 17400
    assert all(isinstance(prompt, str) and isinstance(answer, str) for prompt, answer in pairs)


def test_sharegpt_prompts_pass_the_filter_and_hold_their_token_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    specs = load_sharegpt(tokenizer, 64, seed=0)
    assert len(specs) == 64
    for spec in specs:
        assert 4 <= spec.prompt_len <= 1024
        assert spec.output_len >= 4
        assert spec.prompt_len + spec.output_len <= 2048
        assert spec.prompt is not None
        assert spec.prompt_token_ids == tokenizer.encode(spec.prompt)
        assert spec.prompt_token_ids[0] == BOS_ID


def test_same_seed_gives_the_same_prompts_and_another_seed_others(tokenizer: PreTrainedTokenizerBase) -> None:
    first = load_sharegpt(tokenizer, 16, seed=3)
    assert load_sharegpt(tokenizer, 16, seed=3) == first
    other = load_sharegpt(tokenizer, 16, seed=4)
    assert {spec.prompt for spec in other} != {spec.prompt for spec in first}


def test_raw_tokenizers_tokenizer_gives_the_same_prompts(
    model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert load_sharegpt(raw, 8, seed=1) == load_sharegpt(tokenizer, 8, seed=1)


# ----------------------------------------------------------------------------- filter rules (fake data)


def test_output_len_is_the_answer_token_count_without_special_tokens(fake_pairs: Any) -> None:
    fake_pairs([(words(10), words(7))])
    [spec] = load_sharegpt(WordTokenizer(), 1)
    assert spec.prompt_len == 11  # BOS + 10 words
    assert spec.output_len == 7


@pytest.mark.parametrize(
    ("prompt_words", "answer_words"),
    [(2, 10), (1024, 10), (10, 3), (1000, 1048)],
    ids=["prompt-too-short", "prompt-too-long", "answer-too-short", "total-too-long"],
)
def test_filter_drops_the_pair(fake_pairs: Any, prompt_words: int, answer_words: int) -> None:
    fake_pairs([(words(prompt_words), words(answer_words)), (words(10), words(10))])
    specs = load_sharegpt(WordTokenizer(), 1)
    assert [(spec.prompt_len, spec.output_len) for spec in specs] == [(11, 10)]
    with pytest.raises(ValueError, match="only 1 of 2"):
        load_sharegpt(WordTokenizer(), 2)


def test_filter_keeps_the_bounds(fake_pairs: Any) -> None:
    # prompt 4 tokens (BOS + 3), answer 4 tokens; prompt 1024 with total exactly 2048.
    fake_pairs([(words(3), words(4)), (words(1023), words(1024))])
    specs = load_sharegpt(WordTokenizer(), 2)
    assert sorted((spec.prompt_len, spec.output_len) for spec in specs) == [(4, 4), (1024, 1024)]


def test_fixed_output_len_replaces_the_answer_length(fake_pairs: Any) -> None:
    fake_pairs([(words(10), words(1)), (words(10), words(500))])
    specs = load_sharegpt(WordTokenizer(), 2, fixed_output_len=32)
    assert [spec.output_len for spec in specs] == [32, 32]


def test_zero_prompts_is_an_empty_list(fake_pairs: Any) -> None:
    fake_pairs([(words(10), words(10))])
    assert load_sharegpt(WordTokenizer(), 0) == []


@pytest.mark.parametrize("kwargs", [{"num_prompts": -1}, {"num_prompts": 1, "fixed_output_len": 0}])
def test_invalid_arguments_are_rejected(fake_pairs: Any, kwargs: dict[str, int]) -> None:
    fake_pairs([(words(10), words(10))])
    with pytest.raises(ValueError):
        load_sharegpt(WordTokenizer(), **kwargs)


def test_pairs_are_the_first_two_turns_of_multi_turn_records(monkeypatch: pytest.MonkeyPatch) -> None:
    records = [
        {"id": "one-turn", "conversations": [{"from": "human", "value": "alone"}]},
        {"id": "no-turns"},
        {"id": "three", "conversations": [{"value": "q"}, {"value": "a"}, {"value": "q2"}]},
        {"id": "bad-turn", "conversations": ["q", {"value": "a"}]},
        {"id": "no-value", "conversations": [{"from": "human"}, {"value": "a"}]},
        {"id": "two", "conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]},
    ]
    monkeypatch.setattr(prompt_sets, "iter_sharegpt_records", lambda: iter(records))
    assert sharegpt_pairs() == [("q", "a"), ("x", "y")]


# ----------------------------------------------------------------------------- random prompts


def test_random_prompts_have_the_asked_lengths_and_ids_in_vocab() -> None:
    specs = random_prompts(5, input_len=17, output_len=9, vocab_size=100, seed=0)
    assert len(specs) == 5
    for spec in specs:
        assert spec.prompt is None
        assert (spec.prompt_len, spec.output_len) == (17, 9)
        assert all(isinstance(i, int) and 0 <= i < 100 for i in spec.prompt_token_ids)


def test_random_prompts_are_deterministic_by_seed() -> None:
    first = random_prompts(4, 32, 8, 32000, seed=5)
    assert random_prompts(4, 32, 8, 32000, seed=5) == first
    assert random_prompts(4, 32, 8, 32000, seed=6) != first
    assert len({tuple(spec.prompt_token_ids) for spec in first}) == 4


@pytest.mark.parametrize(
    "args",
    [(-1, 8, 8, 100), (1, 0, 8, 100), (1, 8, 0, 100), (1, 8, 8, 0)],
    ids=["num_prompts", "input_len", "output_len", "vocab_size"],
)
def test_random_prompts_reject_invalid_sizes(args: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError, match=r"must be >= "):
        random_prompts(*args)


def test_prompt_spec_reports_its_prompt_len() -> None:
    assert PromptSpec(prompt="hi", prompt_token_ids=[1, 5, 6], output_len=4).prompt_len == 3
