"""What the fork server that starts the ranks imports once (`scheduling.LLM` preloads this module).

Every rank forked from that server starts with it in memory instead of paying for it
itself: the worker with torch (about 2.5 s of CPU), and numba with the decode, argmax,
norm, rotary, KV write and bf16 GEMM kernel modules and numba's CPU target set up
(another 0.9 s, which each rank spent in its first kernel load). With four ranks on two cores that was most of the
startup. Importing this module starts no thread, so forking after it is safe: numba's
thread pool and torch's start in each rank, when first used.
"""

from __future__ import annotations

import logging

import models.worker  # noqa: F401  (torch and the whole model code)

logger = logging.getLogger(__name__)


def _warm_numba() -> None:
    try:
        import models.argmax_kernels  # noqa: F401
        import models.bf16_gemm_kernels  # noqa: F401  (compiles nothing on import: safe on any CPU)
        import models.decode_attention_kernels  # noqa: F401
        import models.kv_write_kernels  # noqa: F401
        import models.norm_rope_kernels  # noqa: F401
        import models.pool_kernels  # noqa: F401
        import models.prompt_attention_kernels  # noqa: F401  (as the GEMM kernel's module: compiles nothing on import)
        from numba.core.registry import cpu_target

        # Builds the CPU target's typing and lowering registries (about 0.4 s), which
        # every rank would otherwise do on its first kernel, even one loaded from the cache.
        cpu_target.target_context.refresh()
    except Exception as exc:  # noqa: BLE001 - only a head start: the ranks do it themselves
        logger.debug("numba not preloaded: %s", exc)


_warm_numba()
