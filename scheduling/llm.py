"""`LLM`: a gang of LlamaWorkers, a scheduler and an engine behind one `generate` call."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Optional, Sequence, Union

from typing_extensions import Self

from actors import ConfigError, FaultPlan, RayOptions, Supervisor, SupervisionPolicy, prestart
from actors.gang import start_context
from models.config import LlamaArgs, ModelConfigError, load_config, resolve_dtype
from models.kernel_warmup import KernelSet, WarmUp, warm_up
from scheduling.engine import Engine
from scheduling.request import Request, RequestOutput
from scheduling.sampling_params import SamplingParams, is_int
from scheduling.scheduler import Scheduler
from scheduling.tokenizer import load_tokenizer

__all__ = ["LLM", "default_max_num_batched_tokens"]

logger = logging.getLogger(__name__)

WORKER = "models.worker:LlamaWorker"
PRELOAD = ("models.preload",)  # imported once by the fork server that starts the ranks
DEFAULT_KV_CACHE_BYTES = 256 * 2**20
# Fewer prompts than this finish too fast for a progress bar to tell anyone anything.
TQDM_MIN_PROMPTS = 16

# Token budget of one batch. With one stage, the bigger the batch the better (the
# whole prompt set prefills in one step). With a pipeline, a step that is all
# prefill is bound by the first stage and one that is all decode by the last (the
# LM head): a small budget spreads prompts in chunks over the decode steps, so
# each batch carries both and the stages stay busy together. Measured with PP2
# on the bench workload (tools/bench_throughput.py, split (5, 3), 4 alternating
# runs): 512 tokens gave a median 513 output tok/s against 465 for 8192.
MAX_NUM_BATCHED_TOKENS = 8192
PP_MAX_NUM_BATCHED_TOKENS = 512

Prompt = Union[str, Sequence[int]]


def _listed(items: Any, what: str) -> list:
    """`items` as a list (a tensor or array through its `tolist`), else TypeError saying what was expected."""
    if hasattr(items, "tolist"):
        items = items.tolist()
    try:
        return list(items)
    except TypeError:
        raise TypeError(f"{what}, got {type(items).__name__}") from None


def default_max_num_batched_tokens(pp: int) -> int:
    """The engine's token budget per batch when none is given: large for one stage, small for a pipeline."""
    return MAX_NUM_BATCHED_TOKENS if pp == 1 else PP_MAX_NUM_BATCHED_TOKENS


def driver_cpus(plan: Optional[list[list[int]]], tp: int) -> Optional[list[int]]:
    """Where this process's engine loop and reply router run, given the ranks' CPU plan.

    CPUs no rank is pinned to, where there are any; else, in a pipeline, the first
    stage's: a batch's next step waits on stage 0 for the driver's work between the
    last stage's reply and the next submit, so those CPUs are idle just then, whereas a
    later stage is still computing the other batch. Else None (wherever the OS puts them).
    """
    if plan is None:
        return None
    used = {cpu for cpus in plan for cpu in cpus}
    free = sorted(set(os.sched_getaffinity(0)) - used)
    if free:
        return free
    if len(plan) > tp:
        return sorted({cpu for cpus in plan[:tp] for cpu in cpus})
    return None


@contextlib.contextmanager
def _this_thread_on(cpus: Optional[list[int]]) -> Iterator[None]:
    """Runs the block with the calling thread pinned to `cpus` (if any), then restores its CPUs."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)  # Linux: 0 is the calling thread
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.debug("engine loop not pinned to CPUs %s: %s", cpus, exc)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def cpu_plan(world_size: int, cpus_per_rank: Optional[int]) -> Optional[list[list[int]]]:
    """The CPUs of each rank: rank r gets the r-th run of `cpus_per_rank` of this process's CPUs (wrapping).

    None (the default) means ncpu // world_size when every rank can have a CPU of
    its own, else no pinning; 0 means no pinning.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if cpus_per_rank is None:
        if world_size > len(cpus):
            return None
        cpus_per_rank = len(cpus) // world_size
    if cpus_per_rank < 0:
        raise ValueError(f"cpus_per_rank must be >= 0, got {cpus_per_rank}")
    if cpus_per_rank == 0:
        return None
    k = cpus_per_rank
    return [[cpus[(r * k + i) % len(cpus)] for i in range(k)] for r in range(world_size)]


def eos_token_ids(model_dir: str) -> list[int]:
    """The end-of-sequence ids, from generation_config.json as transformers reads them, else config.json."""
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(model_dir, name)) as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if eos is not None:
            return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
    return []


class LLM:
    """Offline generation on a (tp, pp) gang of `models.worker.LlamaWorker` processes.

    Args:
        model: a Hugging Face Llama checkpoint dir; None: the built-in default model.
        tp, pp: tensor- and pipeline-parallel sizes (tp * pp worker processes).
        dtype: "auto" (the checkpoint's), "float32", "bfloat16" or "float16".
        kv_cache_bytes: KV cache budget of each rank.
        block_size: token positions per KV block.
        kv_mirror_bytes: per rank, the most bytes of the dense decode copy of keys and values
            kept across steps (models/kv_mirror.py); default kv_cache_bytes on CPU (so KV
            memory at most doubles), 0 on GPU; 0 turns it off.
        prepack_weights: on CPU, reorder every rank's linear weights once for oneDNN's
            matmul (models/prepack.py); True by default, a no-op where unsupported.
        decode_kernel: on CPU, decode attention over the KV mirror runs in one numba
            kernel per layer (models/decode_attention.py) instead of SDPA; True by default,
            SDPA where numba is missing.
        move_boundary_mlp: with pp > 1, the last stage also holds the MLP of the layer
            before its own and runs it on prompt-heavy steps, to even out the stages
            there (models.config.boundary_move); True by default.
        move_boundary_attention: with move_boundary_mlp, the last stage holds that whole
            layer and a copy of its KV cache, so prompt-heavy steps can run all of it there
            but its keys and values; True by default.
        move_boundary_back: on CPU with pp > 1, the stage before the last also holds the
            attention half of the last stage's first layer and a copy of its KV cache, so
            decode-heavy steps, whose LM head work is large, can run it there; kept only
            where the cost model would use it (it costs that stage one more layer of KV
            blocks, so every rank's budget holds fewer); True by default.
        shm_handoff: on CPU with pp > 1, hidden states go to the next stage through a
            shared-memory ring (models/shm_handoff.py) instead of gloo's send/recv; True
            by default, gloo where the ring cannot be mapped.
        norm_rope_kernels: on CPU, RMSNorm and the rotation of queries and keys run in
            numba kernels (models/norm_rope.py); True by default, torch's ops where numba
            is missing.
        kv_write_kernel: on CPU, each layer stores its keys and values in the paged cache
            and the KV mirror with one numba call (models/kv_write.py); True by default,
            torch's indexing ops where numba is missing.
        bf16_gemm_kernel: on a CPU with avx512_bf16, bfloat16 ranks run their linears
            through our GEMM kernel (models/bf16_gemm.py; split over numba's pool on ranks
            with several threads) instead of oneDNN's; True by default, oneDNN where numba
            or the instruction is missing.
        prompt_attention_kernel: on a CPU with avx512_bf16, bfloat16 ranks attend prompt
            chunks (over the cached prefix too, for a continued prompt) through our kernel
            (models/prompt_attention.py) instead of SDPA; True by default, SDPA where numba
            or the instruction is missing.
        keep_freed_memory: on CPU, each rank's glibc keeps freed memory in the process
            (models/host_memory.py): faster large steps, RSS stays at its peak.
        max_num_seqs, max_num_batched_tokens: the most sequences / tokens in one batch;
            the token budget defaults to 8192 with one stage and 512 with pp > 1
            (chunked prefill mixed into decode steps; see `default_max_num_batched_tokens`).
        max_model_len: most tokens (prompt plus output) per request; default the
            smaller of the model's max_position_embeddings and what the cache holds.
        num_threads: torch threads per rank (default: its pinned CPUs, else ncpu / world_size).
        compile_workers: processes that compile the ranks' numba kernels into numba's
            cache while the gang starts, on a machine's first start (models/kernel_warmup.py);
            default one per CPU, 0: each rank compiles its own. Not with backend="ray" or CUDA.
        start_timeout: seconds for the gang to start and load the model.
        step_timeout: deadline of each execute_model call (None: 300 s).
        cpus_per_rank: pin each rank to this many CPUs of its own (see `cpu_plan`);
            default ncpu // world_size when world_size <= ncpu; 0 disables pinning.
        layer_split: layers per pipeline stage (default balanced by estimated cost, the LM
            head counted on the last stage; see models.config.split_layers).
        max_inflight: batches in flight at once (default pp: one per stage).
        policy: supervision policy, "fail" (default) or "restart"; after a restart the
            engine recomputes the requests that were running, so none is lost.
        fault_plan: an `actors.FaultPlan` (deterministic fault injection, for tests).
        pin_driver: with backend "mp" and pinned ranks, run this process's engine loop (while
            `generate` runs) and reply router on the CPUs `driver_cpus` picks: a pipeline's
            first stage's, or CPUs no rank uses (True, the default); False leaves them to the OS.
        backend: "mp" (default, worker processes of this one) or "ray" (Ray actors placed
            through placement groups; see `actors.RayOptions`). With "ray" ranks are not
            pinned unless `cpus_per_rank` is given, and each runs `ray_options.num_cpus` threads.
        ray_options: an `actors.RayOptions` for backend="ray".
    """

    def __init__(
        self,
        model: Optional[Union[str, os.PathLike[str]]] = None,
        tp: int = 1,
        pp: int = 1,
        dtype: str = "auto",
        *,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        block_size: int = 16,
        kv_mirror_bytes: Optional[int] = None,
        prepack_weights: bool = True,
        decode_kernel: bool = True,
        move_boundary_mlp: bool = True,
        move_boundary_attention: bool = True,
        move_boundary_back: bool = True,
        shm_handoff: bool = True,
        norm_rope_kernels: bool = True,
        kv_write_kernel: bool = True,
        bf16_gemm_kernel: bool = True,
        prompt_attention_kernel: bool = True,
        keep_freed_memory: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: Optional[int] = None,
        max_model_len: Optional[int] = None,
        num_threads: Optional[int] = None,
        compile_workers: Optional[int] = None,
        start_timeout: float = 120.0,
        step_timeout: Optional[float] = None,
        cpus_per_rank: Optional[int] = None,
        layer_split: Optional[Sequence[int]] = None,
        max_inflight: Optional[int] = None,
        policy: Union[str, SupervisionPolicy, None] = None,
        fault_plan: Optional[FaultPlan] = None,
        pin_driver: bool = True,
        backend: str = "mp",
        ray_options: Optional[RayOptions] = None,
    ) -> None:
        sizes = {"tp": tp, "pp": pp, **({} if num_threads is None else {"num_threads": num_threads})}
        for name, value in sizes.items():
            # Checked before anything starts: the CPU plan below divides by tp * pp.
            if not is_int(value) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if compile_workers is not None and (not is_int(compile_workers) or compile_workers < 0):
            raise ConfigError(f"compile_workers must be an integer >= 0, got {compile_workers!r}")
        tp, pp = int(tp), int(pp)
        if backend == "mp":
            # The fork server imports the worker's modules (torch: about 2.5 s of CPU) once
            # for every rank, meanwhile this process finds the model and its tokenizer.
            prestart(PRELOAD)
        world_size = tp * pp
        if backend == "ray":
            # Ray decides where ranks run: pin only when asked; threads follow the CPUs reserved.
            plan = cpu_plan(world_size, cpus_per_rank) if cpus_per_rank else None
            if num_threads is None:
                num_threads = max(1, int((ray_options or RayOptions()).num_cpus))
        else:
            plan = cpu_plan(world_size, cpus_per_rank)
        if num_threads is None and plan is not None:
            num_threads = len(plan[0])
        # Where the engine loop and the reply router run (None: wherever the OS puts them).
        self.driver_cpus: Optional[list[int]] = driver_cpus(plan, tp) if backend == "mp" and pin_driver else None
        warmup_options: Optional[dict[str, Any]] = None
        if backend == "mp" and compile_workers != 0:
            warmup_options = dict(
                threads=num_threads or max(1, len(os.sched_getaffinity(0)) // world_size),
                bf16_gemm=bf16_gemm_kernel and prepack_weights,
                decode_attention=decode_kernel and (kv_mirror_bytes is None or kv_mirror_bytes > 0),
                prompt_attention=prompt_attention_kernel,
                norm_rope=norm_rope_kernels,
                kv_write=kv_write_kernel,
            )
        early: Optional[Future] = None  # a warm-up started before the default model's build
        if model is None:
            from models.default_model import default_model_args, default_model_built, default_model_dir

            if warmup_options is not None and not default_model_built():
                # A machine's first start: building the model takes seconds, so the kernels'
                # warm-up starts first, from the config the build writes. Starting it waits
                # for the fork server's imports: a thread does that while this one builds.
                early = self._start_warm_up(dtype, default_model_args(), warmup_options, compile_workers)
        try:
            if model is None:
                model = default_model_dir()
            self.model = os.fspath(model)
            self.args = load_config(self.model)
        except BaseException:
            if early is not None:
                self._end_warm_up(early)
            raise
        # Importing transformers for the tokenizer costs about 0.7 s: do it while the
        # actors start, not before.
        tokenizer_loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeactors-tokenizer")
        tokenizer = tokenizer_loader.submit(load_tokenizer, self.model)
        tokenizer_loader.shutdown(wait=False)
        self._request_ids = itertools.count()
        worker_kwargs: dict[str, Any] = dict(
            model=self.model, dtype=dtype, kv_cache_bytes=int(kv_cache_bytes), block_size=int(block_size)
        )
        if kv_mirror_bytes is not None:
            worker_kwargs["kv_mirror_bytes"] = int(kv_mirror_bytes)
        # Switches that are on by default in the worker: only the ones turned off are passed.
        switches = dict(
            prepack_weights=prepack_weights,
            keep_freed_memory=keep_freed_memory,
            decode_kernel=decode_kernel,
            move_boundary_mlp=move_boundary_mlp,
            move_boundary_attention=move_boundary_attention,
            move_boundary_back=move_boundary_back,
            shm_handoff=shm_handoff,
            norm_rope_kernels=norm_rope_kernels,
            kv_write_kernel=kv_write_kernel,
            bf16_gemm_kernel=bf16_gemm_kernel,
            prompt_attention_kernel=prompt_attention_kernel,
        )
        worker_kwargs.update({name: False for name, on in switches.items() if not on})
        if num_threads is not None:
            worker_kwargs["num_threads"] = int(num_threads)
        if layer_split is not None:
            worker_kwargs["layer_split"] = tuple(layer_split)
        warmup: Optional[WarmUp] = None
        try:
            if early is not None:
                warmup = early.result()
            elif warmup_options is not None:
                kernels = self._kernel_set(dtype, self.args, **warmup_options)
                if kernels is not None:
                    warmup = warm_up(kernels, start_context("forkserver", PRELOAD), compile_workers)
        except BaseException:
            tokenizer.cancel()
            raise
        try:
            self.supervisor = Supervisor(
                worker=WORKER,
                worker_kwargs=worker_kwargs,
                tp_size=tp,
                pp_size=pp,
                max_inflight=max_inflight,
                start_timeout=start_timeout,
                policy=policy,
                fault_plan=fault_plan,
                cpus=plan.__getitem__ if plan is not None else None,
                driver_cpus=self.driver_cpus,
                backend=backend,
                ray_options=ray_options,
                preload=PRELOAD,
            )
        except BaseException:
            tokenizer.cancel()
            if warmup is not None:
                warmup.close()
            raise
        try:
            self._setup_call("init_distributed", start_timeout)
            if warmup is not None:
                warmup.wait(start_timeout)  # what is not built by then, the ranks build
            infos = self._setup_call("load_model", start_timeout)
            self.num_blocks = min(int(info["num_blocks"]) for info in infos)
            self.block_size = int(infos[0]["block_size"])
            self.dtype: str = str(infos[0]["dtype"])  # what "auto" became on the ranks
            # Decoder layers per pipeline stage, as the ranks loaded them.
            self.layer_split: tuple[int, ...] = tuple(
                info["layers"][1] - info["layers"][0] for info in infos if tuple(info["rank"])[1] == 0
            )
            capacity = self.num_blocks * self.block_size
            limit = self.args.max_position_embeddings
            if max_model_len is None:
                max_model_len = min(limit, capacity)
            elif max_model_len > limit:
                raise ValueError(f"max_model_len={max_model_len} is past the model's max_position_embeddings={limit}")
            self.max_model_len = max_model_len
            if max_num_batched_tokens is None:
                max_num_batched_tokens = default_max_num_batched_tokens(pp)
            self.scheduler = Scheduler(
                max_num_seqs,
                max_num_batched_tokens,
                self.num_blocks,
                self.block_size,
                max_model_len,
                num_groups=self.supervisor.max_inflight,
                eos_token_ids=eos_token_ids(self.model),
            )
            self.engine = Engine(self.supervisor, self.scheduler, step_timeout=step_timeout)
            self.tokenizer = tokenizer.result()
        except BaseException:
            if warmup is not None:
                warmup.close()
            self.supervisor.close()
            raise
        logger.info(
            "LLM %s: tp=%d pp=%d, %d KV blocks of %d, max_model_len %d",
            self.model,
            tp,
            pp,
            self.num_blocks,
            self.block_size,
            max_model_len,
        )

    @staticmethod
    def _kernel_set(dtype: str, args: LlamaArgs, threads: int, **builds: bool) -> Optional[KernelSet]:
        """What every CPU rank of a model with `args` will build (the last stage's argmax included); None
        where the ranks run on CUDA or the dtype is one the ranks will refuse (they say so, naming themselves)."""
        import torch

        if torch.cuda.is_available():
            return None
        try:
            resolved = resolve_dtype(dtype, args, "cpu")
        except ModelConfigError:
            return None
        return KernelSet(resolved, threads, args.head_dim, argmax=True, **builds)

    @classmethod
    def _start_warm_up(
        cls, dtype: str, args: LlamaArgs, options: dict[str, Any], parts: Optional[int]
    ) -> Optional[Future]:
        """Starts `warm_up` for a model with `args` in a thread: a future of its `WarmUp` (or of
        None), or None where the ranks will build nothing on CPU.

        Should the checkpoint's config differ from `args`, the ranks build what the warm-up did not.
        """
        kernels = cls._kernel_set(dtype, args, **options)
        if kernels is None:
            return None
        starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeactors-warmup")
        started = starter.submit(warm_up, kernels, start_context("forkserver", PRELOAD), parts)
        starter.shutdown(wait=False)
        return started

    @staticmethod
    def _end_warm_up(started: Future) -> None:
        """Stops a warm-up that `_start_warm_up` began (waiting for it to have started)."""
        try:
            warmup = started.result()
        except Exception as exc:  # noqa: BLE001 - nothing of it runs then
            logger.debug("kernel warm-up did not start: %s", exc)
            return
        if warmup is not None:
            warmup.close()

    def _setup_call(self, method: str, timeout: float) -> list[Any]:
        """Runs a setup method on every rank; setup=True: a restarted gang replays it before new batches.

        Under policy "restart" a gang that breaks here (a rank died or hung) is replaced
        and has replayed the setup calls that succeeded so far: this one is run again.
        The restart budget bounds the retries (once spent, the error is raised). A method
        that raises is not retried: a bad checkpoint fails the same way on every gang.
        """
        while True:
            try:
                return self.supervisor.collective_rpc(method, timeout=timeout, setup=True)
            except Exception as exc:
                if not getattr(exc, "retryable", False):
                    raise
                logger.warning("%s: the gang was restarted, running it again: %s", method, exc)

    # ----- generation -----

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        *,
        use_tqdm: Optional[bool] = None,
    ) -> list[RequestOutput]:
        """Generates a continuation of each prompt; outputs come back in prompt order.

        A prompt is a string (needs the model's tokenizer) or a list of token ids
        (Python or numpy integers; a 1-D tensor or array is one such list, a 2-D one a
        prompt per row); one prompt may be given on its own. Anything else raises
        TypeError before any request is queued. `params` is one SamplingParams for
        every prompt or one per prompt (default: greedy, 16 tokens).
        `use_tqdm` shows a progress bar (default: on a terminal, for 16 prompts or more).
        """
        prompt_list = self._prompt_list(prompts)
        param_list = self._param_list(params, len(prompt_list))
        requests = [
            Request(str(next(self._request_ids)), self._encode(p), sp) for p, sp in zip(prompt_list, param_list)
        ]
        if use_tqdm is None:
            use_tqdm = sys.stderr.isatty() and len(requests) >= TQDM_MIN_PROMPTS
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="generate", unit="req", dynamic_ncols=True)
        engine = self.engine
        try:
            for req in requests:
                engine.add_request(req)
            with _this_thread_on(self.driver_cpus):
                while engine.has_unfinished():
                    finished = engine.step()
                    if bar is not None and finished:
                        bar.update(len(finished))
        except BaseException:
            # Leave the engine empty and the gang idle for the next call (if the gang still lives).
            engine.abort()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self._output(req) for req in requests]

    def _prompt_list(self, prompts: Union[Prompt, Sequence[Prompt]]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        # A tensor or array is one prompt (1-D) or one per row (2-D).
        prompts = _listed(prompts, "prompts must be a string, a list of token ids, or a list of those")
        if prompts and all(is_int(t) for t in prompts):
            return [prompts]  # one prompt of token ids
        return [p if isinstance(p, str) else _listed(p, "a prompt must be a string or a list of token ids") for p in prompts]

    @staticmethod
    def _param_list(
        params: Optional[Union[SamplingParams, Sequence[SamplingParams]]], n: int
    ) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"params must be one SamplingParams or one per prompt ({n}), got {len(params)} items")
        return params

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model} has no tokenizer: give prompts as lists of token ids")
            ids = list(self.tokenizer.encode(prompt))
        else:
            # int() would turn 1.5 into token 1 and "7" into token 7: refuse instead.
            wrong = next((t for t in prompt if not is_int(t)), None)
            if wrong is not None:
                raise TypeError(f"token ids must be integers, a prompt holds {wrong!r} ({type(wrong).__name__})")
            ids = [int(t) for t in prompt]
        vocab = self.args.vocab_size
        if not ids:
            raise ValueError("a prompt has no tokens")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"a prompt has a token id outside [0, {vocab})")
        return ids

    def _output(self, req: Request) -> RequestOutput:
        tokens = req.output_token_ids
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=tokens,
            text=text,
            finish_reason=req.finish_reason,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            num_preemptions=req.num_preemptions,
        )

    # ----- lifecycle -----

    def close(self) -> None:
        """Stops the gang; idempotent."""
        self.supervisor.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
