"""`LlamaWorker`: one (pp, tp) rank of a sharded Llama, hosted in an actor process.

The actor runtime builds it as `LlamaWorker(ctx, **worker_kwargs)` and calls, on
every rank: `init_distributed()`, `load_model()` (returns the KV cache size for
the scheduler), then `execute_model(batch)` once per engine step.

Batch format (models/batch.py): every rank gets the same `ModelBatch`. Its chunks'
tokens are laid end to end (T tokens in batch order, see models/step.py), so every
rank knows T and the shapes of what it receives without a message. Stage 0 embeds
the token ids; each stage runs its layers, writing keys and values into its paged
cache at the slots the chunks' block tables name; a stage that is not the last
sends its hidden states [T, hidden] to the same tp rank of the next stage (and,
where the last stage keeps a copy of the boundary layer's cache, that layer's keys
and values [T, 2, kv_heads, head_dim] after them: see `LlamaStage`). The
last stage computes logits only for the last token of each chunk with `sample`
set, gathers them over tp on tp rank 0 (the output rank), which samples
and returns a `ModelOutput`; every other rank returns None.

On CPU the hidden states go through a shared-memory ring between the two ranks
(models/shm_handoff.py): the send is a copy, so stage 0 starts batch i+1 while
stage 1 computes batch i, and stage 1 finds the bytes there without waking any
thread of stage 0. Elsewhere (GPU, or a ring that cannot be mapped) sends are
asynchronous torch.distributed isends (tensor kept alive, waited for at most
pp_size steps later).

Moving the last stage's first attention half back (`move_boundary_back`, CPU only)
needs one ring the other way: the stage before the last keeps a copy of that
layer's KV cache, and every step that runs the layer on the last stage sends its
keys and values back. The stage before the last takes them at the start of its
next steps: all that has arrived, and on a step that attends the copy, waits for
any still missing for that step's sequences. A batch is submitted only after every
earlier batch holding any of its sequences returned, and the last stage sends a
step's keys back before it returns, so that wait is short in practice and keys of a
finished sequence reach the copy before its freed blocks can be written again.
"""

from __future__ import annotations

import collections
import logging
import os
import resource
import time
from datetime import timedelta
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from models import bf16_gemm, norm_rope, prompt_attention
from models.batch import ModelBatch, ModelOutput
from models.config import (
    BoundaryMove,
    Layout,
    ModelConfigError,
    boundary_move,
    check_layout,
    load_config,
    resolve_dtype,
)
from models.host_memory import keep_freed_memory as _keep_freed_memory
from models.kernel_warmup import KernelSet
from models.kv_cache import PagedKVCache
from models.llama import LlamaStage
from models.loader import load_stage
from models.parallel import TPGroup
from models.prepack import prepack_stage
from models.sampler import is_greedy, sample
from models.shm_allreduce import ShmAllReduce
from models.shm_handoff import ShmHandoffReceiver, ShmHandoffSender
from models.step import StepInputs, prepare_step

__all__ = ["LlamaWorker"]

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 64 * 2**20
# Steps kept in a rank's timeline (get_step_trace).
STEP_TRACE_LEN = 4096
# How long a shared-memory all-reduce spins before it yields, when every rank has a core.
SHM_SPIN_S = 1e-3
# The ring that brings the last stage's first layer's keys and values back holds this many
# tokens per batch in flight, plus one; a step with more tokens that runs that layer on
# the last stage ends the BACK moves of this gang (the copy would miss its keys).
BACK_RING_TOKENS = 1024


@dataclass
class _Writeback:
    """A step whose keys and values of the last stage's first layer are on their way back."""

    slots: torch.Tensor  # [T]: where they go in the copy
    seq_ids: frozenset  # every sequence of the step
    decode_rows: Optional[torch.Tensor]  # rows of the step's one-token chunks (mirror rows to update)
    decode_seq_ids: list[int]
    decode_positions: list[int]


def _default_threads(world_size: int) -> int:
    # Ranks of one host share its cores; more threads than cores only thrash.
    return max(1, len(os.sched_getaffinity(0)) // world_size)


class LlamaWorker:
    """One rank of a (tp, pp)-sharded Llama: its layers, weight shards, KV cache and (last stage) sampler.

    Args:
        ctx: the rank's `actors.ActorContext` (pp, tp, sizes, rendezvous).
        model: a Hugging Face checkpoint directory (config.json + safetensors).
        dtype: "auto" (the checkpoint's dtype, else float32), "float32", "bfloat16" or "float16".
        kv_cache_bytes: this rank's KV cache budget. Every rank allocates the same
            number of blocks: as many as fit the budget on the stage with the most layers.
        block_size: token positions per KV block.
        num_threads: torch intra-op threads (default: this host's CPUs / world_size).
        layer_split: layers per pipeline stage, e.g. (3, 5); default balanced by estimated
            cost, the LM head counted on the last stage (models.config.split_layers).
        dist_timeout_s: timeout of torch.distributed operations.
        device: "cpu", "cuda:0", ...; default the rank's GPU when CUDA is available, else CPU.
        shm_allreduce: on CPU, all-reduce tp partial sums through shared memory when every
            rank of the tp group can map it (one host); False keeps gloo.
        shm_handoff: on CPU, pass hidden states to the next stage through a shared-memory
            ring when both ranks can map it (one host; models/shm_handoff.py); False keeps
            gloo's send/recv.
        kv_mirror_bytes: most bytes of the dense decode copy of keys and values kept across
            steps (models/kv_mirror.py), which spares decode steps gathering every sequence's
            blocks; default kv_cache_bytes on CPU, 0 (off) on GPU.
        prepack_weights: on CPU, reorder the linear weights once for oneDNN's matmul
            (models/prepack.py) instead of on every call; a no-op where unsupported.
        decode_kernel: attend decode steps over the KV mirror with the numba kernel of
            models/decode_attention.py (float32 and bfloat16 on CPU); False, or where numba
            is missing, keeps SDPA.
        keep_freed_memory: on CPU, have glibc keep freed memory in the process
            (models/host_memory.py, process-wide), so each step's activations reuse
            warm pages instead of faulting in fresh ones; the rank's RSS then stays at its peak.
        move_boundary_mlp: with pp_size > 1, the last stage also holds the MLP of the layer
            before its first, and runs it on prompt-heavy steps, which a split balanced for
            decode leaves short of work there (models.config.boundary_move, LlamaStage).
        move_boundary_attention: with move_boundary_mlp, the last stage holds that whole
            layer and a copy of its KV cache (the previous stage sends the layer's keys and
            values with every step), so a prompt-heavy step can run all of the layer but its
            keys and values there.
        move_boundary_back: on CPU with shared-memory rings, the stage before the last also
            holds the attention half of the last stage's first layer and a copy of its KV
            cache, so a decode-heavy step, whose LM head work is large, can run that half
            there (BoundaryMove.BACK). Kept only where the cost model would use it on decode
            steps (Layout.moves_back); it makes that stage keep one more layer's keys and
            values, so every rank's KV budget holds fewer blocks.
        norm_rope_kernels: on CPU, RMSNorm and the rotation of queries and keys run in the
            numba kernels of models/norm_rope.py (float32 and bfloat16); False, or where
            numba is missing, keeps torch's ops. Process-wide (a rank is one process): a
            CPU worker loaded in a process that already runs another model sets it for both.
        kv_write_kernel: on CPU, each layer stores its keys and values in the paged cache
            and the KV mirror with one numba call (models/kv_write.py) instead of four
            indexing ops; False, or where numba is missing, keeps torch's ops.
        bf16_gemm_kernel: on a CPU with avx512_bf16, a bfloat16 rank runs its linears
            through models/bf16_gemm.py's kernel (on numba's pool with several threads)
            instead of oneDNN's GEMM (needs prepack_weights); False, or where numba or the
            instruction is missing, keeps oneDNN. Process-wide while the weights are
            packed, as norm_rope_kernels.
        prompt_attention_kernel: on a CPU with avx512_bf16, a bfloat16 rank attends prompt
            chunks (over the cached prefix too, for a continued prompt) through
            models/prompt_attention.py (the GEMM kernel's micro-kernel) instead of SDPA;
            False, or where numba or the instruction is missing, keeps SDPA. Process-wide,
            as norm_rope_kernels.
    """

    def __init__(
        self,
        ctx: Any,
        model: str,
        dtype: str = "auto",
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        block_size: int = 16,
        num_threads: Optional[int] = None,
        layer_split: Optional[Sequence[int]] = None,
        dist_timeout_s: float = 600.0,
        device: Optional[str] = None,
        shm_allreduce: bool = True,
        shm_handoff: bool = True,
        kv_mirror_bytes: Optional[int] = None,
        prepack_weights: bool = True,
        keep_freed_memory: bool = True,
        decode_kernel: bool = True,
        move_boundary_mlp: bool = True,
        move_boundary_attention: bool = True,
        move_boundary_back: bool = True,
        norm_rope_kernels: bool = True,
        kv_write_kernel: bool = True,
        bf16_gemm_kernel: bool = True,
        prompt_attention_kernel: bool = True,
    ) -> None:
        self.ctx = ctx
        self.where = f"rank (pp={ctx.pp}, tp={ctx.tp})"
        self.model_path = os.fspath(model)
        try:
            self.args = load_config(self.model_path)
            if device is None:
                cuda = torch.cuda.is_available()
                device = f"cuda:{ctx.global_rank % torch.cuda.device_count()}" if cuda else "cpu"
            self.device = torch.device(device)
            self.dtype = resolve_dtype(dtype, self.args, self.device.type)
        except ModelConfigError as exc:
            raise ModelConfigError(f"{self.where}: {exc}") from None
        self.layout = Layout(
            self.args,
            tp=ctx.tp,
            tp_size=ctx.tp_size,
            pp=ctx.pp,
            pp_size=ctx.pp_size,
            layer_split=tuple(layer_split) if layer_split is not None else None,
            move_boundary_mlp=bool(move_boundary_mlp),
            move_boundary_attention=bool(move_boundary_mlp and move_boundary_attention),
            # It needs the ring back (init_distributed), which exists only on CPU.
            move_boundary_back=bool(move_boundary_back and shm_handoff and self.device.type == "cpu"),
        )
        check_layout(self.layout)
        if block_size < 1 or kv_cache_bytes < 1:
            raise ModelConfigError(f"{self.where}: block_size and kv_cache_bytes must be >= 1")
        self.kv_cache_bytes = int(kv_cache_bytes)
        if kv_mirror_bytes is None:
            kv_mirror_bytes = self.kv_cache_bytes if self.device.type == "cpu" else 0
        if kv_mirror_bytes < 0:
            raise ModelConfigError(f"{self.where}: kv_mirror_bytes must be >= 0, got {kv_mirror_bytes}")
        self.kv_mirror_bytes = int(kv_mirror_bytes)
        self.block_size = int(block_size)
        self.dist_timeout_s = dist_timeout_s
        self.shm_allreduce = shm_allreduce
        self.shm_handoff = bool(shm_handoff)
        # The shared-memory rings to the previous and next stage (None: gloo, or no such stage).
        self._handoff_in: Optional[ShmHandoffReceiver] = None
        self._handoff_out: Optional[ShmHandoffSender] = None
        # The ring that brings the last stage's first layer's keys and values back (BACK moves).
        self._back_in: Optional[ShmHandoffReceiver] = None
        self._back_out: Optional[ShmHandoffSender] = None
        self._back_pending: collections.deque[_Writeback] = collections.deque()
        self._back_stale = False  # a step too large for the ring ran: no more BACK moves
        self._back_allowed = True  # set_move_back
        # Bytes of one token's keys and values of one layer on this rank (the ring back's unit).
        self._kv_row_bytes = (
            2 * self.layout.num_local_kv_heads * self.args.head_dim * torch.empty((), dtype=self.dtype).element_size()
        )
        self.prepack_weights = bool(prepack_weights)
        self.decode_kernel = bool(decode_kernel)
        self.norm_rope_kernels = bool(norm_rope_kernels)  # and loaded: see load_model
        self.kv_write_kernel = bool(kv_write_kernel)  # and loaded: see load_model
        self.bf16_gemm_kernel = bool(bf16_gemm_kernel)  # and loaded: see load_model
        self.prompt_attention_kernel = bool(prompt_attention_kernel)  # and loaded: see load_model
        # Before the weights and KV cache are allocated, so those too come from the heap.
        self.keeps_freed_memory = self.device.type == "cpu" and keep_freed_memory and _keep_freed_memory()
        self.num_packed = 0
        self.num_threads = num_threads or _default_threads(ctx.world_size)
        if self.device.type == "cpu":
            torch.set_num_threads(self.num_threads)

        self.tp_group = TPGroup(ctx.tp, ctx.tp_size, None)
        self.stage: Optional[LlamaStage] = None
        self.cache: Optional[PagedKVCache] = None
        self.num_params = 0
        self.load_seconds = 0.0
        self.generator = torch.Generator()  # unseeded requests; only the output rank samples
        self._pending_sends: collections.deque = collections.deque()
        self._steps = 0
        self._moved_mlp_steps = 0  # steps that ran the boundary MLP on the last stage
        self._moved_attention_steps = 0  # of those, steps that ran the boundary attention there too
        self._moved_back_steps = 0  # steps that ran the last stage's first attention half on the stage before
        self._writeback_steps = 0  # steps whose keys and values of that layer went back (or came back)
        self._tokens = 0
        self._execute_seconds = 0.0
        self._recv_seconds = 0.0  # of execute_seconds: waiting for the previous stage's hidden states
        self._send_wait_seconds = 0.0  # of execute_seconds: waiting for the next stage to take a send
        # The last steps' timeline (see get_step_trace); bounded so a long run cannot grow it.
        self._trace: collections.deque = collections.deque(maxlen=STEP_TRACE_LEN)
        self._recv_done = 0.0

    # ----- setup -----

    def init_distributed(self) -> dict[str, Any]:
        """Joins the gang's process group and builds the tp groups (every rank builds every group, in order)."""
        ctx = self.ctx
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend,
            init_method=ctx.init_method,
            rank=ctx.global_rank,
            world_size=ctx.world_size,
            timeout=timedelta(seconds=self.dist_timeout_s),
        )
        shm = None
        if ctx.tp_size > 1:
            own = None
            for pp in range(ctx.pp_size):
                ranks = list(range(pp * ctx.tp_size, (pp + 1) * ctx.tp_size))
                group = dist.new_group(ranks=ranks)
                if pp == ctx.pp:
                    own = group
            if self.device.type == "cpu" and self.shm_allreduce:
                # Every rank spins briefly only when each process of the host can have a core.
                spin = SHM_SPIN_S if ctx.world_size <= (os.cpu_count() or 1) else 0.0
                shm = ShmAllReduce.create(own, ctx.tp, ctx.tp_size, spin_s=spin, timeout_s=self.dist_timeout_s)
            self.tp_group = TPGroup(ctx.tp, ctx.tp_size, own, shm)
        if self.device.type == "cpu" and self.shm_handoff and ctx.pp_size > 1:
            # Stage by stage down the pipeline: a rank answers its previous stage's offer
            # before it makes its own, so the pairs' messages cannot wait on each other.
            if ctx.pp > 0:
                self._handoff_in = ShmHandoffReceiver.accept(ctx.global_rank - ctx.tp_size, timeout_s=self.dist_timeout_s)
            if ctx.pp < ctx.pp_size - 1:
                self._handoff_out = ShmHandoffSender.offer(ctx.global_rank + ctx.tp_size, timeout_s=self.dist_timeout_s)
        if self.layout.moves_back:
            self._open_back_ring()
        return {
            "rank": ctx.rank,
            "backend": backend,
            "shm_allreduce": shm is not None,
            "shm_handoff": self._handoff_in is not None or self._handoff_out is not None,
        }

    def _open_back_ring(self) -> None:
        """The ring from the last stage to the one before it; where any pair of ranks cannot have one,
        no rank moves attention back (every rank must decide moves alike)."""
        ctx, layout = self.ctx, self.layout
        capacity = (ctx.pp_size + 1) * BACK_RING_TOKENS * self._kv_row_bytes
        if layout.lends_back:
            self._back_out = ShmHandoffSender.offer(
                ctx.global_rank - ctx.tp_size, capacity=capacity, timeout_s=self.dist_timeout_s
            )
        if layout.borrowed_next is not None:
            self._back_in = ShmHandoffReceiver.accept(
                ctx.global_rank + ctx.tp_size, capacity=capacity, timeout_s=self.dist_timeout_s
            )
        needed = layout.lends_back or layout.borrowed_next is not None
        ok = torch.tensor([int(not needed or self._back_in is not None or self._back_out is not None)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item():
            logger.info("%s: no shared-memory ring back to the stage before the last: no BACK moves", self.where)
            for ring in (self._back_in, self._back_out):
                if ring is not None:
                    ring.close()
            self._back_in = self._back_out = None
            self.layout = replace(layout, move_boundary_back=False)

    def kernel_set(self) -> KernelSet:
        """The numba kernels this rank builds on CPU, as its options and dtype decide them (see models/kernel_warmup.py)."""
        return KernelSet(
            self.dtype,
            self.num_threads,
            self.args.head_dim,
            bf16_gemm=self.bf16_gemm_kernel and self.prepack_weights,
            decode_attention=self.decode_kernel and self.kv_mirror_bytes > 0,
            prompt_attention=self.prompt_attention_kernel,
            norm_rope=self.norm_rope_kernels,
            kv_write=self.kv_write_kernel,
            argmax=self.layout.is_last_stage,
        )

    def _kernels_in_use(self) -> dict[str, bool]:
        """Which of our kernels this rank runs (each False where switched off or unable to run here)."""
        return {
            "decode_kernel": self.decode_kernel,
            "norm_rope_kernels": self.norm_rope_kernels,
            "kv_write_kernel": self.kv_write_kernel,
            "bf16_gemm_kernel": self.bf16_gemm_kernel,
            "prompt_attention_kernel": self.prompt_attention_kernel,
        }

    def load_model(self) -> dict[str, Any]:
        """Builds this rank's stage, loads its weight shards and allocates its KV cache.

        Returns num_blocks and block_size (the same on every rank) plus what was loaded.
        """
        start = time.perf_counter()
        layout, args = self.layout, self.args
        if self.ctx.world_size > 1 and not dist.is_initialized():
            raise RuntimeError(f"{self.where}: call init_distributed() before load_model()")
        num_blocks = self._num_blocks()  # before reading weights: a budget too small fails fast
        stage, report = load_stage(layout, self.model_path, self.dtype, self.device, self.tp_group)
        # The numba kernels, built now as part of startup rather than in the first step
        # (none on GPU): each option stays on only where its kernel can run. The switches
        # below are process-wide (a rank is one process); they are set only where this
        # rank's tensors can take the kernel, so other models in the process keep theirs.
        built = self.kernel_set().build() if self.device.type == "cpu" else {}
        self.bf16_gemm_kernel = built.get("bf16_gemm", False)
        self.decode_kernel = built.get("decode_attention", False)
        self.norm_rope_kernels = built.get("norm_rope", False)
        self.kv_write_kernel = built.get("kv_write", False)
        self.prompt_attention_kernel = built.get("prompt_attention", False)
        if self.device.type == "cpu":
            norm_rope.set_enabled(self.norm_rope_kernels)
            if self.dtype == torch.bfloat16:
                bf16_gemm.set_enabled(self.bf16_gemm_kernel)  # the packing below reads it
                prompt_attention.set_enabled(self.prompt_attention_kernel)  # float32 keeps SDPA
        if self.prepack_weights:
            self.num_packed = prepack_stage(stage)  # 0 where unsupported (GPU, float16, no oneDNN)
        self.stage = stage
        self.num_params = report.num_params
        self.cache = PagedKVCache(
            layout.cache_layers,
            num_blocks,
            self.block_size,
            layout.num_local_kv_heads,
            args.head_dim,
            self.dtype,
            self.device,
            mirror_bytes=self.kv_mirror_bytes,
            mirror_entries=self.ctx.pp_size,  # one per batch group in flight
            decode_kernel=self.decode_kernel,
            write_kernel=self.kv_write_kernel,
        )
        self.load_seconds = time.perf_counter() - start
        logger.info(
            "%s: layers [%d, %d), %d params, %d KV blocks (%.1f MB) in %.2fs",
            self.where,
            layout.layers.start,
            layout.layers.stop,
            self.num_params,
            num_blocks,
            self.cache.nbytes / 1e6,
            self.load_seconds,
        )
        return {
            "rank": self.ctx.rank,
            "num_blocks": num_blocks,
            "block_size": self.block_size,
            "layers": (layout.layers.start, layout.layers.stop),
            "num_params": self.num_params,
            "param_bytes": report.nbytes,
            "kv_cache_bytes": self.cache.nbytes,
            "dtype": str(self.dtype).removeprefix("torch."),
            "load_seconds": self.load_seconds,
            "packed_weights": self.num_packed,
            **self._kernels_in_use(),
        }

    def _num_blocks(self) -> int:
        # Same on every rank: sized for the stage that keeps the most layers' keys, so no rank
        # allocates blocks the scheduler (which takes the minimum) can never use. A borrowed
        # boundary layer never makes the last stage keep more (Layout.moves_attention); the
        # copy kept for BACK moves does make the stage before it keep one more (Layout.moves_back).
        layout = self.layout
        most_layers = layout.most_cache_layers
        per_block = PagedKVCache.bytes_per_block(
            most_layers, self.block_size, layout.num_local_kv_heads, self.args.head_dim, self.dtype
        )
        num_blocks = self.kv_cache_bytes // per_block
        if num_blocks < 1:
            raise ModelConfigError(
                f"{self.where}: kv_cache_bytes={self.kv_cache_bytes} is less than one KV block "
                f"({per_block} bytes for {most_layers} layers)"
            )
        return num_blocks

    # ----- steps -----

    def execute_model(self, batch: ModelBatch) -> Optional[ModelOutput]:
        """Runs one step; the output rank returns the sampled tokens, every other rank None."""
        start = time.perf_counter()
        with torch.inference_mode():
            step, rows = self._forward(batch)
            chunks = step.sample_chunks
            tokens: list[int] = []
            logprobs = None
            if rows is not None:
                options = [c.sampling for c in chunks]
                # Every rank of the last stage sees the same batch, so all take the same branch
                # (both are collectives over the tp group).
                if all(is_greedy(o) for o in options):
                    ids = self.stage.greedy_tokens(rows)
                    if ids is not None:
                        tokens = ids.tolist()
                else:
                    logits = self.stage.compute_logits(rows)
                    if self.ctx.is_output_rank:
                        tokens, logprobs = sample(logits, options, [c.num_generated for c in chunks], self.generator)
            output = None
            if self.ctx.is_output_rank:
                output = ModelOutput(batch.batch_id, [c.seq_id for c in chunks], tokens, logprobs)
        end = time.perf_counter()
        self._execute_seconds += end - start
        self._trace.append((batch.batch_id, start, self._recv_done, end))
        return output

    def compute_logits(self, batch: ModelBatch) -> Optional[torch.Tensor]:
        """Like execute_model, but the output rank returns the float32 logits [N, vocab] of the sampled rows.

        Other ranks return None. For tests and tools; it writes the KV cache as execute_model does.
        """
        with torch.inference_mode():
            _, rows = self._forward(batch)
            if rows is None:
                return None
            logits = self.stage.compute_logits(rows)
        return logits.float() if self.ctx.is_output_rank else None

    def _forward(self, batch: ModelBatch) -> tuple[StepInputs, Optional[torch.Tensor]]:
        """Runs this stage's layers; returns the step and, on the last stage, the hidden rows to sample (None if none)."""
        stage, cache, ctx = self.stage, self.cache, self.ctx
        if stage is None or cache is None:
            raise RuntimeError(f"{self.where}: call load_model() before execute_model()")
        step = prepare_step(
            batch,
            block_size=self.block_size,
            num_blocks=cache.num_blocks,
            vocab_size=self.args.vocab_size,
            device=self.device,
            where=self.where,
        )
        self._steps += 1
        self._tokens += step.num_tokens
        self._recv_done = time.perf_counter()
        if step.num_tokens == 0:
            return step, None
        layout = self.layout
        move = BoundaryMove.NONE
        at_boundary = layout.lends_mlp or layout.borrowed_mlp is not None
        if at_boundary or layout.borrowed_next is not None or layout.lends_back:
            move = boundary_move(
                layout, step.num_tokens, step.num_decode_rows, int(step.sample_rows.numel()),
                allow_back=self._back_allowed and not self._back_stale,
            )
        if move in (BoundaryMove.MLP, BoundaryMove.LAYER):
            self._moved_mlp_steps += 1
            self._moved_attention_steps += move == BoundaryMove.LAYER
        self._moved_back_steps += move == BoundaryMove.BACK
        writeback = self._writeback_planned(step, move)
        kv_shape = (step.num_tokens, 2, layout.num_local_kv_heads, self.args.head_dim)
        # The boundary layer's keys and values, sent with the hidden states every step when
        # the next stage keeps a copy of that layer's cache.
        boundary_kv = None
        if layout.lends_attention or layout.borrows_attention:
            boundary_kv = torch.empty(kv_shape, dtype=self.dtype, device=self.device)
        # The last stage's first layer's keys and values: forward on a BACK step, back after others.
        next_kv = None
        if move == BoundaryMove.BACK or (writeback and layout.lends_back):
            next_kv = torch.empty(kv_shape, dtype=self.dtype, device=self.device)
        if layout.borrowed_next is not None:
            # Before the step: its copy must hold what it attends, and writes of the step
            # must not be overwritten by older keys arriving late.
            self._take_writebacks(batch, wait=move == BoundaryMove.BACK)
        if ctx.is_first_stage:
            x = step.token_ids
        else:
            x = torch.empty(step.num_tokens, self.args.hidden_size, dtype=self.dtype, device=self.device)
            waited = time.perf_counter()
            incoming = [x]
            if layout.borrows_attention:
                incoming.append(boundary_kv)
            if move == BoundaryMove.BACK and layout.lends_back:
                incoming.append(next_kv)
            self._recv(*incoming)
            self._recv_done = time.perf_counter()
            self._recv_seconds += self._recv_done - waited
        h = stage(x, step, cache, move=move, boundary_kv=boundary_kv, next_kv=next_kv)
        if not ctx.is_last_stage:
            outgoing = [h]
            if layout.lends_attention:
                outgoing.append(boundary_kv)
            if move == BoundaryMove.BACK and layout.borrowed_next is not None:
                outgoing.append(next_kv)
            self._send_next(*outgoing)
            if writeback and layout.borrowed_next is not None:
                self._expect_writeback(batch, step)
            return step, None
        if writeback and layout.lends_back:
            assert self._back_out is not None and next_kv is not None
            self._back_out.send(next_kv)  # before this step returns (see the module docstring)
        if step.sample_rows.numel() == 0:
            return step, None
        return step, h[step.sample_rows]

    def _writeback_planned(self, step: StepInputs, move: BoundaryMove) -> bool:
        """Whether this step's keys and values of the last stage's first layer go back to the stage before.

        Decided alike on both stages from the step: every step that runs that layer on the
        last stage, unless too large for the ring, which stops BACK moves for good.
        """
        layout = self.layout
        if not layout.moves_back or self._back_stale or move == BoundaryMove.BACK or step.num_tokens == 0:
            return False
        if not (layout.lends_back or layout.borrowed_next is not None):
            return False
        if step.num_tokens > BACK_RING_TOKENS:
            self._back_stale = True
            logger.warning(
                "%s: a step of %d tokens is more than the ring back holds (%d): no more BACK moves",
                self.where, step.num_tokens, BACK_RING_TOKENS,
            )
            return False
        self._writeback_steps += 1
        return True

    def _expect_writeback(self, batch: ModelBatch, step: StepInputs) -> None:
        dec = step.decode
        self._back_pending.append(
            _Writeback(
                slots=step.slot_mapping,
                seq_ids=frozenset(c.seq_id for c in batch.chunks),
                decode_rows=dec.rows if dec is not None else None,
                decode_seq_ids=list(dec.seq_ids) if dec is not None else [],
                decode_positions=list(dec.positions) if dec is not None else [],
            )
        )

    def _take_writebacks(self, batch: ModelBatch, wait: bool) -> None:
        """Writes into the copy every pending writeback that has arrived; with `wait`, also waits for any of `batch`'s sequences."""
        ring, pending = self._back_in, self._back_pending
        if ring is None or not pending or self.cache is None:
            return
        row_bytes = self._kv_row_bytes
        seqs = {c.seq_id for c in batch.chunks} if wait else set()
        layer = self.cache.layer(self.layout.borrowed_next)
        while pending:
            head = pending[0]
            tokens = head.slots.numel()
            if ring.available() < tokens * row_bytes and not any(seqs & e.seq_ids for e in pending):
                break
            kv = torch.empty(
                (tokens, 2, self.layout.num_local_kv_heads, self.args.head_dim), dtype=self.dtype, device=self.device
            )
            ring.recv_into(kv)  # waits only when a sequence of this step needs it
            pending.popleft()
            layer.write_back(kv[:, 0], kv[:, 1], head.slots, head.decode_rows, head.decode_seq_ids, head.decode_positions)

    def _recv(self, *xs: torch.Tensor) -> None:
        """Fills xs, in order, with what the previous stage's `_send_next` sent."""
        if self._handoff_in is not None:
            self._handoff_in.recv_into(*xs)
            return
        for x in xs:
            dist.recv(x, src=self.ctx.global_rank - self.ctx.tp_size)

    def _send_next(self, *xs: torch.Tensor) -> None:
        """Sends one step's tensors to the same tp rank of the next stage."""
        if self._handoff_out is not None:
            waited = self._handoff_out.wait_seconds
            self._handoff_out.send(*xs)  # a copy into the ring; waits only if the next stage is a ring behind
            self._send_wait_seconds += self._handoff_out.wait_seconds - waited
            return
        pending = self._pending_sends
        while pending and all(work.is_completed() for work in pending[0][0]):
            pending.popleft()
        # Bound what is in flight to pp_size steps; the next stage takes them in order, so
        # the oldest finishes first.
        if len(pending) >= self.ctx.pp_size:
            waited = time.perf_counter()
            while len(pending) >= self.ctx.pp_size:
                for work in pending.popleft()[0]:
                    work.wait()
            self._send_wait_seconds += time.perf_counter() - waited
        dst = self.ctx.global_rank + self.ctx.tp_size
        xs = tuple(x.contiguous() for x in xs)  # kept alive until their sends complete
        pending.append(([dist.isend(x, dst=dst) for x in xs], xs))

    # ----- health and stats -----

    def set_move_back(self, allowed: bool) -> bool:
        """Allows or forbids BACK moves from the next step on; returns whether they can happen.

        Call it on every rank between steps (`collective_rpc`): both stages must decide moves
        alike. The copy stays whole either way (the keys keep coming back), so a benchmark
        can compare the two in one session.
        """
        self._back_allowed = bool(allowed)
        return self._back_allowed and self.layout.moves_back and not self._back_stale

    def check_health(self) -> dict[str, Any]:
        """Cheap liveness facts of this rank (no communication)."""
        return {
            "rank": self.ctx.rank,
            "pid": os.getpid(),
            "loaded": self.stage is not None,
            "distributed": dist.is_initialized(),
        }

    def get_stats(self) -> dict[str, Any]:
        """Memory and work counters of this rank."""
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        layers = self.layout.layers
        shm = self.tp_group.shm
        mirror = self.cache.mirror if self.cache is not None else None
        return {
            "rank": self.ctx.rank,
            "pid": os.getpid(),
            "layers": (layers.start, layers.stop),
            "first_stage": self.layout.is_first_stage,
            "last_stage": self.layout.is_last_stage,
            "num_params": self.num_params,
            "kv_cache_bytes": self.cache.nbytes if self.cache is not None else 0,
            "num_blocks": self.cache.num_blocks if self.cache is not None else 0,
            "rss_bytes": rss_pages * os.sysconf("SC_PAGE_SIZE"),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "steps": self._steps,
            "moved_mlp_steps": self._moved_mlp_steps,
            "moved_attention_steps": self._moved_attention_steps,
            "moved_back_steps": self._moved_back_steps,
            "writeback_steps": self._writeback_steps,
            "borrowed_next": self.layout.borrowed_next,
            "borrowed_mlp": self.layout.borrowed_mlp,
            "borrowed_attention": self.layout.borrows_attention,
            "tokens": self._tokens,
            "execute_seconds": self._execute_seconds,
            "recv_seconds": self._recv_seconds,
            "send_wait_seconds": self._send_wait_seconds,
            # Shared-memory tp all-reduces (0 without them): all of it, and waiting for a peer.
            "allreduce_seconds": shm.seconds if shm is not None else 0.0,
            "allreduce_wait_seconds": shm.wait_seconds if shm is not None else 0.0,
            # How hidden states reach this rank and leave it: "shm" (models/shm_handoff.py),
            # "dist" (torch.distributed send/recv) or None (first / last stage).
            "handoff_in": None if self.layout.is_first_stage else ("shm" if self._handoff_in is not None else "dist"),
            "handoff_out": None if self.layout.is_last_stage else ("shm" if self._handoff_out is not None else "dist"),
            "load_seconds": self.load_seconds,
            "kv_mirror_bytes": mirror.nbytes if mirror is not None else 0,
            "kv_mirror_refilled_rows": mirror.refilled_rows if mirror is not None else 0,
            "kv_mirror_fallbacks": mirror.fallbacks if mirror is not None else 0,
            "packed_weights": self.num_packed,
            **self._kernels_in_use(),
            "keeps_freed_memory": self.keeps_freed_memory,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "num_threads": self.num_threads,
        }

    def get_step_trace(self, clear: bool = False) -> list[tuple[int, float, float, float]]:
        """This rank's last steps (at most STEP_TRACE_LEN): (batch_id, start, inputs_ready, end).

        Times are `time.perf_counter()` seconds (CLOCK_MONOTONIC, one clock for every process
        of a host); inputs_ready is when the previous stage's hidden states had arrived (stage 0:
        when the step's inputs were built). clear=True empties the timeline after reading it.
        """
        trace = list(self._trace)
        if clear:
            self._trace.clear()
        return trace

    def shutdown(self) -> None:
        """Leaves the process group and drops the model; safe to call twice."""
        # Sends still in flight are abandoned, not waited for: the peer may be gone.
        self._pending_sends.clear()
        if self.tp_group.shm is not None:
            self.tp_group.shm.close()
        for ring in (self._handoff_in, self._handoff_out, self._back_in, self._back_out):
            if ring is not None:
                ring.close()
        self._back_pending.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.stage = None
        self.cache = None
