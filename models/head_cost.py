"""`HeadCostMeter`: how much the LM head costs against a decoder layer, measured where both run.

The pipeline's boundary moves (models.config.boundary_move) weigh the last stage's LM head
in decoder layers. A fixed estimate is right on one machine only: the head is one large
matmul that streams its weights from memory, the layers are many small ones, and the two
scale differently with the core, its caches and its neighbours. On the AMD EPYC of
2026-12-07 the head cost about 2.0-2.5 layers per decode row where the estimate says 2.8,
so the BACK move that the estimate picks made the stage before the last the busier one.

The last stage times its layers and its head on every decode step anyway; the meter turns
those into the same unit as the estimate. The last stage returns the value with its output
and the engine sends it with the next batches, so every rank of the boundary decides moves
from one number (each rank alone would measure its own and could decide differently).
"""

from __future__ import annotations

import collections
import statistics
from typing import Optional

__all__ = ["HeadCostMeter"]


class HeadCostMeter:
    """The median, over the last `window` decode steps of at least `min_rows` rows, of the head's cost per row in layers.

    Smaller steps are left out: their time goes mostly to per-call overheads, which
    weigh a stage's many layers far more than its one head.
    """

    def __init__(self, window: int = 16, min_rows: int = 8, min_samples: int = 3) -> None:
        if window < 1 or min_samples < 1 or min_samples > window:
            raise ValueError(f"need 1 <= min_samples <= window, got window={window}, min_samples={min_samples}")
        self.min_rows = min_rows
        self.min_samples = min_samples
        self._samples: collections.deque[float] = collections.deque(maxlen=window)

    def observe(self, rows: int, layers_run: float, layers_seconds: float, head_seconds: float) -> None:
        """One decode step of `rows` rows, each sampled: `layers_run` layers' worth of work took `layers_seconds`, the head `head_seconds`."""
        if rows < self.min_rows or layers_run <= 0 or layers_seconds <= 0 or head_seconds < 0:
            return
        self._samples.append(head_seconds * layers_run / layers_seconds)

    @property
    def value(self) -> Optional[float]:
        """The measured cost, or None before `min_samples` steps were observed."""
        if len(self._samples) < self.min_samples:
            return None
        return statistics.median(self._samples)
