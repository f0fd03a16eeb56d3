"""Retention: delete finished runs (with their attempts, event logs and admin history)
once their status's retention has passed, in small batches that never block a claim.

Transaction contract: each batch is one short transaction that picks at most
`DISPATCH_RETENTION_BATCH` runs `FOR UPDATE OF run SKIP LOCKED` (a run somebody holds is
left for the next pass; nothing here ever waits for a claim, a settlement or an
operator), deletes their attempts, their event logs, their admin history entries and
the runs, and commits. `lock_timeout` bounds any other wait to a second. Passes are
idempotent, so any worker may run one; `maybe_prune` lets one caller through per
`DISPATCH_RETENTION_INTERVAL` (a conditional update on `dispatch_opsstate`, which saves
work and carries no correctness). Which rule protects what is in `docs/operations.md`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.apps import apps
from django.db import connection, transaction

from dispatch.core import conf
from dispatch.core.sqlfiles import ops_query
from dispatch.core.states import TERMINAL_RUN_STATUSES

log = logging.getLogger("dispatch.retention")

STATE_KEY = "retention"
DAY = 86400.0
# A pass pauses this long between batches, so a long backlog is worked off gently.
BATCH_PAUSE_SECONDS = 0.02


class DryRun(Exception):
    """Raised inside a dry run's transaction to roll it back."""


@dataclass
class PruneReport:
    runs: Counter[str] = field(default_factory=Counter)  # final status -> runs deleted
    attempts: int = 0
    events: int = 0  # the pruned attempts' event log rows
    history_entries: int = 0
    workers: int = 0
    alerts: int = 0
    bulk_operations: int = 0
    batches: int = 0
    # The newest finished_at among deleted runs: slots of schedules up to here may have
    # lost their run to retention (the invariant checker allows for it).
    pruned_through: datetime | None = None
    more: bool = False  # stopped at the batch limit with more to delete
    dry_run: bool = False

    @property
    def total_runs(self) -> int:
        return sum(self.runs.values())

    def summary(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        by_status = ", ".join(f"{s} {n}" for s, n in sorted(self.runs.items())) or "none"
        more = "; more left for the next pass" if self.more else ""
        return (
            f"{verb} {self.total_runs} run(s) ({by_status}), {self.attempts} attempt(s), "
            f"{self.history_entries} history entr(ies), {self.workers} stopped worker(s), "
            f"{self.alerts} alert(s), {self.bulk_operations} bulk operation(s) "
            f"in {self.batches} batch(es){more}"
        )


def _policy() -> list[tuple[str, float]]:
    """(status, seconds) for every final status that is pruned at all."""
    days = conf.retention_days()
    policy = []
    for status in TERMINAL_RUN_STATUSES:
        kept = days.get(status)
        if kept is not None:
            policy.append((str(status), kept * DAY))
    return policy


def _history_ids(run_ids: list[uuid.UUID], attempt_ids: list[uuid.UUID]) -> int:
    """Delete the admin history of pruned runs and attempts: an object's history goes
    with it (LogEntry keeps no foreign key, so nothing else would remove it)."""
    if not apps.is_installed("django.contrib.admin"):
        return 0
    from django.contrib.admin.models import LogEntry
    from django.contrib.contenttypes.models import ContentType

    from dispatch.models import Attempt, Run

    types = ContentType.objects.get_for_models(Run, Attempt)
    deleted = 0
    for model, ids in ((Run, run_ids), (Attempt, attempt_ids)):
        if ids:
            n, _ = LogEntry.objects.filter(
                content_type=types[model], object_id__in=[str(i) for i in ids]
            ).delete()
            deleted += n
    return deleted


def _set_local_timeouts(cursor: Any) -> None:
    # Nothing in a batch should wait: SKIP LOCKED covers the runs; these bound anything
    # else (a lock on an attempt or a history row) so a pass gives up instead of queueing.
    cursor.execute("SELECT set_config('lock_timeout', '1s', true)")
    cursor.execute("SELECT set_config('statement_timeout', '30s', true)")


def prune_batch(status: str, seconds: float, limit: int, report: PruneReport) -> int:
    """Delete one batch of `status` runs older than `seconds`; returns how many."""
    with transaction.atomic(), connection.cursor() as cursor:
        _set_local_timeouts(cursor)
        cursor.execute(
            ops_query("prune_pick_runs"), {"status": status, "seconds": seconds, "limit": limit}
        )
        picked = cursor.fetchall()
        if not picked:
            return 0
        run_ids = [row[0] for row in picked]
        newest = max(row[1] for row in picked)
        cursor.execute(ops_query("prune_delete_attempts"), {"runs": run_ids})
        attempt_ids = [row[0] for row in cursor.fetchall()]
        # The slices of sliced runs go with them (counted as their runs' attempts are).
        cursor.execute(ops_query("prune_delete_slices"), {"runs": run_ids})
        slice_runs, slice_attempts, _plan_rows = cursor.fetchone()
        attempt_ids += list(slice_attempts)
        # Their event logs (the foreign key is checked at commit).
        cursor.execute(ops_query("prune_delete_events"), {"attempts": attempt_ids})
        report.events += cursor.rowcount
        history = _history_ids(run_ids + list(slice_runs), attempt_ids)
        cursor.execute(ops_query("prune_delete_runs"), {"runs": run_ids})
        report.runs[status] += len(run_ids)
        report.attempts += len(attempt_ids)
        report.history_entries += history
        if report.pruned_through is None or newest > report.pruned_through:
            report.pruned_through = newest
        if report.dry_run:
            raise DryRun
    return len(run_ids)


def _prune_simple(name: str, seconds: float, limit: int) -> int:
    with transaction.atomic(), connection.cursor() as cursor:
        _set_local_timeouts(cursor)
        cursor.execute(ops_query(name), {"seconds": seconds, "limit": limit})
        return int(cursor.rowcount)


def prune(
    *, dry_run: bool = False, batch: int | None = None, max_batches: int | None = None
) -> PruneReport:
    """One retention pass: batches of each status until none is left or `max_batches`.

    A dry run picks and counts in the same way, inside one transaction per status that
    is rolled back (so it counts at most `batch * max_batches` runs per status)."""
    batch = batch or conf.retention_batch()
    max_batches = max_batches or conf.retention_max_batches()
    report = PruneReport(dry_run=dry_run)
    for status, seconds in _policy():
        if dry_run:
            try:
                prune_batch(status, seconds, batch * max_batches, report)
            except DryRun:
                report.batches += 1
            continue
        while True:
            if report.batches >= max_batches:
                report.more = True
                break
            n = prune_batch(status, seconds, batch, report)
            report.batches += 1
            if n < batch:
                break
            time.sleep(BATCH_PAUSE_SECONDS)
    if not dry_run:
        report.workers = _prune_simple("prune_workers", conf.worker_retention_days() * DAY, batch)
        report.alerts = _prune_simple("prune_alerts", conf.alert_retention_days() * DAY, batch)
        report.bulk_operations = _prune_simple(
            "prune_bulk_operations", conf.bulk_retention_days() * DAY, batch
        )
        _record(report)
    log.info("retention pass: %s", report.summary())
    return report


def _record(report: PruneReport) -> None:
    previous = read_state()["data"]
    total = int(previous.get("deleted_runs_total", 0)) + report.total_runs
    data: dict[str, Any] = {
        "last_deleted_runs": report.total_runs,
        "last_deleted_by_status": dict(report.runs),
        "last_deleted_attempts": report.attempts,
        "last_more": report.more,
        "deleted_runs_total": total,
    }
    through = previous.get("pruned_through")
    if report.pruned_through is not None and (
        through is None or report.pruned_through.isoformat() > through
    ):
        data["pruned_through"] = report.pruned_through.isoformat()
    with connection.cursor() as cursor:
        cursor.execute(ops_query("ops_state_ensure"), {"key": STATE_KEY})
        cursor.execute(
            ops_query("ops_state_record"),
            {"key": STATE_KEY, "data": json.dumps({**data, "last_pass_ok": True})},
        )


def begin_pass(key: str, interval: float) -> bool:
    """True for exactly one caller per `interval` seconds of database time. One
    transaction (the maintenance loop's whole cost per tick when it is not its turn)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(ops_query("ops_state_ensure"), {"key": key})
        cursor.execute(ops_query("ops_state_begin"), {"key": key, "interval": interval})
        return cursor.fetchone() is not None


def maybe_prune() -> PruneReport | None:
    """Run a pass if no worker has started one within `DISPATCH_RETENTION_INTERVAL`."""
    if not begin_pass(STATE_KEY, conf.retention_interval()):
        return None
    return prune()


def read_state() -> dict[str, Any]:
    """The retention task's recorded state: {"data": {...}, "started_at": ...}."""
    with connection.cursor() as cursor:
        cursor.execute(ops_query("ops_state_read"), {"key": STATE_KEY})
        row = cursor.fetchone()
    if row is None:
        return {"data": {}, "started_at": None}
    data = row[0] if isinstance(row[0], dict) else json.loads(row[0] or "{}")
    started = row[1]
    return {"data": data, "started_at": None if started.year < 2000 else started}


def pruned_through() -> datetime | None:
    """Runs finished up to this instant may have been deleted by retention."""
    from django.utils.dateparse import parse_datetime

    value = read_state()["data"].get("pruned_through")
    return parse_datetime(value) if value else None


def oldest_finished() -> dict[str, datetime | None]:
    """The creation time of the oldest kept run of each final status."""
    with connection.cursor() as cursor:
        cursor.execute(ops_query("prune_oldest_finished"))
        return {status: created for status, created in cursor.fetchall()}
