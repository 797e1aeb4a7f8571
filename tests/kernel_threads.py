"""A kernel run in a fresh process with a given torch thread count: did it keep the count, and use numba's pool?

numba's OpenMP pool shares torch's runtime, and once started it can set torch's thread
count to the machine's core count (a one-thread rank then ran two). Only a process with
several threads (and cores) may start it, and it must keep its count. A fresh process,
because a test process may have started the pool already.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = """
import sys
import torch

threads = int(sys.argv[1])
torch.set_num_threads(threads)
torch.set_grad_enabled(False)
{body}
import numba

pool_expected = threads > 1 and numba.config.NUMBA_NUM_THREADS > 1
print(torch.get_num_threads(), int(bool({pool_built})), int(pool_expected))
"""


def assert_pool_only_with_threads(body: str, parallel_kernel: str, call: str, threads: int) -> None:
    """Runs `body` with `threads` torch threads, then asserts that it kept that count and
    that `parallel_kernel` (the name of a module's lru-cached loader, called with `call`)
    was built and usable exactly when the process may use numba's pool: not a failed build
    cached as None, and never in a one-thread process."""
    built = f"{parallel_kernel}.cache_info().currsize and {parallel_kernel}{call} is not None"
    script = _SCRIPT.format(body=textwrap.dedent(body), pool_built=built)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(threads)], capture_output=True, text=True, timeout=150.0, check=True
    )
    torch_threads, pool_built, pool_expected = map(int, proc.stdout.split())
    assert torch_threads == threads
    assert pool_built == pool_expected, "only a process with several threads (and cores) uses numba's pool"
