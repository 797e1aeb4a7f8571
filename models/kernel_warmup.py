"""Which numba kernels a CPU rank builds, and building them in parallel before the ranks start.

A rank builds its kernels in `LlamaWorker.load_model`: compiled on a machine's first
start, loaded from numba's cache (next to the modules) afterwards. Compiling is one
thread's work, holding numba's compiler lock, so a rank with the whole machine spent
13-14 s of a first start on it with the other cores idle. Ranks of a gang compiled the
same kernels side by side, each its own copy of the work.

`KernelSet` names what a rank builds; the worker builds it through `KernelSet.build`.
`warm_up` runs the same builds beforehand, split over several helper processes (one
per core by default, forked from the ranks' own fork server, which has torch, numba
and the kernel modules loaded). They only fill numba's cache: each rank then loads its
kernels from it in a few hundredths of a second apiece. A stamp file records a
successful warm-up, so that later starts skip it; it is keyed by the kernel sources'
size and modification time, which numba's cache is keyed by too.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import os
import platform
import sys
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from models.config import cpu_flags

logger = logging.getLogger(__name__)

__all__ = ["KernelSet", "WarmUp", "warm_up"]

# Seconds each build took on a first start (AMD EPYC, Zen 4, `tools/bench_compile.py`;
# the thread-pool parts with two threads): only their ratios matter, for sharing the
# builds out evenly.
_COST = {"prompt_attention": 2.2, "decode_attention": 1.9, "bf16_gemm": 1.5, "argmax": 0.8, "norm_rope": 0.8, "kv_write": 0.6}
_POOL_COST = {"bf16_gemm": 1.2, "prompt_attention": 0.7, "decode_attention": 0.4}


@dataclass(frozen=True)
class KernelSet:
    """The numba kernels a CPU rank with these settings builds (the worker's options decide each).

    `bf16_gemm` and `prompt_attention` apply to bfloat16 only, `decode_attention` and
    `norm_rope` to float32 and bfloat16; `argmax` is the last stage's. Each is built for
    `dtype` only, but the argmax for bfloat16 and float32 both (the sampler reads float32
    logits). With `threads` > 1 the thread-pool versions are built too.
    """

    dtype: torch.dtype
    threads: int
    head_dim: int
    bf16_gemm: bool = True
    decode_attention: bool = True
    prompt_attention: bool = True
    norm_rope: bool = True
    kv_write: bool = True
    argmax: bool = True

    def builds(self) -> dict[str, Callable[[], bool]]:
        """Each kernel that applies, by name: a call that builds it (or loads it from numba's cache) and says whether it can run."""
        from models import argmax, bf16_gemm, decode_attention, kv_write, norm_rope, prompt_attention

        dtype, threads = self.dtype, self.threads
        floats = dtype in (torch.float32, torch.bfloat16)
        out: dict[str, Callable[[], bool]] = {}
        if self.bf16_gemm and dtype == torch.bfloat16:
            out["bf16_gemm"] = lambda: bf16_gemm.prepare(threads)
        if self.decode_attention and floats:
            out["decode_attention"] = lambda: decode_attention.prepare(threads, dtype)
        if self.argmax:
            out["argmax"] = argmax.prepare
        if self.norm_rope and floats:
            out["norm_rope"] = lambda: norm_rope.prepare(dtype)
        if self.kv_write:
            out["kv_write"] = lambda: kv_write.prepare(dtype)
        if self.prompt_attention and dtype == torch.bfloat16 and prompt_attention.fits(self.head_dim):
            out["prompt_attention"] = lambda: prompt_attention.prepare(threads)
        return out

    def build(self, names: Optional[list[str]] = None) -> dict[str, bool]:
        """Builds the kernels (all that apply, or those of `names`); whether each can run."""
        builds = self.builds()
        return {name: bool(builds[name]()) for name in (builds if names is None else names)}

    def shares(self, parts: int) -> list[list[str]]:
        """The builds in `parts` lists of about equal compile time (longest first, each to the least loaded)."""
        names = sorted(self.builds(), key=self._cost, reverse=True)
        heap = [(0.0, i) for i in range(min(parts, len(names)))]
        out: list[list[str]] = [[] for _ in heap]
        for name in names:
            load, i = heapq.heappop(heap)
            out[i].append(name)
            heapq.heappush(heap, (load + self._cost(name), i))
        return out

    def _cost(self, name: str) -> float:
        return _COST.get(name, 1.0) + (_POOL_COST.get(name, 0.0) if self.threads > 1 else 0.0)

    def stamp(self) -> str:
        """What a warm-up of this set depends on: these settings, the kernel sources as numba's
        cache sees them (size, modification time), numba, Python and the CPU."""
        import models

        package = Path(models.__file__).resolve().parent
        files = [(p.name, s.st_size, s.st_mtime_ns) for p in sorted(package.glob("*.py")) for s in [p.stat()]]
        try:
            from importlib.metadata import version

            numba_version = version("numba")
        except Exception:  # noqa: BLE001 - no numba: the kernels cannot build anyway
            numba_version = "none"
        fields = {k: str(v) for k, v in asdict(self).items()}
        cpu = (platform.machine(), sorted(cpu_flags()))
        key = repr((fields, str(package), files, numba_version, sys.version, cpu))
        return hashlib.sha256(key.encode()).hexdigest()[:24]


def _stamp_path(kernels: KernelSet) -> Path:
    from models.default_model import cache_root

    return cache_root() / "kernels" / f"{kernels.stamp()}.done"


def _helper(kernels: KernelSet, names: list[str], lifeline: Connection) -> None:
    """A helper process: build `names` into numba's cache; exit at once if the parent goes away."""

    def watch() -> None:
        wait([lifeline])
        os._exit(1)

    threading.Thread(target=watch, name="pipeactors-warmup-watch", daemon=True).start()
    kernels.build(names)


class WarmUp:
    """Helper processes building a `KernelSet` into numba's cache; `wait()` for them, `close()` to stop them."""

    def __init__(self, kernels: KernelSet, context: Any, parts: int, stamp: Path) -> None:
        self.kernels = kernels
        self.stamp = stamp  # written once every helper has built its share
        self.shares = kernels.shares(parts)
        self._start = time.perf_counter()
        self._procs: list[Any] = []
        self._lifelines: list[Connection] = []
        try:
            for share in self.shares:
                read, write = context.Pipe(duplex=False)
                proc = context.Process(
                    target=_helper, args=(kernels, share, read), name="pipeactors-warmup", daemon=True
                )
                proc.start()
                read.close()
                self._procs.append(proc)
                self._lifelines.append(write)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits for every helper (at most `timeout` s); True when all built their share.

        Writes the stamp then. A helper that failed or ran out of time is ended; the
        ranks build what is missing themselves.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for proc in self._procs:
            proc.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        ok = all(p.exitcode == 0 for p in self._procs)
        if not ok:
            codes = [p.exitcode for p in self._procs]
            logger.warning("kernel warm-up did not finish (exit codes %s): the ranks build their kernels themselves", codes)
        else:
            logger.info("built %s in %.1fs over %d processes", self.shares, time.perf_counter() - self._start, len(self._procs))
            try:
                self.stamp.parent.mkdir(parents=True, exist_ok=True)
                self.stamp.touch()
            except OSError as exc:
                logger.info("no kernel warm-up stamp written (%s): the next start warms up again", exc)
        self.close()
        return ok

    def close(self) -> None:
        """Ends any helper still running, by pid, and reaps them all."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
        for conn in self._lifelines:
            conn.close()
        self._procs, self._lifelines = [], []


def warm_up(kernels: KernelSet, context: Any, parts: Optional[int] = None) -> Optional[WarmUp]:
    """Starts building `kernels` into numba's cache in `parts` processes (default: one per
    core this process may use) from multiprocessing `context`; None when a stamp says
    an earlier warm-up did it already, or there is nothing to build.
    """
    if parts is None:
        parts = len(os.sched_getaffinity(0))
    if parts < 1 or not kernels.builds():
        return None
    try:
        stamp = _stamp_path(kernels)
        if stamp.exists():
            return None
    except OSError:
        return None
    return WarmUp(kernels, context, parts, stamp)
