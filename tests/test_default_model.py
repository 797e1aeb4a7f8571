"""The built-in default model: checkpoint contents, reuse, and safe concurrent builds."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from models.default_model import (
    BOS_ID,
    CACHE_ENV,
    EOS_ID,
    MARKER_FILE,
    PAD_ID,
    build_atomically,
    cache_root,
    default_model_args,
    default_model_built,
    default_model_config,
    default_model_dir,
    llama_tensor_shapes,
    random_llama_weights,
    train_tokenizer,
    write_checkpoint,
)
from models.config import load_config
from models.sharegpt import iter_json_array, iter_sharegpt_records, sharegpt_text

ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing spaces  ",
    "def f(x):\n\treturn x ** 2  # tabs and newlines\n",
    "Ünïcödé, 中文, emoji 🤖🚀 and a combining e\u0301.",
    "punctuation before spaces : ; , . ! ?",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # test_datasets.py uses the same folder, so the build runs once per session.
    return default_model_dir(tmp_path_factory.getbasetemp() / "pipeactors-cache")


def tiny_config(**overrides: object) -> LlamaConfig:
    fields: dict[str, object] = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        initializer_range=0.3,
        pad_token_id=None,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


# ----------------------------------------------------------------------------- the checkpoint


def test_default_config_is_the_specified_small_llama() -> None:
    config = default_model_config()
    assert (config.hidden_size, config.num_hidden_layers) == (512, 8)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 4)
    assert (config.intermediate_size, config.vocab_size) == (1408, 32000)
    assert config.rms_norm_eps == 1e-5
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.max_position_embeddings == 2048
    assert config.dtype == torch.bfloat16
    assert not config.tie_word_embeddings
    num_params = sum(torch.Size(shape).numel() for shape in llama_tensor_shapes(config).values())
    assert 55e6 < num_params < 57e6


def test_the_args_known_before_the_build_are_the_checkpoints(model_dir: Path) -> None:
    # LLM starts compiling from them while a first start builds the model.
    assert default_model_args() == load_config(model_dir)
    assert default_model_built(model_dir.parent)
    assert not default_model_built(model_dir.parent / "elsewhere")


def test_checkpoint_loads_into_transformers_with_no_missing_or_unexpected_keys(model_dir: Path) -> None:
    model, info = LlamaForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(torch.tensor([[BOS_ID, 100, 200, 300]])).logits
    assert logits.shape == (1, 4, 32000)
    assert torch.isfinite(logits).all()


def test_safetensors_hold_the_hf_llama_tensor_names_and_shapes(model_dir: Path) -> None:
    expected = llama_tensor_shapes(default_model_config())
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes == expected
    assert "lm_head.weight" in shapes and "model.layers.7.mlp.down_proj.weight" in shapes


def test_config_json_loads_with_token_ids_matching_the_tokenizer(model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(config, LlamaConfig)
    ignored = {"_name_or_path", "transformers_version"}
    loaded = {k: v for k, v in config.to_dict().items() if k not in ignored}
    assert loaded == {k: v for k, v in default_model_config().to_dict().items() if k not in ignored}
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == ["<unk>", "<s>", "</s>", "<pad>"]


@pytest.mark.parametrize("loader", [AutoTokenizer, PreTrainedTokenizerFast], ids=["auto", "fast"])
def test_tokenizer_has_32000_tokens_prepends_bos_and_round_trips(model_dir: Path, loader: type) -> None:
    tokenizer = loader.from_pretrained(model_dir)
    assert len(tokenizer) == 32000
    for text in ROUND_TRIP_TEXTS:
        ids = tokenizer.encode(text)
        assert ids[0] == BOS_ID
        assert BOS_ID not in ids[1:]
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_compresses_english_text(model_dir: Path) -> None:
    # A trained BPE, not a byte fallback: common English takes well under a token per 3 chars.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "The quick brown fox jumps over the lazy dog, and then it writes some Python code."
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text) / 3


def test_weights_follow_the_transformers_llama_init(model_dir: Path) -> None:
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
        q_proj = f.get_tensor("model.layers.0.self_attn.q_proj.weight").float()
        norm = f.get_tensor("model.layers.3.input_layernorm.weight")
    assert norm.dtype == torch.bfloat16
    assert torch.equal(norm, torch.ones_like(norm))
    assert embed[PAD_ID].abs().sum() == 0  # padding row zero, as nn.Embedding(padding_idx) is
    for weight in (embed, q_proj):
        assert weight.mean().abs() < 1e-3
        assert weight.std().item() == pytest.approx(0.02, rel=0.02)


def test_second_call_reuses_the_built_dir(model_dir: Path) -> None:
    marker = model_dir / MARKER_FILE
    before = marker.stat().st_mtime_ns
    start = time.perf_counter()
    assert default_model_dir(model_dir.parent) == model_dir
    assert time.perf_counter() - start < 0.5
    assert marker.stat().st_mtime_ns == before
    assert json.loads(marker.read_text())["build_seconds"] > 0


def test_finding_the_built_dir_imports_no_checkpoint_writer(model_dir: Path) -> None:
    # The driver calls default_model_dir() before it starts the ranks: importing
    # transformers there (about 1.5 s) would delay every LLM(model=None).
    code = (
        "import sys; from models.default_model import default_model_dir; "
        f"assert str(default_model_dir({str(model_dir.parent)!r})) == {str(model_dir)!r}; "
        "print(sorted(m for m in ('transformers', 'tokenizers', 'safetensors') if m in sys.modules))"
    )
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_cache_env_var_selects_the_cache_folder(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(model_dir.parent))
    assert cache_root() == model_dir.parent
    assert default_model_dir() == model_dir
    assert cache_root("/elsewhere") == Path("/elsewhere")  # the argument wins over the env var


def test_cache_defaults_to_home_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert cache_root() == Path.home() / ".cache" / "pipeactors"


# ----------------------------------------------------------------------------- weights and tokenizer helpers


def test_same_seed_gives_identical_weights_and_other_seeds_differ() -> None:
    config = tiny_config()
    first, again, other = (random_llama_weights(config, seed) for seed in (0, 0, 1))
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])


def test_same_seed_writes_identical_checkpoint_bytes(tmp_path: Path) -> None:
    config = tiny_config()
    a = write_checkpoint(tmp_path / "a", config, seed=7)
    b = write_checkpoint(tmp_path / "b", config, seed=7)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "config.json").read_text() == (b / "config.json").read_text()


def test_tied_checkpoint_with_biases_loads_into_transformers(tmp_path: Path) -> None:
    config = tiny_config(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    shapes = llama_tensor_shapes(config)
    assert "lm_head.weight" not in shapes
    assert shapes["model.layers.1.self_attn.k_proj.bias"] == (8,)
    model, info = LlamaForCausalLM.from_pretrained(write_checkpoint(tmp_path, config), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tokenizer_training_is_deterministic() -> None:
    texts = sharegpt_text(50_000)
    assert train_tokenizer(texts, 600).to_str() == train_tokenizer(texts, 600).to_str()


def test_tokenizer_training_rejects_text_too_small_for_the_vocab() -> None:
    with pytest.raises(ValueError, match="give more text"):
        train_tokenizer(["tiny text"], 32000)


# ----------------------------------------------------------------------------- tolerant JSON


def test_cut_off_json_array_yields_every_complete_element() -> None:
    text = '[{"a": 1}, {"b": [2, 3]}, {"c": "cut off in the mid'
    assert list(iter_json_array(io.StringIO(text))) == [{"a": 1}, {"b": [2, 3]}]


def test_elements_spanning_read_chunks_are_parsed_whole() -> None:
    text = '[\n  1,\n  22,\n  333,\n  {"x": "yyyy", "z": [true, null]},\n  4444\n]'
    expected = [1, 22, 333, {"x": "yyyy", "z": [True, None]}, 4444]
    assert list(iter_json_array(io.StringIO(text), chunk_chars=3)) == expected


@pytest.mark.parametrize("text", ["", "[]", "  [ ]  "])
def test_empty_input_yields_nothing(text: str) -> None:
    assert list(iter_json_array(io.StringIO(text))) == []


def test_non_array_input_is_an_error() -> None:
    with pytest.raises(ValueError, match="JSON array"):
        list(iter_json_array(io.StringIO('{"a": 1}')))


def test_sharegpt_file_parses_to_all_complete_records() -> None:
    records = list(iter_sharegpt_records())
    assert len(records) == 17671
    assert all(isinstance(record.get("conversations"), list) for record in records)


# ----------------------------------------------------------------------------- atomic build


def _counting_build(directory: Path, *, counter: Path, seconds: float) -> None:
    with open(counter, "a") as f:
        f.write("built\n")
    time.sleep(seconds)
    (directory / "payload.txt").write_text("whole")


def _build_in_child(target: str, counter: str, seconds: float, barrier: Any) -> None:
    barrier.wait()
    build_atomically(Path(target), partial(_counting_build, counter=Path(counter), seconds=seconds))
    assert (Path(target) / "payload.txt").read_text() == "whole"


def _leftovers(parent: Path, target: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{target.name}.tmp-")]


def test_concurrent_builders_build_once_and_both_get_the_whole_dir(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")  # the children need nothing but this module's functions
    target, counter = tmp_path / "model", tmp_path / "builds.txt"
    barrier = ctx.Barrier(2)
    children = [
        ctx.Process(target=_build_in_child, args=(str(target), str(counter), 0.5, barrier)) for _ in range(2)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=30)
    assert [child.exitcode for child in children] == [0, 0]
    assert counter.read_text().count("built") == 1
    assert (target / MARKER_FILE).is_file()
    assert _leftovers(tmp_path, target) == []


def test_builder_killed_mid_build_leaves_nothing_taken_as_complete(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    target, counter = tmp_path / "model", tmp_path / "builds.txt"
    barrier = ctx.Barrier(1)
    child = ctx.Process(target=_build_in_child, args=(str(target), str(counter), 60.0, barrier))
    child.start()
    deadline = time.monotonic() + 10
    while not counter.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)
    child.join(timeout=10)
    assert not target.exists()
    assert len(_leftovers(tmp_path, target)) == 1  # the dead builder's temp dir

    # The lock died with the builder; the next caller cleans up and builds.
    build_atomically(target, partial(_counting_build, counter=counter, seconds=0.0))
    assert (target / "payload.txt").read_text() == "whole"
    assert _leftovers(tmp_path, target) == []


def test_dir_without_marker_is_rebuilt(tmp_path: Path) -> None:
    target, counter = tmp_path / "model", tmp_path / "builds.txt"
    target.mkdir()
    (target / "payload.txt").write_text("half")
    build_atomically(target, partial(_counting_build, counter=counter, seconds=0.0))
    assert (target / "payload.txt").read_text() == "whole"


def test_failed_build_leaves_no_dir_and_the_next_call_builds(tmp_path: Path) -> None:
    target, counter = tmp_path / "model", tmp_path / "builds.txt"

    def failing(directory: Path) -> None:
        (directory / "payload.txt").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_atomically(target, failing)
    assert not target.exists()
    assert _leftovers(tmp_path, target) == []
    build_atomically(target, partial(_counting_build, counter=counter, seconds=0.0))
    assert (target / MARKER_FILE).is_file()
