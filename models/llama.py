"""Llama as plain nn.Modules: the whole forward math, with no ranks in it.

A `LlamaStage` is the part of the model one pipeline stage runs: a contiguous
range of decoder layers, plus the embedding on the first stage and the final norm
and LM head on the last. With one stage it is the whole model. Tensor parallelism
is applied afterwards by `models.parallel.shard_stage`, which swaps in sharded
linears and adds the all-reduces; this file does not change for it.

Tokens are flattened: activations are [T, hidden] for the T tokens of a step
(see models/step.py for how a ModelBatch becomes a step).

Numerics follow transformers' LlamaForCausalLM: RMSNorm in float32 then cast back,
rotary embeddings in the rotate-half layout computed in float32, Llama 3 frequency
scaling as in `_compute_llama3_parameters`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from models import norm_rope, prompt_attention
from models.argmax import row_argmax
from models.config import BoundaryMove, LlamaArgs
from models.kv_cache import LayerKV, PagedKVCache
from models.step import StepInputs

__all__ = [
    "Attention",
    "DecoderLayer",
    "Embedding",
    "FeedForward",
    "LlamaStage",
    "RMSNorm",
    "apply_rotary",
    "attend",
    "rope_inv_freq",
    "rotary_cos_sin",
]


class Embedding(nn.Module):
    """Token id -> row of `weight`.

    The weight comes from the checkpoint, so it is left uninitialized: nn.Embedding's
    random init on the meta device imports ~800 modules and costs every worker 68 MB.
    """

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm arithmetic: float32 norm, rounded to x's dtype, times weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            out = norm_rope.rms_norm(x, self.weight, self.eps)  # one pass, on CPU (models/norm_rope.py)
            if out is not None:
                return out
            # The same arithmetic with two passes over x instead of four and one [T, dim]
            # temporary instead of three (7680 rows x 512, one thread: 3.0 ms against 7.0;
            # bfloat16, 512 rows: 0.15 ms against 0.29).
            h = x if x.dtype == torch.float32 else x.float()
            scale = torch.linalg.vector_norm(h, dim=-1, keepdim=True)
            scale = scale.pow_(2).div_(x.shape[-1]).add_(self.eps).rsqrt_()
            if h is x:
                return torch.mul(x, scale).mul_(self.weight)
            # Rounded to x's dtype before the weight multiplies it, as transformers does.
            return h.mul_(scale).to(x.dtype).mul_(self.weight)
        return rms_norm_reference(x, self.weight, self.eps)


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim // 2] (float32, CPU), with the config's rope scaling."""
    dim = args.head_dim
    inv_freq = 1.0 / (
        args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    )
    scaling = args.rope_scaling
    if args.rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if args.rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] for token positions [T], computed in float32."""
    freqs = positions[:, None].float() * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, head_dim] by its positions' angles (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: Optional[torch.Tensor] = None,
    causal: bool = False,
) -> torch.Tensor:
    """softmax(q @ k^T * scale + mask) @ v.

    q [B, H, Q, d]; k, v [B, KV, L, d]; each run of H / KV query heads shares one
    kv head (grouped-query attention). `mask` is boolean, True where attending is allowed.
    """
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary for a fresh projection x: in place in one pass where a kernel can (models/norm_rope.py)."""
    out = norm_rope.rotate_(x, cos, sin)
    return out if out is not None else apply_rotary(x, cos, sin)


class Attention(nn.Module):
    """Grouped-query self-attention over a paged KV cache."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        d, hd = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys (rotated) and values [T, kv_heads, head_dim] of the normed input x."""
        t, hd = x.shape[0], self.head_dim
        k = _rotate(self.k_proj(x).view(t, self.n_kv_heads, hd), cos, sin)
        return k, self.v_proj(x).view(t, self.n_kv_heads, hd)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: StepInputs,
        cache: LayerKV,
        kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> torch.Tensor:
        """Attention of the normed input x; `kv`: its keys and values if already computed (`project_kv`)."""
        t, hd = x.shape[0], self.head_dim
        q = _rotate(self.q_proj(x).view(t, self.n_heads, hd), cos, sin)
        k, v = kv if kv is not None else self.project_kv(x, cos, sin)
        cache.write(k, v, step.slot_mapping, step.decode)

        # A decode-only step's output is the decode group's, in place of a scatter into `out`.
        dec = step.decode
        out = None if dec is not None and dec.every_row else torch.empty_like(q)
        prefills = step.prefills
        whole = [p for p in prefills if p.block_table is None]  # chunks that are their whole context
        if whole and prompt_attention.attend_prompts(
            q, k, v, out, [p.start for p in whole], [p.stop for p in whole], self.scale
        ):
            prefills = [p for p in prefills if p.block_table is not None]  # one kernel call did the rest
        for p in prefills:
            # One sequence's chunk; [1, heads, Q, d] layout for attention.
            qs = q[p.start : p.stop].transpose(0, 1)[None]
            if p.block_table is None:  # the chunk is its whole context
                ks = k[p.start : p.stop].transpose(0, 1)[None]
                vs = v[p.start : p.stop].transpose(0, 1)[None]
                o = attend(qs, ks, vs, self.scale, causal=True)
            else:
                ks, vs = cache.gather(p.block_table)
                # The cached prefix and the chunk: the kernel where it serves, else SDPA with the mask.
                keys = [p.start_pos + p.stop - p.start]
                if prompt_attention.attend_prompts(q, ks[0], vs[0], out, [p.start], [p.stop], self.scale, [0], keys):
                    continue
                o = attend(qs, ks.transpose(1, 2), vs.transpose(1, 2), self.scale, mask=p.mask)
            out[p.start : p.stop] = o[0].transpose(0, 1)
        if dec is not None:
            # One query per sequence: each kv head's group of query heads goes into the
            # query dimension, so the keys are attended without being repeated per head.
            b, groups = dec.rows.shape[0], self.n_heads // self.n_kv_heads
            qs = dec.take(q).reshape(b, self.n_kv_heads, groups, hd)
            # The fused kernel over the KV mirror where it serves (models/decode_attention.py).
            o = cache.decode_attention(dec, qs, self.scale)
            if o is None:
                ks, vs, mask, rows = cache.decode_kv(dec)
                if rows is not None:
                    # Cached rows are not in batch order: place each query at its sequence's row.
                    q_rows = qs.new_zeros((ks.shape[0], *qs.shape[1:]))
                    q_rows[rows] = qs
                    qs = q_rows
                o = attend(qs, ks.transpose(1, 2), vs.transpose(1, 2), self.scale, mask=mask)
                if rows is not None:
                    o = o[rows]
            if out is None:
                return self.o_proj(o.reshape(t, self.n_heads * hd))
            out[dec.rows] = o.reshape(b, self.n_heads, hd)
        assert out is not None
        return self.o_proj(out.view(t, self.n_heads * hd))


class FeedForward(nn.Module):
    """The SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        # In place: two fewer [T, intermediate] allocations, whose first touch costs
        # more than the arithmetic on CPU.
        return self.down_proj(F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection.

    With `attention=False` it holds only the MLP half (post_attention_layernorm and
    mlp): the copy of a pipeline boundary layer's MLP that the next stage keeps; with
    `mlp=False` only the attention half (input_layernorm and self_attn): the copy of the
    last stage's first layer that the stage before it keeps (see `LlamaStage`).
    """

    def __init__(self, args: LlamaArgs, attention: bool = True, mlp: bool = True) -> None:
        super().__init__()
        self.input_layernorm: Optional[RMSNorm] = (
            RMSNorm(args.hidden_size, args.rms_norm_eps) if attention else None
        )
        self.self_attn: Optional[Attention] = Attention(args) if attention else None
        self.post_attention_layernorm: Optional[RMSNorm] = RMSNorm(args.hidden_size, args.rms_norm_eps) if mlp else None
        self.mlp: Optional[FeedForward] = FeedForward(args) if mlp else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepInputs, cache: LayerKV
    ) -> torch.Tensor:
        return self.mlp_half(self.attention_half(x, cos, sin, step, cache))

    def attention_half(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: StepInputs,
        cache: LayerKV,
        kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        normed: Optional[torch.Tensor] = None,
        kv_out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x + attention(norm(x)): the residual stream between the layer's two halves.

        `kv` and `normed`: the keys and values of x and norm(x), where already computed.
        `kv_out` [T, 2, kv_heads, head_dim], if given, gets a copy of the keys and values
        (`input_kv`: what a pipeline stage sends to another stage's copy of the layer's cache).
        """
        assert self.self_attn is not None and self.input_layernorm is not None, "an MLP-only layer"
        if kv_out is not None:
            normed, kv = self.input_kv(x, cos, sin, out=kv_out)
        elif normed is None:
            normed = self.input_layernorm(x)
        if torch.is_grad_enabled():
            return x + self.self_attn(normed, cos, sin, step, cache, kv)
        # The residual add lands in the fresh attention output: no [T, hidden] allocation.
        return self.self_attn(normed, cos, sin, step, cache, kv).add_(x)

    def input_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """norm(x) and the keys and values the layer's attention makes of it.

        `out` [T, 2, kv_heads, head_dim], if given, gets a copy of them (what a pipeline
        stage sends to another stage's copy of the layer's cache).
        """
        assert self.self_attn is not None and self.input_layernorm is not None, "an MLP-only layer"
        normed = self.input_layernorm(x)
        k, v = self.self_attn.project_kv(normed, cos, sin)
        if out is not None:
            out[:, 0] = k
            out[:, 1] = v
        return normed, (k, v)

    def mlp_half(self, h: torch.Tensor) -> torch.Tensor:
        """h + mlp(norm(h))."""
        assert self.mlp is not None and self.post_attention_layernorm is not None, "an attention-only layer"
        if torch.is_grad_enabled():
            return h + self.mlp(self.post_attention_layernorm(h))
        return self.mlp(self.post_attention_layernorm(h)).add_(h)


class LlamaStage(nn.Module):
    """The layers `layer_ids` of a Llama, plus the embedding (first stage) and norm + LM head (last stage).

    Parameter names match the Hugging Face checkpoint without its "model." prefix
    (`layers.{global index}.self_attn.q_proj.weight`, `embed_tokens.weight`, ...).
    Build it on the meta device, shard it, then materialize and load it.

    `borrowed_mlp` names the layer, owned by the previous stage, whose MLP half this
    stage holds as well (`layers.{i}.mlp.*` and its post-attention norm), and with
    `borrowed_attention` the rest of that layer too. Each step then says how much of
    that boundary layer runs here (`move`, a `BoundaryMove`): NONE, all of it on the
    previous stage; MLP, the previous stage stops after the layer's attention half and
    this stage runs the MLP half first; LAYER, the previous stage only computes the
    layer's keys and values and this stage runs the rest. The MLP has no state. The
    attention has: the KV cache of that layer, which both stages keep, because the
    previous stage sends the layer's keys and values with every step's hidden states
    (`boundary_kv`). Prompt-heavy steps, whose LM head work is small, balance better
    with more moved.

    `borrowed_next` is the other way: the next (last) stage's first layer, whose
    attention half this stage holds too, with a copy of that layer's KV cache. On a BACK
    step this stage runs that attention half after its own layers and fills `next_kv`
    with the layer's keys and values, which the next stage writes into its own cache
    before running the layer's MLP half. On every other step the next stage runs the
    layer whole and, given `next_kv`, fills it: those keys and values go back to this
    stage's copy (`LayerKV.write_back`). Decode-heavy steps, whose LM head work is large,
    balance better with the attention moved back.
    """

    def __init__(
        self,
        args: LlamaArgs,
        layer_ids: range,
        first: bool,
        last: bool,
        borrowed_mlp: Optional[int] = None,
        borrowed_attention: bool = False,
        borrowed_next: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.args = args
        self.layer_ids = layer_ids
        if borrowed_mlp is not None and borrowed_mlp != layer_ids.start - 1:
            raise ValueError(f"borrowed_mlp={borrowed_mlp} is not the layer before {layer_ids}")
        if borrowed_attention and borrowed_mlp is None:
            raise ValueError("borrowed_attention needs borrowed_mlp")
        if borrowed_next is not None and (borrowed_next != layer_ids.stop or last):
            raise ValueError(f"borrowed_next={borrowed_next} is not the layer after {layer_ids} on a later stage")
        self.borrowed_mlp = borrowed_mlp
        self.borrowed_attention = borrowed_attention
        self.borrowed_next = borrowed_next
        self.embed_tokens: Optional[nn.Module] = (
            Embedding(args.vocab_size, args.hidden_size) if first else None
        )
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args) for i in layer_ids})
        if borrowed_mlp is not None:
            # Keyed by its global index like any layer, so its parameters are named as in the checkpoint.
            self.layers[str(borrowed_mlp)] = DecoderLayer(args, attention=borrowed_attention)
        if borrowed_next is not None:
            self.layers[str(borrowed_next)] = DecoderLayer(args, mlp=False)
        self.norm: Optional[RMSNorm] = RMSNorm(args.hidden_size, args.rms_norm_eps) if last else None
        self.lm_head: Optional[nn.Module] = (
            nn.Linear(args.hidden_size, args.vocab_size, bias=False) if last else None
        )
        # A plain attribute, not a buffer: it must survive meta-device construction and to_empty().
        self.inv_freq = rope_inv_freq(args)

    def forward(
        self,
        inputs: torch.Tensor,
        step: StepInputs,
        cache: PagedKVCache,
        move: BoundaryMove = BoundaryMove.NONE,
        boundary_kv: Optional[torch.Tensor] = None,
        next_kv: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after this stage's layers.

        `inputs` is token ids [T] on the first stage and the previous stage's hidden states otherwise.
        `move`: how much of the last boundary's layers runs across it this step (a
        `BoundaryMove`). A stage holding a borrowed layer runs its part; the stage it
        belongs to leaves that part out.
        `boundary_kv` [T, 2, kv_heads, head_dim]: the boundary layer's keys and values of
        these tokens. The stage that owns the layer writes them into it (pass an empty
        tensor), a stage that borrows the layer with its attention reads them.
        `next_kv` [T, 2, kv_heads, head_dim]: the last stage's first layer's keys and
        values (see the class docstring): written by the stage that runs its attention
        half, read by the last stage on a BACK step.
        """
        move = BoundaryMove(move)
        forward_move = move if move in (BoundaryMove.MLP, BoundaryMove.LAYER) else BoundaryMove.NONE
        h = self.embed_tokens(inputs) if self.embed_tokens is not None else inputs
        cos, sin = rotary_cos_sin(step.positions, self.inv_freq, h.dtype)
        cache.begin_step(step)
        if self.borrowed_mlp is not None:
            borrowed = self.layers[str(self.borrowed_mlp)]
            if self.borrowed_attention:
                if boundary_kv is None:
                    raise ValueError("a stage that borrows the boundary attention needs its keys and values")
                kv = (boundary_kv[:, 0], boundary_kv[:, 1])
                layer_cache = cache.layer(self.borrowed_mlp)
                if forward_move == BoundaryMove.LAYER:
                    h = borrowed.attention_half(h, cos, sin, step, layer_cache, kv=kv)
                else:
                    layer_cache.write(*kv, step.slot_mapping, step.decode)
            elif forward_move == BoundaryMove.LAYER:
                raise ValueError("move=LAYER on a stage that holds only the boundary MLP")
            if forward_move != BoundaryMove.NONE:
                h = borrowed.mlp_half(h)
        elif move == BoundaryMove.BACK and self.norm is not None and next_kv is None:
            raise ValueError("move=BACK on the last stage needs next_kv: the keys and values of its first layer")
        if move == BoundaryMove.BACK and self.norm is None and self.borrowed_next is None:
            raise ValueError("move=BACK on a stage that does not hold the next stage's first attention half")
        first, last = self.layer_ids[0], self.layer_ids[-1]
        for index in self.layer_ids:
            layer = self.layers[str(index)]
            kv_cache = cache.layer(index)
            if index == first and self.norm is not None and next_kv is not None:
                h = self._lend_back(layer, h, cos, sin, step, kv_cache, move, next_kv)
            elif index == last and self.borrowed_mlp is None and (
                boundary_kv is not None or forward_move != BoundaryMove.NONE
            ):
                h = self._lend(layer, h, cos, sin, step, kv_cache, forward_move, boundary_kv)
            else:
                h = layer(h, cos, sin, step, kv_cache)
        if self.borrowed_next is not None and move != BoundaryMove.BACK:
            # The next stage runs that layer: its keys come back later, but rows of the
            # mirror that this step refills must hold the rest now (the step commits them).
            cache.layer(self.borrowed_next).refill_mirror(step.decode)
        if move == BoundaryMove.BACK and self.borrowed_next is not None:
            if next_kv is None:
                raise ValueError("move=BACK needs next_kv to send the next stage's first layer's keys and values")
            layer = self.layers[str(self.borrowed_next)]
            h = layer.attention_half(h, cos, sin, step, cache.layer(self.borrowed_next), kv_out=next_kv)
        cache.end_step(step)
        return h

    @staticmethod
    def _lend(
        layer: DecoderLayer,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: StepInputs,
        cache: LayerKV,
        move: BoundaryMove,
        boundary_kv: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """This stage's last layer, less the part that `move` (NONE, MLP or LAYER) gives to the next stage."""
        if boundary_kv is None:
            if move == BoundaryMove.LAYER:
                raise ValueError("move=LAYER needs boundary_kv to send the layer's keys and values")
            return layer.attention_half(h, cos, sin, step, cache)  # move == MLP
        if move == BoundaryMove.LAYER:
            _, (k, v) = layer.input_kv(h, cos, sin, out=boundary_kv)
            cache.write(k, v, step.slot_mapping, step.decode)
            return h
        h = layer.attention_half(h, cos, sin, step, cache, kv_out=boundary_kv)
        return h if move == BoundaryMove.MLP else layer.mlp_half(h)

    @staticmethod
    def _lend_back(
        layer: DecoderLayer,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: StepInputs,
        cache: LayerKV,
        move: BoundaryMove,
        next_kv: torch.Tensor,
    ) -> torch.Tensor:
        """The last stage's first layer: its MLP half after a BACK step, else all of it, its keys and values into next_kv."""
        if move == BoundaryMove.BACK:
            cache.write(next_kv[:, 0], next_kv[:, 1], step.slot_mapping, step.decode)
            return layer.mlp_half(h)
        return layer.mlp_half(layer.attention_half(h, cos, sin, step, cache, kv_out=next_kv))

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the rows of hidden states `h` (last stage only)."""
        assert self.norm is not None and self.lm_head is not None, "only the last stage has the LM head"
        return self.lm_head(self.norm(h))

    def greedy_tokens(self, h: torch.Tensor) -> Optional[torch.Tensor]:
        """Argmax token ids [N] of the rows of `h` (last stage only); None on a tp rank that does not sample.

        A vocabulary-parallel head reduces each shard first, so full logits never travel.
        """
        assert self.norm is not None and self.lm_head is not None, "only the last stage has the LM head"
        h = self.norm(h)
        argmax = getattr(self.lm_head, "argmax", None)  # a VocabParallelLMHead's
        if argmax is not None:
            return argmax(h)
        # The sampler's argmax (first index on ties); widening to float32 first would change
        # no value, only cost a copy of the logits.
        return row_argmax(self.lm_head(h))
