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


def run_with_threads(body: str, pool_built: str, threads: int, timeout: float = 150.0) -> tuple[int, bool, bool]:
    """Runs `body` with `threads` torch threads; (torch's thread count after it, the `pool_built` expression, whether the pool should be used)."""
    script = _SCRIPT.format(body=textwrap.dedent(body), pool_built=pool_built)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(threads)], capture_output=True, text=True, timeout=timeout, check=True
    )
    torch_threads, built, expected = map(int, proc.stdout.split())
    return torch_threads, bool(built), bool(expected)
