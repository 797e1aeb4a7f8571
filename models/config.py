"""The Llama configuration a worker needs, read from a checkpoint's config.json.

`LlamaArgs` is parsed from config.json directly, with the same defaults and the
same rope parameter handling as `transformers.LlamaConfig`, because importing
transformers costs every worker process about 1.6 s and 80 MB of RSS on this
machine and a worker needs only a dozen numbers. `LlamaArgs.from_hf` takes a
`LlamaConfig` when a caller already has one; the tests check that both routes agree.

`Layout` is the (tp, pp) split of one model and `check_layout` rejects the ones
that cannot work, naming the rank that found the problem.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence, Union

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "BoundaryMove",
    "LlamaArgs",
    "Layout",
    "ModelConfigError",
    "check_layout",
    "layer_matmul_macs",
    "lm_head_layers",
    "boundary_move",
    "load_config",
    "cpu_has_native_bf16",
    "resolve_dtype",
    "shard_range",
    "split_layers",
]

# The rope types this package implements; others (yarn, dynamic, longrope) are rejected.
ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


class ModelConfigError(ValueError):
    """A model configuration, dtype or (tp, pp) layout that cannot work; the message names the rank."""


@dataclass(frozen=True)
class LlamaArgs:
    """The architecture numbers of a Llama checkpoint (what config.json says, defaults filled in)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # rope_type plus that type's parameters ("factor", "low_freq_factor", ...).
    rope_scaling: Mapping[str, Any] = field(default_factory=lambda: {"rope_type": "default"})
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: Optional[str] = None
    bos_token_id: Optional[int] = 1
    eos_token_id: Union[int, list[int], None] = 2

    @property
    def rope_type(self) -> str:
        return str(self.rope_scaling.get("rope_type", "default"))

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> "LlamaArgs":
        """From the contents of a config.json (or `LlamaConfig.to_dict()`)."""
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = cfg.get("num_key_value_heads")
            head_dim = cfg.get("head_dim")
            max_pos = int(cfg.get("max_position_embeddings", 2048))
            # transformers 5 keeps rope settings in rope_parameters; older files use
            # rope_scaling plus a top-level rope_theta. rope_scaling wins, as in LlamaConfig.
            rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
            theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
            legacy_type = rope.pop("type", "default")
            rope.setdefault("rope_type", legacy_type)
            if rope["rope_type"] == "llama3":
                rope.setdefault("original_max_position_embeddings", max_pos)
            args = cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(kv_heads) if kv_heads is not None else heads,
                head_dim=int(head_dim) if head_dim else hidden // heads,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=rope,
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                hidden_act=str(cfg.get("hidden_act", "silu")),
                attention_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
                bos_token_id=cfg.get("bos_token_id", 1),
                eos_token_id=cfg.get("eos_token_id", 2),
            )
        except KeyError as exc:
            raise ModelConfigError(f"config has no {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelConfigError(f"config has a value of the wrong type: {exc}") from None
        args.check()
        return args

    @classmethod
    def from_hf(cls, config: Any) -> "LlamaArgs":
        """From a `transformers.LlamaConfig` (or any PretrainedConfig with the Llama fields)."""
        return cls.from_dict(config.to_dict())

    def check(self) -> None:
        """Rejects architectures this implementation does not compute correctly."""
        problems = []
        if self.hidden_act != "silu":
            problems.append(f"hidden_act {self.hidden_act!r} (only 'silu')")
        if self.attention_bias or self.mlp_bias:
            problems.append("attention_bias / mlp_bias (Llama has no biases)")
        if self.rope_type not in ROPE_TYPES:
            problems.append(f"rope_type {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        if self.rope_scaling.get("partial_rotary_factor", 1.0) != 1.0:
            problems.append("partial_rotary_factor != 1")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if problems:
            raise ModelConfigError("unsupported Llama config: " + "; ".join(problems))


def load_config(path: Union[str, os.PathLike]) -> LlamaArgs:
    """The `LlamaArgs` of a checkpoint directory (or of a config.json file)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)
    try:
        with open(file) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ModelConfigError(f"no config.json at {file}") from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{file} is not valid JSON: {exc}") from None
    model_type = cfg.get("model_type", "llama")
    if model_type != "llama":
        raise ModelConfigError(f"{file}: model_type {model_type!r} is not 'llama'")
    return LlamaArgs.from_dict(cfg)


def cpu_has_native_bf16(cpuinfo: Optional[str] = None) -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (x86 AVX512-BF16 or AMX, Arm BF16).

    Without it oneDNN emulates bf16 matmuls, several times slower than float32. Judged
    from /proc/cpuinfo; where that cannot be read the answer is True (keep the checkpoint's dtype).
    """
    flags = cpu_flags(cpuinfo)
    if not flags:
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: Optional[str] = None) -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 "flags", Arm "Features"); empty where it cannot be read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return set()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def resolve_dtype(name: Union[str, torch.dtype], args: LlamaArgs, device_type: str = "cpu") -> torch.dtype:
    """The torch dtype for a `dtype` setting.

    "auto" means the checkpoint's own dtype (float32 when it names none), except that a
    bfloat16 checkpoint runs in float32 on a CPU without native bf16, where emulated
    bf16 is several times slower. An explicit dtype is always honoured.
    """
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ModelConfigError(f"dtype {name} is not one of float32, bfloat16, float16")
        return name
    if name == "auto":
        dtype = _DTYPES.get(str(args.torch_dtype), torch.float32) if args.torch_dtype else torch.float32
        if dtype == torch.bfloat16 and device_type == "cpu" and not cpu_has_native_bf16():
            logger.info("this CPU has no native bf16: dtype='auto' runs the bfloat16 checkpoint in float32")
            return torch.float32
        return dtype
    try:
        return _DTYPES[str(name)]
    except KeyError:
        raise ModelConfigError(
            f"unknown dtype {name!r}; use 'auto', 'float32', 'bfloat16' or 'float16'"
        ) from None


def shard_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """The [start, stop) of part `index` when n items split into `parts` balanced contiguous parts.

    The first n % parts parts hold one item more.
    """
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


# Tokens that pass through the decoder layers per token sampled, the assumption
# behind the default pipeline split: (prompt + output) / output of a typical chat
# request, from the ShareGPT medians (prompt 106, answer 142 tokens), so about 1.75.
TOKENS_PER_SAMPLE = 1.75

# The split's cost model counts time, in units of one decode row through one decoder
# layer. Measured on this project's machine (float32, packed weights, default model,
# PP2; tools/bench_pipeline.py): a decode row costs 0.135 ms per layer (32-row
# batches, attention over ~160 positions included); a prompt token in a 512-token
# chunk 0.055 ms, since large matmuls run near the roof: PROMPT_TOKEN_COST. The LM head
# costs 0.38 ms per sampled row, about half of what a layer would spend on as many
# multiply-adds (one large matmul against seven small ones plus attention):
# HEAD_MAC_COST. With them the default model's head is worth 2.2 layers on chat
# traffic and 1.6 on the 128-in / 64-out benchmark, and both get the split (5, 3),
# which measured fastest on both (README, Throughput): on 32 ShareGPT prompts (5, 3)
# gave 290-326 output tok/s, (6, 2) 269-284 and (4, 4) 306-308; on the benchmark
# (5, 3) 670 against 614 for (4, 4). Counting multiply-adds alone, as before, weighed
# the head at 3.2 layers and chose (6, 2).
PROMPT_TOKEN_COST = 0.41
HEAD_MAC_COST = 0.51


def layer_matmul_macs(args: LlamaArgs) -> int:
    """Multiply-adds of one decoder layer's projections per token (attention scores left out)."""
    d, hd = args.hidden_size, args.head_dim
    q, kv = args.num_attention_heads * hd, args.num_key_value_heads * hd
    return d * (2 * q + 2 * kv) + 3 * d * args.intermediate_size


def lm_head_layers(args: LlamaArgs, tokens_per_sample: float = TOKENS_PER_SAMPLE) -> float:
    """The LM head's cost in decoder layers: its time per sampled token over a layer's per sampled token.

    A sampled token brings one decode row and `tokens_per_sample - 1` prompt tokens
    through each layer (PROMPT_TOKEN_COST each); the head's multiply-adds count at
    HEAD_MAC_COST of a layer's.
    """
    head = args.hidden_size * args.vocab_size / layer_matmul_macs(args) * HEAD_MAC_COST
    prompt_tokens = max(0.0, tokens_per_sample - 1.0)
    return head / (1.0 + prompt_tokens * PROMPT_TOKEN_COST)


# Shares of a decoder layer's time spent in its MLP half, and in computing the layer's
# keys and values (input norm, k and v projections, rotating the keys, writing the
# cache: what a stage still does for a layer it lends whole to the next stage).
# Measured with tools/bench_layer_parts.py (default model, bfloat16, one thread,
# packed weights, the decode kernel): a 32-row decode step over ~160 positions spends
# 0.80-0.83 ms of a layer's 2.32-2.51 ms in the MLP and 0.31-0.36 ms in the keys and
# values, their decode-mirror rows included (the attention kernel takes most of the
# rest); a 512-token step of 128-token prompts 11.2-12.2 ms of 18.4-18.9 ms in the MLP
# and 1.75-1.81 ms in keys and values.
DECODE_MLP_SHARE = 0.33
PROMPT_MLP_SHARE = 0.60
DECODE_KV_SHARE = 0.13
PROMPT_KV_SHARE = 0.10


class BoundaryMove(enum.IntEnum):
    """How much of the last pipeline boundary's layers a step runs on the other side (see `LlamaStage`).

    NONE: every layer on its own stage. MLP: the last stage runs the MLP half of the
    layer before its own. LAYER: everything of that layer but its keys and values (the
    last stage keeps its own copy of the layer's KV cache for that, written from the keys
    and values sent every step). BACK: the other way, the stage before the last runs the
    attention half of the last stage's first layer, from its own copy of that layer's KV
    cache (the keys and values go forward with the hidden states; a step that runs the
    layer on the last stage sends them back).
    """

    BACK = -1
    NONE = 0
    MLP = 1
    LAYER = 2


def boundary_move(
    layout: "Layout", num_tokens: int, num_decode_rows: int, num_sampled: int, allow_back: bool = True
) -> BoundaryMove:
    """How much of the last boundary's layers a step moves across it.

    A split balanced for decode leaves the last stage idle for part of a prompt-heavy
    step, whose LM head work is small; a split balanced for prompts leaves the last stage
    the busier on decode steps, whose head work is large. Of the moves the layout allows
    (`allow_back=False` rules out BACK), the one with the lowest estimated cost of the
    busier of the two stages wins (the cost model of `split_layers`), ties going to the
    smaller move. Every rank of both stages decides alike from the step's shape.
    """
    moves_forward = layout.move_boundary_mlp and layout.pp_size >= 2
    moves_back = allow_back and layout.moves_back
    if not (moves_forward or moves_back):
        return BoundaryMove.NONE
    stages = layout.stage_layers
    prompt = num_tokens - num_decode_rows
    per_layer = num_decode_rows + prompt * PROMPT_TOKEN_COST
    mlp = num_decode_rows * DECODE_MLP_SHARE + prompt * PROMPT_TOKEN_COST * PROMPT_MLP_SHARE
    kv = num_decode_rows * DECODE_KV_SHARE + prompt * PROMPT_TOKEN_COST * PROMPT_KV_SHARE
    head = num_sampled * layout.head_layers_per_row
    giver = len(stages[-2]) * per_layer
    taker = len(stages[-1]) * per_layer + head
    moved = {BoundaryMove.NONE: 0.0}
    if moves_forward:
        moved[BoundaryMove.MLP] = mlp
        if layout.moves_attention:
            moved[BoundaryMove.LAYER] = per_layer - kv
    if moves_back:
        moved[BoundaryMove.BACK] = mlp - per_layer  # the attention half, the other way
    return min(moved, key=lambda m: (max(giver - moved[m], taker + moved[m]), abs(m), m))


def split_layers(
    num_layers: int,
    pp_size: int,
    layer_split: Optional[Sequence[int]] = None,
    last_stage_extra: float = 0.0,
) -> list[range]:
    """The contiguous layer range each pipeline stage owns.

    By default the split that minimises the busiest stage's cost, counting the
    last stage's LM head as `last_stage_extra` layers (see `lm_head_layers`); the
    other stages share the rest balanced, earlier ones taking the extra layers.
    With `last_stage_extra=0` that is the equal split. `layer_split` gives the
    per-stage layer counts instead.
    """
    if layer_split is None:
        if num_layers < pp_size:
            raise ModelConfigError(f"pp_size={pp_size} is larger than num_hidden_layers={num_layers}")
        counts = [num_layers] if pp_size == 1 else _balanced_counts(num_layers, pp_size, last_stage_extra)
    else:
        counts = [int(c) for c in layer_split]
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ModelConfigError(
                f"layer_split={list(layer_split)} must give pp_size={pp_size} counts, each >= 1, "
                f"summing to num_hidden_layers={num_layers}"
            )
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return [range(bounds[s], bounds[s + 1]) for s in range(pp_size)]


def _balanced_counts(num_layers: int, pp_size: int, last_extra: float) -> list[int]:
    # Every count for the last stage; the others share the rest as shard_range splits it.
    # The best has the smallest stage costs sorted from the largest down (the busiest
    # stage first, then the next), ties going to the smaller last stage.
    best: Optional[tuple[tuple[float, ...], list[int]]] = None
    for last in range(1, num_layers - pp_size + 2):
        rest = num_layers - last
        counts = [b - a for a, b in (shard_range(rest, pp_size - 1, s) for s in range(pp_size - 1))] + [last]
        key = tuple(sorted(counts[:-1] + [last + last_extra], reverse=True))
        if best is None or key < best[0]:
            best = (key, counts)
    assert best is not None
    return best[1]


@dataclass(frozen=True)
class Layout:
    """Where one rank sits in a (tp, pp) gang and what it owns of the model.

    Heads split evenly over tp. When tp_size exceeds num_key_value_heads, each kv
    head is replicated on the tp_size / num_key_value_heads ranks whose query heads use it.
    The vocabulary splits into tp_size shards of ceil(vocab / tp_size) rows, the last
    ones padded; the MLP's intermediate dimension splits balanced (sizes may differ by one).
    """

    args: LlamaArgs
    tp: int = 0
    tp_size: int = 1
    pp: int = 0
    pp_size: int = 1
    layer_split: Optional[tuple[int, ...]] = None
    # The last stage also holds the MLP of the layer before its own, so prompt-heavy steps
    # can run it there (boundary_move).
    move_boundary_mlp: bool = False
    # With move_boundary_mlp: it holds that whole layer and a copy of its KV cache, so
    # steps can move its attention too.
    move_boundary_attention: bool = False
    # The stage before the last also holds the attention half of the last stage's first
    # layer and a copy of its KV cache, so decode-heavy steps can run it there (BACK).
    move_boundary_back: bool = False

    @property
    def rank_label(self) -> str:
        return f"rank (pp={self.pp}, tp={self.tp})"

    @functools.cached_property
    def stage_layers(self) -> list[range]:  # computed once: every step asks (boundary_move)
        return split_layers(
            self.args.num_hidden_layers, self.pp_size, self.layer_split, lm_head_layers(self.args)
        )

    @functools.cached_property
    def head_layers_per_row(self) -> float:
        """The LM head's cost per sampled row, in decoder layers' cost per decode row (boundary_move)."""
        return lm_head_layers(self.args, tokens_per_sample=1.0)

    @property
    def layers(self) -> range:
        return self.stage_layers[self.pp]

    @property
    def borrowed_mlp(self) -> Optional[int]:
        """The previous stage's layer whose MLP half this (last) stage holds too, or None."""
        if not self.move_boundary_mlp or self.pp_size < 2 or not self.is_last_stage:
            return None
        return self.layers.start - 1

    @property
    def lends_mlp(self) -> bool:
        """Whether this stage's last layer's MLP may run on the next stage instead."""
        return self.move_boundary_mlp and self.pp_size >= 2 and self.pp == self.pp_size - 2

    @functools.cached_property
    def moves_attention(self) -> bool:
        """Whether the last boundary's whole layer may move: asked for, and free in KV memory.

        The last stage then keeps that layer's keys and values too. That costs no KV
        blocks when it still keeps no more layers than another stage does, which is also
        the only case where moving work onto it can pay (the cache is sized by the stage
        with the most layers, and the last stage has the LM head on top).
        """
        if not (self.move_boundary_mlp and self.move_boundary_attention and self.pp_size >= 2):
            return False
        counts = [len(r) for r in self.stage_layers]
        return counts[-1] + 1 <= max(counts)

    @property
    def borrows_attention(self) -> bool:
        """Whether this (last) stage holds the borrowed layer whole, with a KV cache for it."""
        return self.borrowed_mlp is not None and self.moves_attention

    @property
    def lends_attention(self) -> bool:
        """Whether this stage's last layer may run on the next stage, all but its keys and values."""
        return self.lends_mlp and self.moves_attention

    @functools.cached_property
    def moves_back(self) -> bool:
        """Whether the last stage's first attention half may run on the stage before: asked for, and of use.

        The stage before the last then keeps that layer's keys and values too, which costs
        KV blocks (the cache is sized by the stage that keeps the most layers), so the copy
        is kept only where the cost model would use it on a decode step.
        """
        if not (self.move_boundary_back and self.pp_size >= 2):
            return False
        stages = self.stage_layers
        giver, taker = len(stages[-2]), len(stages[-1]) + self.head_layers_per_row
        back = 1.0 - DECODE_MLP_SHARE  # a decode row's attention half, in layers
        return max(giver + back, taker - back) < taker

    @property
    def borrowed_next(self) -> Optional[int]:
        """On the stage before the last: the last stage's first layer, whose attention half it holds too; else None."""
        if not self.moves_back or self.pp != self.pp_size - 2:
            return None
        return self.stage_layers[-1].start

    @property
    def lends_back(self) -> bool:
        """Whether this (last) stage's first attention half may run on the stage before."""
        return self.moves_back and self.is_last_stage

    @property
    def cache_layers(self) -> list[int]:
        """The layers whose keys and values this rank keeps: its own, then any it borrows
        (the previous stage's last, on the last stage; the next stage's first, on the stage before it)."""
        own = list(self.layers)
        if self.borrows_attention:
            own.append(self.layers.start - 1)
        if self.borrowed_next is not None:
            own.append(self.borrowed_next)
        return own

    @property
    def most_cache_layers(self) -> int:
        """The most layers any stage keeps keys and values for (what sizes every rank's KV blocks)."""
        return max(len(replace(self, pp=s).cache_layers) for s in range(self.pp_size))

    @property
    def is_first_stage(self) -> bool:
        return self.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp == self.pp_size - 1

    @property
    def q_heads(self) -> tuple[int, int]:
        """The [start, stop) of the query heads this rank computes."""
        per_rank = self.args.num_attention_heads // self.tp_size
        return self.tp * per_rank, (self.tp + 1) * per_rank

    @property
    def kv_heads(self) -> tuple[int, int]:
        """The [start, stop) of the kv heads this rank holds (one replicated head when tp > kv heads)."""
        a = self.args
        if a.num_key_value_heads >= self.tp_size:
            per_rank = a.num_key_value_heads // self.tp_size
            return self.tp * per_rank, (self.tp + 1) * per_rank
        head = self.tp * a.num_key_value_heads // self.tp_size
        return head, head + 1

    @property
    def num_local_kv_heads(self) -> int:
        lo, hi = self.kv_heads
        return hi - lo

    @property
    def intermediate(self) -> tuple[int, int]:
        return shard_range(self.args.intermediate_size, self.tp_size, self.tp)

    @property
    def vocab_shard_size(self) -> int:
        return math.ceil(self.args.vocab_size / self.tp_size)

    @property
    def vocab(self) -> tuple[int, int]:
        """The [start, stop) of the vocabulary rows this rank holds (may be short or empty at the end)."""
        size, vocab = self.vocab_shard_size, self.args.vocab_size
        return min(self.tp * size, vocab), min((self.tp + 1) * size, vocab)


def check_layout(layout: Layout) -> None:
    """Raises ModelConfigError, naming the rank, when the model cannot be split this way."""
    a, tp = layout.args, layout.tp_size
    problems = []
    if tp > a.num_attention_heads:
        problems.append(f"tp_size={tp} is larger than num_attention_heads={a.num_attention_heads}")
    elif a.num_attention_heads % tp:
        problems.append(f"num_attention_heads={a.num_attention_heads} is not divisible by tp_size={tp}")
    kv = a.num_key_value_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        problems.append(
            f"num_key_value_heads={kv} and tp_size={tp} do not divide (one must be a multiple of the other)"
        )
    if tp > a.intermediate_size:
        problems.append(f"tp_size={tp} is larger than intermediate_size={a.intermediate_size}")
    if problems:
        raise ModelConfigError(f"{layout.rank_label}: cannot shard the model: " + "; ".join(problems))
    try:
        layout.stage_layers
    except ModelConfigError as exc:
        raise ModelConfigError(f"{layout.rank_label}: {exc}") from None
