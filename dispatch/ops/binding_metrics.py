"""Cumulative per-binding counters for the site's metrics (docs/operations.md, "Metrics").

Run duration, queue wait and rows moved are facts of settled attempts. Counting them in
the worker would make them process counters (lost when a worker restarts, split over
processes the site cannot see); counting them in the settlement would put a hot row per
binding on the claim path. Instead the maintenance loop folds what finished since its
cursors into one `BindingMetrics` row per binding: two keysets over `(finished_at, id)`,
one over runs that reached a final status (runs by status: a run an operator retries
counts again when it finishes again) and one over settled attempts (each attempt once:
outcomes, rows, duration, wait), written with the cursors in one transaction that first
locks the cursors' row. So nothing is counted twice whichever worker folds it, the
counters only grow (Prometheus counters and histograms), and a scrape reads at most one
row per binding.

Like the health scan, the fold stays `DISPATCH_HEALTH_SCAN_LAG` seconds behind now: a
settlement stamps `finished_at` before its commit. A settlement whose commit came later
than that is never counted (it is not lost from the tables, only from these counters);
the lag's default is above the coordination timeout, which bounds a settlement.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models.functions import Now

from dispatch.core import conf
from dispatch.core.sqlfiles import ops_query
from dispatch.worker.stats import DURATION_BUCKETS, Histogram

KEY = "metrics"
# Runs (and attempts) folded per transaction.
BATCH = 2000
# Queue-wait histogram bounds, seconds (+Inf is the last bucket); durations use the
# worker's DURATION_BUCKETS. Changing a tuple resets the buckets stored with other bounds
# (each histogram keeps the bounds it was counted with).
WAIT_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600,
)  # fmt: skip


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

    def add_attempt(
        self,
        status: str,
        available_at: datetime,
        claimed_at: datetime | None,
        finished_at: datetime | None,
        rows_read: int | None,
        rows_written: int | None,
    ) -> None:
        self.attempts[status] = self.attempts.get(status, 0) + 1
        self.rows_read += int(rows_read or 0)
        self.rows_written += int(rows_written or 0)
        if claimed_at is None:
            return  # never executed (cancelled while pending): no duration, no wait
        self.wait.observe(max(0.0, (claimed_at - available_at).total_seconds()))
        if finished_at is not None:
            self.duration.observe(max(0.0, (finished_at - claimed_at).total_seconds()))


def fold(*, batch: int = BATCH, budget: float | None = None) -> int:
    """Fold what finished since the cursors into the counters; returns how many runs and
    attempts. Each batch is one transaction (the cursor's row locked first, so two
    workers folding at once take turns and neither counts anything twice); batches go on
    while they come back full, for at most `budget` seconds (default: half a health
    interval), so a busy site is caught up pass by pass."""
    budget = conf.health_interval() / 2 if budget is None else budget
    until = time.monotonic() + budget
    total = 0
    while True:
        n, full = _fold_batch(batch)
        total += n
        if not full or time.monotonic() >= until:
            return total


EPOCH = "-infinity"
NO_ID = "00000000-0000-0000-0000-000000000000"


def _fold_batch(limit: int) -> tuple[int, bool]:
    """(runs + attempts folded, whether either batch came back full)."""
    from dispatch.models import JobBinding
    from dispatch.models.ops import BindingMetrics, OpsState

    OpsState.objects.get_or_create(key=KEY)
    with transaction.atomic(), connection.cursor() as cursor:
        state = OpsState.objects.select_for_update().get(key=KEY)
        data = state.data if isinstance(state.data, dict) else {}
        lag = conf.health_scan_lag()

        def after(statement: str, prefix: str) -> list[tuple[Any, ...]]:
            """The next `limit` rows of one keyset, from the cursor stored under `prefix`."""
            cursor.execute(
                ops_query(statement),
                {
                    "after_at": data.get(f"{prefix}after_at") or EPOCH,
                    "after_id": data.get(f"{prefix}after_id") or NO_ID,
                    "lag": lag,
                    "limit": limit,
                },
            )
            return list(cursor.fetchall())

        runs = after("fold_runs", "")
        attempts = after("fold_attempts", "attempts_")
        if not runs and not attempts:
            return 0, False
        touched = {row[2] for row in runs} | {row[2] for row in attempts}
        live = set(JobBinding.objects.filter(pk__in=touched).values_list("pk", flat=True))
        stored = {
            m.binding_id: m
            for m in BindingMetrics.objects.select_for_update().filter(binding_id__in=live)
        }
        counters: dict[uuid.UUID, Counters] = {
            b: Counters.load(stored[b].counters if b in stored else None) for b in live
        }
        for _, _, binding_id, status in runs:
            if binding_id in counters:
                counters[binding_id].add_run(status)
        for _, finished_at, binding_id, status, available_at, claimed_at, read, written in attempts:
            if binding_id in counters:
                counters[binding_id].add_attempt(
                    status, available_at, claimed_at, finished_at, read, written
                )
        for binding_id, c in counters.items():
            if binding_id in stored:
                m = stored[binding_id]
                m.counters = c.dump()
                m.updated_at = Now()
                m.save(update_fields=["counters", "updated_at"])
            else:
                BindingMetrics.objects.create(binding_id=binding_id, counters=c.dump())
        if runs:
            data = {**data, "after_at": runs[-1][1].isoformat(), "after_id": str(runs[-1][0])}
        if attempts:
            data = {
                **data,
                "attempts_after_at": attempts[-1][1].isoformat(),
                "attempts_after_id": str(attempts[-1][0]),
            }
        state.data = data
        state.updated_at = Now()
        state.save(update_fields=["data", "updated_at"])
    return len(runs) + len(attempts), len(runs) == limit or len(attempts) == limit
