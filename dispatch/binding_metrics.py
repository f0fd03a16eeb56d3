"""Cumulative per-binding counters for the site's metrics (docs/operations.md, "Metrics").

Run duration, queue wait and rows moved are facts of finished attempts. Counting them in
the worker would make them process counters (lost when a worker restarts, split over
processes the site cannot see); counting them in the settlement would put a hot row per
binding on the claim path. Instead the maintenance loop folds the runs finished since
its cursor into one `BindingMetrics` row per binding: a keyset over `(finished_at, id)`
on the run table's finished index, the attempts of those runs by their run index, and
the counters and the cursor written in one transaction that first locks the cursor's row.
So each finished run is counted exactly once whichever worker folds it, the counters only
grow (Prometheus counters and histograms), and a scrape reads at most one row per binding.

Like the health scan, the fold stays `DISPATCH_HEALTH_SCAN_LAG` seconds behind now: a
settlement stamps `finished_at` before its commit. A settlement whose commit came later
than that is never counted (it is not lost from the runs table, only from these counters).
"""

from __future__ import annotations

import bisect
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from dispatch import conf

KEY = "metrics"
# Runs folded per transaction, and transactions per maintenance pass.
BATCH = 2000
MAX_BATCHES = 25
# Histogram bounds, seconds (+Inf is the last bucket). Changing a tuple resets the
# buckets stored with other bounds (each histogram keeps the bounds it was counted with).
DURATION_BUCKETS: tuple[float, ...] = (
    0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600,
)  # fmt: skip
WAIT_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600,
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


@dataclass
class Counters:
    """One binding's counters, as stored in `BindingMetrics.counters`."""

    runs: dict[str, int] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    rows_read: int = 0
    rows_written: int = 0
    duration: Histogram = field(default_factory=lambda: Histogram(DURATION_BUCKETS))
    wait: Histogram = field(default_factory=lambda: Histogram(WAIT_BUCKETS))

    @classmethod
    def load(cls, data: Any) -> Counters:
        data = data if isinstance(data, dict) else {}
        return cls(
            runs={str(k): int(v) for k, v in (data.get("runs") or {}).items()},
            attempts={str(k): int(v) for k, v in (data.get("attempts") or {}).items()},
            rows_read=int(data.get("rows_read") or 0),
            rows_written=int(data.get("rows_written") or 0),
            duration=Histogram.load(data.get("duration"), DURATION_BUCKETS),
            wait=Histogram.load(data.get("wait"), WAIT_BUCKETS),
        )

    def dump(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "attempts": self.attempts,
            "rows_read": self.rows_read,
            "rows_written": self.rows_written,
            "duration": self.duration.dump(),
            "wait": self.wait.dump(),
        }

    def add_run(self, status: str) -> None:
        self.runs[status] = self.runs.get(status, 0) + 1

    def add_attempt(self, row: Sequence[Any]) -> None:
        _, status, available_at, claimed_at, finished_at, rows_read, rows_written = row
        self.attempts[status] = self.attempts.get(status, 0) + 1
        self.rows_read += int(rows_read or 0)
        self.rows_written += int(rows_written or 0)
        if claimed_at is None:
            return  # never executed (cancelled while pending): no duration, no wait
        self.wait.observe(max(0.0, (claimed_at - available_at).total_seconds()))
        if finished_at is not None:
            self.duration.observe(max(0.0, (finished_at - claimed_at).total_seconds()))


def fold(*, batch: int = BATCH, max_batches: int = MAX_BATCHES) -> int:
    """Fold the runs finished since the cursor into the counters; returns how many.
    Each batch is one transaction (the cursor row locked first, so two workers folding
    at once take turns and neither counts a run twice)."""
    total = 0
    for _ in range(max_batches):
        n = _fold_batch(batch)
        total += n
        if n < batch:
            break
    return total


def _fold_batch(limit: int) -> int:
    from dispatch.models import Attempt, JobBinding, Run
    from dispatch.ops_models import BindingMetrics, OpsState

    OpsState.objects.get_or_create(key=KEY)
    with transaction.atomic():
        state = OpsState.objects.select_for_update().get(key=KEY)
        data = state.data if isinstance(state.data, dict) else {}
        q = Q(
            finished_at__isnull=False,
            finished_at__lte=Now() - timedelta(seconds=conf.health_scan_lag()),
        )
        if data.get("after_at"):
            q &= Q(finished_at__gt=data["after_at"]) | Q(
                finished_at=data["after_at"], id__gt=data["after_id"]
            )
        runs = list(
            Run.objects.filter(q)
            .order_by("finished_at", "id")
            .values_list("id", "binding_id", "status", "finished_at")[:limit]
        )
        if not runs:
            return 0
        binding_of = {run_id: binding_id for run_id, binding_id, _, _ in runs}
        live = set(
            JobBinding.objects.filter(pk__in=set(binding_of.values())).values_list("pk", flat=True)
        )
        stored = {
            m.binding_id: m
            for m in BindingMetrics.objects.select_for_update().filter(binding_id__in=live)
        }
        counters: dict[uuid.UUID, Counters] = {
            b: Counters.load(stored[b].counters if b in stored else None) for b in live
        }
        for _, binding_id, status, _ in runs:
            if binding_id in counters:
                counters[binding_id].add_run(status)
        for row in Attempt.objects.filter(run_id__in=list(binding_of)).values_list(
            "run_id",
            "status",
            "available_at",
            "claimed_at",
            "finished_at",
            "rows_read",
            "rows_written",
        ):
            binding_id = binding_of[row[0]]
            if binding_id in counters:
                counters[binding_id].add_attempt(row)
        for binding_id, c in counters.items():
            if binding_id in stored:
                m = stored[binding_id]
                m.counters = c.dump()
                m.updated_at = Now()
                m.save(update_fields=["counters", "updated_at"])
            else:
                BindingMetrics.objects.create(binding_id=binding_id, counters=c.dump())
        last_id, _, _, last_at = runs[-1]
        assert last_at is not None  # the filter's
        state.data = {**data, "after_at": last_at.isoformat(), "after_id": str(last_id)}
        state.updated_at = Now()
        state.save(update_fields=["data", "updated_at"])
    return len(runs)
