"""What a worker counts of itself in memory, for its metrics port. The site's per-binding
counters keep their histograms in the same structure."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

# Histogram bounds of execution and run durations, seconds (+Inf is the last bucket): the
# worker's own and the site's per-binding histograms. Changing them resets the buckets
# stored with other bounds (each histogram keeps the bounds it was counted with).
DURATION_BUCKETS: tuple[float, ...] = (
    0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600,
)  # fmt: skip


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.bounds) + 1:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        # Prometheus buckets are "less than or equal": bisect_left finds the first bound
        # that is >= value.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count) pairs as Prometheus wants them, +Inf last."""
        out, running = [], 0
        for bound, n in zip([*map(_le, self.bounds), "+Inf"], self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out

    def dump(self) -> dict[str, Any]:
        return {"le": list(self.bounds), "counts": self.counts, "sum": self.total}

    @classmethod
    def load(cls, data: Any, bounds: tuple[float, ...]) -> Histogram:
        if isinstance(data, dict) and tuple(data.get("le") or ()) == bounds:
            return cls(bounds, list(data.get("counts") or []), float(data.get("sum") or 0.0))
        return cls(bounds)


def _le(bound: float) -> str:
    return repr(float(bound))


@dataclass(frozen=True)
class WorkerSnapshot:
    """What a worker's metrics port shows, read from memory at each scrape."""

    counters: dict[str, int]
    concurrency: int
    busy: int
    listen_state: str
    listen_healthy: bool
    execution_seconds: Histogram
