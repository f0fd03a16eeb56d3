"""The invariant checker: read the dispatch tables (and every PostgreSQL sink) and report
what the product promises never happens (contract sections 2, 4, 5 and 7); installed apps
add checks of their own tables (`app_checks`: scheduling's slots, section 7).

`load()` (dispatch.verify.state) reads the runs in a `Scope` and their attempts in one
pass; each `check_*` function is small, takes that state and returns the violations it
finds, so a test can build one violating state on purpose and see exactly that check
report it. The checker only reads: it never repairs, retries or settles anything.
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.apps import apps
from django.utils.module_loading import import_string
from psycopg import sql

from dispatch.connectors import postgresql
from dispatch.core.states import TERMINAL_RUN_STATUSES, BlockedReason, Origin, Reason, Status
from dispatch.models.ops import HealthState
from dispatch.verify import incremental as invariants_incremental
from dispatch.verify import receipts as invariants_receipts
from dispatch.verify import sinks as sink_access
from dispatch.verify.incremental import IncrementalSink
from dispatch.verify.state import (
    AttemptRow,
    BindingRow,
    Findings,
    RunRow,
    Scope,
    SliceRow,
    State,
    Violation,
    load,
)

__all__ = [
    "AttemptRow",
    "BindingRow",
    "Findings",
    "Report",
    "RunRow",
    "Scope",
    "State",
    "Violation",
    "app_checks",
    "check",
    "load",
    "parse_run_ids",
]

# Reasons that say the attempt's worker lost it (lease or release): such an attempt can
# never be the one that SUCCEEDED.
LOST_REASONS = frozenset(
    {Reason.LEASE_EXPIRED, Reason.SHUTDOWN_RELEASED, Reason.RELEASED_BY_OPERATOR}
)
# Attempt statuses that end with a settlement that must name its reason.
NEEDS_REASON = frozenset({Status.RETRY_SCHEDULED, Status.FAILED, Status.CANCELLED})


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    # The incremental bindings checked.
    incremental: list[IncrementalSink] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def render(self) -> str:
        lines = [
            "invariants: "
            + ("OK" if self.ok else f"{len(self.violations)} VIOLATION(S)")
            + " ("
            + ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
            + ")"
        ]
        by_check: dict[str, list[Violation]] = defaultdict(list)
        for v in self.violations:
            by_check[v.check].append(v)
        for check, found in sorted(by_check.items()):
            lines.append(f"  {check}: {len(found)}")
            lines.extend(f"    {v.subject}: {v.message}" for v in found[:50])
            if len(found) > 50:
                lines.append(f"    ... and {len(found) - 50} more")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


# --- runs -----------------------------------------------------------------------------------
def check_expected_runs_exist(state: State) -> list[Violation]:
    """Every run id the caller created is in the database (none lost)."""
    return [
        Violation("run_lost", str(run_id), "the run was created but is not in dispatch_run")
        for run_id in sorted(state.scope.run_ids - set(state.runs), key=str)
    ]


def waits_behind_auto_disable(state: State, run: RunRow) -> bool:
    """The run waits, as it should, behind a binding the product disabled itself: the
    health scan moved the binding's health row to AUTO_DISABLED with a reason and disabled
    the binding (dispatch.ops.alerts), and the run's latest attempt is PENDING and marked
    BINDING_DISABLED, so no worker claims it until an operator enables the binding."""
    binding = state.bindings.get(run.binding_id)
    attempts = state.attempts_of(run.id)
    return (
        binding is not None
        and not binding.enabled
        and binding.health_state == HealthState.AUTO_DISABLED
        and bool(binding.health_reason.strip())
        and run.status == Status.PENDING
        and bool(attempts)
        and attempts[-1].status == Status.PENDING
        and attempts[-1].blocked_reason == BlockedReason.BINDING_DISABLED
    )


def check_runs_terminal(state: State) -> list[Violation]:
    """After quiescence every run is SUCCEEDED, FAILED or CANCELLED (none stuck), except
    a run waiting behind a binding the product auto-disabled (`waits_behind_auto_disable`):
    that is the product's promise, not a stuck run."""
    found = []
    for run in state.runs.values():
        if run.status not in TERMINAL_RUN_STATUSES and not waits_behind_auto_disable(state, run):
            live = [a for a in state.attempts_of(run.id) if a.status in Status.values]
            last = live[-1] if live else None
            detail = (
                f"latest attempt {last.number} is {last.status} (worker {last.worker_id})"
                if last
                else "no attempt"
            )
            found.append(Violation("run_not_terminal", str(run.id), f"{run.status}; {detail}"))
    return found


def check_run_status_matches_latest_attempt(state: State) -> list[Violation]:
    """A run's status is its latest attempt's status, and finished_at is set exactly when
    it is terminal."""
    found = []
    for run in state.runs.values():
        attempts = state.attempts_of(run.id)
        if not attempts:
            found.append(Violation("run_status", str(run.id), "the run has no attempt"))
            continue
        latest = attempts[-1]
        # A planned sliced run's status is its slices' (check_sliced_runs), not its
        # planning attempt's.
        if latest.status != run.status and run.id not in state.plans:
            found.append(
                Violation(
                    "run_status",
                    str(run.id),
                    f"run is {run.status} but its latest attempt {latest.number} is "
                    f"{latest.status}",
                )
            )
        if (run.status in TERMINAL_RUN_STATUSES) != (run.finished_at is not None):
            found.append(
                Violation(
                    "run_status",
                    str(run.id),
                    f"run is {run.status} with finished_at={run.finished_at}",
                )
            )
    return found


# --- attempts --------------------------------------------------------------------------------
def check_one_success(state: State) -> list[Violation]:
    """At most one SUCCEEDED attempt per run."""
    found = []
    for run_id, attempts in state.attempts.items():
        won = [a.number for a in attempts if a.status == Status.SUCCEEDED]
        if len(won) > 1:
            found.append(
                Violation("duplicate_success", str(run_id), f"attempts {won} all SUCCEEDED")
            )
    return found


def check_attempt_numbers(state: State) -> list[Violation]:
    """Attempt numbers are 1, 2, ... without gaps, and attempt 1 is the TRIGGER one."""
    found = []
    for run_id, attempts in state.attempts.items():
        numbers = [a.number for a in attempts]
        if numbers != list(range(1, len(numbers) + 1)):
            found.append(
                Violation("attempt_numbers", str(run_id), f"numbers {numbers} are not 1..n")
            )
        elif attempts[0].origin != Origin.TRIGGER:
            found.append(
                Violation(
                    "attempt_numbers",
                    str(run_id),
                    f"attempt 1 has origin {attempts[0].origin}, not TRIGGER",
                )
            )
    return found


def budgets(attempts: list[AttemptRow]) -> list[list[AttemptRow]]:
    """Split a run's attempts into retry budgets (contract section 2): each starts at a
    TRIGGER or OPERATOR attempt; RELEASE successors belong to no budget."""
    out: list[list[AttemptRow]] = []
    for a in attempts:
        if a.origin in (Origin.TRIGGER, Origin.OPERATOR) or not out:
            out.append([])
        if a.origin != Origin.RELEASE:
            out[-1].append(a)
    return out


def check_retry_budget(state: State) -> list[Violation]:
    """No budget holds more attempts than the job's max_attempts."""
    found = []
    for run_id, attempts in state.attempts.items():
        binding = state.bindings.get(state.runs[run_id].binding_id)
        if binding is None:
            continue
        for budget in budgets(attempts):
            if len(budget) > binding.max_attempts:
                found.append(
                    Violation(
                        "retry_budget",
                        str(run_id),
                        f"budget starting at attempt {budget[0].number} holds {len(budget)} "
                        f"attempts, max_attempts is {binding.max_attempts}",
                    )
                )
    return found


def check_settled_reasons(state: State) -> list[Violation]:
    """Every settled attempt that did not succeed names its reason; an attempt that lost
    its lease (or was released) was never marked SUCCEEDED; a SUCCEEDED attempt carries no
    reason but ALREADY_COMMITTED."""
    found = []
    for attempts in state.attempts.values():
        for a in attempts:
            subject = f"{a.run_id} attempt {a.number}"
            planned = a.reason == Reason.SLICES_PLANNED
            if planned and (a.run_id not in state.plans or a is not attempts[-1]):
                found.append(
                    Violation(
                        "reason",
                        subject,
                        "SLICES_PLANNED but "
                        + (
                            "its run has no slice plan"
                            if a.run_id not in state.plans
                            else "it is not its run's latest attempt"
                        ),
                    )
                )
            if a.status in NEEDS_REASON and not a.reason:
                found.append(Violation("reason", subject, f"{a.status} without a reason"))
            if a.status == Status.SUCCEEDED and a.reason in LOST_REASONS:
                found.append(
                    Violation(
                        "reason", subject, f"SUCCEEDED although it lost its lease ({a.reason})"
                    )
                )
            if a.status == Status.SUCCEEDED and a.reason not in (
                None,
                Reason.ALREADY_COMMITTED,
                Reason.SLICES_PLANNED,
            ):
                found.append(Violation("reason", subject, f"SUCCEEDED with reason {a.reason}"))
            if a.status == Status.RETRY_SCHEDULED and a is attempts[-1]:
                found.append(Violation("reason", subject, "RETRY_SCHEDULED without a successor"))
    return found


def check_no_stale_finish(state: State) -> list[Violation]:
    """No attempt was settled after a later attempt of its run was created or claimed: a
    stale worker (its lease expired, a successor already running) never wrote an outcome.
    Both timestamps come from PostgreSQL's clock; the successor is created in the very
    statement that settles its predecessor, so equality is the normal case."""
    found = []
    for attempts in state.attempts.values():
        for earlier, later in zip(attempts, attempts[1:], strict=False):
            if earlier.finished_at is None:
                found.append(
                    Violation(
                        "stale_finish",
                        f"{earlier.run_id} attempt {earlier.number}",
                        f"still {earlier.status} while attempt {later.number} exists",
                    )
                )
                continue
            start = min(t for t in (later.created_at, later.claimed_at) if t is not None)
            if earlier.finished_at > start:
                lease = (
                    f" (its lease ran until {earlier.lease_until.isoformat()})"
                    if earlier.lease_until
                    else ""
                )
                found.append(
                    Violation(
                        "stale_finish",
                        f"{earlier.run_id} attempt {earlier.number}",
                        f"finished {earlier.status} at {earlier.finished_at.isoformat()}, after "
                        f"attempt {later.number} began at {start.isoformat()}{lease}",
                    )
                )
    return found


# --- slices -------------------------------------------------------------------------------
SLICE_ENDED = (Status.FAILED, Status.CANCELLED)


def _ranges_partition(slices: list[SliceRow]) -> str | None:
    """Why a plan's ranges do not split the key's values into exactly one slice each
    (None: they do): numbers 1..n, the first open below, the last open above, each
    range's upper bound the next one's lower."""
    numbers = [s.number for s in slices]
    if numbers != list(range(1, len(slices) + 1)):
        return f"slice numbers {numbers[:10]} are not 1..{len(slices)}"
    if slices[0].lower is not None:
        return f"slice 1 starts at {slices[0].lower}, not open below (rows under it: none)"
    if slices[-1].upper is not None:
        return f"slice {len(slices)} ends at {slices[-1].upper}, not open above"
    for a, b in zip(slices, slices[1:], strict=False):
        if a.upper is None or a.upper != b.lower:
            return f"slice {a.number} ends at {a.upper} but slice {b.number} starts at {b.lower}"
    return None


def check_sliced_runs(state: State) -> list[Violation]:
    """A sliced run (it has a plan): its planning attempt is its latest and SUCCEEDED
    (SLICES_PLANNED); its ranges split the key into exactly one slice per value; every
    slice run in scope names a range of the plan and each range at most one run; it is
    SUCCEEDED iff every slice committed (SUCCEEDED), FAILED only with a slice failed or
    cancelled, CANCELLED only on a cancel request; once finished no slice is queued or
    running; the plan's counters are its slices' (succeeded, failed, live, rows). A slice
    run's parent is a planned run. Each slice run obeys every run check besides."""
    found = []
    for run in state.runs.values():
        if run.parent_id is not None and run.parent_id not in state.plans:
            parent = state.runs.get(run.parent_id)
            if parent is not None:  # in scope but never planned
                found.append(
                    Violation(
                        "slices",
                        str(run.id),
                        f"slice {run.slice_number} of run {run.parent_id}, which has no plan",
                    )
                )
    for parent_id, plan in state.plans.items():
        run = state.runs[parent_id]
        subject = f"{parent_id} (sliced)"
        attempts = state.attempts_of(parent_id)
        if not attempts or (attempts[-1].status, attempts[-1].reason) != (
            Status.SUCCEEDED,
            Reason.SLICES_PLANNED,
        ):
            last = attempts[-1] if attempts else None
            found.append(
                Violation(
                    "slices",
                    subject,
                    "its latest attempt is "
                    + (f"{last.status}/{last.reason}" if last else "missing")
                    + ", not the planning attempt (SUCCEEDED, SLICES_PLANNED)",
                )
            )
        ranges = state.slices.get(parent_id, [])
        if len(ranges) != plan.total:
            found.append(
                Violation("slices", subject, f"{len(ranges)} ranges for a plan of {plan.total}")
            )
        elif ranges:
            broken = _ranges_partition(ranges)
            if broken:
                found.append(Violation("slices", subject, f"ranges: {broken}"))
        with_run = [s.number for s in ranges if s.run_id is not None]
        if with_run != list(range(1, plan.started + 1)):
            found.append(
                Violation(
                    "slices",
                    subject,
                    f"the plan has started {plan.started} slice(s) but slices "
                    f"{with_run[:10]} have a run (they start in number order)",
                )
            )
        by_number = {s.number: s for s in ranges}
        children = state.slice_runs(parent_id)
        seen: Counter[int] = Counter(r.slice_number or 0 for r in children)
        for number, n in sorted(seen.items()):
            if n > 1:
                found.append(Violation("slices", subject, f"slice {number} has {n} runs"))
        for child in children:
            rng = by_number.get(child.slice_number or 0)
            if rng is None or rng.run_id != child.id:
                found.append(
                    Violation(
                        "slices",
                        str(child.id),
                        f"slice run {child.slice_number} of {parent_id} is not its range's run"
                        f" ({rng.run_id if rng else 'no such range'})",
                    )
                )
            if child.binding_id != run.binding_id:
                found.append(Violation("slices", str(child.id), "a slice run of another binding"))
        status = Counter(r.status for r in children)
        done = status[Status.SUCCEEDED]
        ended = sum(status[s] for s in SLICE_ENDED)
        live = status[Status.PENDING] + status[Status.RUNNING]
        not_started = sum(1 for s in ranges if s.run_id is None)
        if (run.status == Status.SUCCEEDED) != (done == plan.total and plan.total > 0):
            found.append(
                Violation(
                    "slices",
                    subject,
                    f"run is {run.status} with {done} of {plan.total} slices SUCCEEDED",
                )
            )
        if run.status == Status.FAILED and ended == 0:
            found.append(
                Violation("slices", subject, "FAILED but none of its slices failed or ended")
            )
        if run.status == Status.CANCELLED and run.cancel_requested_at is None:
            found.append(Violation("slices", subject, "CANCELLED without a cancel request"))
        if run.status in TERMINAL_RUN_STATUSES and live:
            found.append(
                Violation("slices", subject, f"{run.status} with {live} slice(s) queued or running")
            )
        if run.status == Status.WAITING and live == 0 and run.cancel_requested_at is None:
            found.append(
                Violation(
                    "slices",
                    subject,
                    f"WAITING with no slice queued or running ({done} done, {ended} ended, "
                    f"{not_started} not started): nothing will settle it",
                )
            )
        if len(children) + not_started == plan.total:  # every slice run is in scope
            counted = (plan.succeeded, plan.failed, plan.live)
            if counted != (done, ended, live):
                found.append(
                    Violation(
                        "slices",
                        subject,
                        f"plan counts succeeded/failed/live {counted}, its slice runs are "
                        f"{(done, ended, live)}",
                    )
                )
            written = sum(
                a.rows_written
                for child in children
                for a in state.attempts_of(child.id)
                if a.status == Status.SUCCEEDED
            )
            if plan.rows_written != written or plan.rows_written != sum(
                s.rows_written for s in ranges
            ):
                found.append(
                    Violation(
                        "slices",
                        subject,
                        f"plan says {plan.rows_written} rows written; its ranges "
                        f"{sum(s.rows_written for s in ranges)}, its slices' SUCCEEDED "
                        f"attempts {written}",
                    )
                )
    return found


# --- PostgreSQL sinks ---------------------------------------------------------------------
@dataclass(frozen=True)
class FenceRow:
    run_id: uuid.UUID
    binding_id: uuid.UUID | None
    token: int
    attempt_id: uuid.UUID | None
    committed_at: datetime | None


@dataclass
class SinkTable:
    """One PostgreSQL sink table and what it holds, read from the sink database."""

    datasource_id: uuid.UUID
    schema: str
    table: str
    mode: str
    binding_ids: set[uuid.UUID] = field(default_factory=set)
    # run id -> its fence row, for every run of these bindings the sink has seen.
    fences: dict[uuid.UUID, FenceRow] = field(default_factory=dict)
    # Expected ids 1..rows per committed run (a generate source), or None if unknown.
    rows_per_run: int | None = None
    # multiplicity -> how many ids occur that many times; total rows; min and max id.
    multiplicity: dict[int, int] = field(default_factory=dict)
    total_rows: int = 0
    id_range: tuple[int | None, int | None] = (None, None)
    # Values compared (`check(values=True)`, a PostgreSQL table source that does not
    # change): each row's text (`row::text`) and how often it occurs, in the source and in
    # the sink.
    source_values: Counter[str] | None = None
    sink_values: Counter[str] | None = None
    error: str | None = None
    # Every binding writing here reads incrementally: `check_incremental` compares it.
    incremental: bool = False
    # Sliced runs writing here (with `values`): the source's rows of each slice, by
    # (sliced run, number), assigned from the key's value by the checker's own comparison.
    slice_values: dict[tuple[uuid.UUID, int], Counter[str]] = field(default_factory=dict)
    # A sliced `replace`: its staging table's rows by sliced run (None: no such table),
    # and the sink's record of the slices committed to it ((run, number) -> slice run).
    staging: dict[uuid.UUID, int | None] = field(default_factory=dict)
    slice_commits: dict[tuple[uuid.UUID, int], uuid.UUID] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"

    def committed_fences(self) -> int:
        return sum(1 for f in self.fences.values() if f.committed_at is not None)


def _sink_bindings(state: State) -> dict[tuple[uuid.UUID, str], list[BindingRow]]:
    grouped: dict[tuple[uuid.UUID, str], list[BindingRow]] = defaultdict(list)
    for b in state.bindings.values():
        if b.sink_kind == "postgresql" and isinstance(b.sink_spec.get("table"), str):
            grouped[(b.sink_id, b.sink_spec["table"])].append(b)
    return grouped


def _table_values(conn: Any, schema: str | None, name: str) -> Counter[str]:
    table = sql.Identifier(schema, name) if schema else sql.Identifier(name)
    return Counter(
        r[0] for r in conn.execute(sql.SQL("SELECT t::text FROM {} t").format(table)).fetchall()
    )


def _value_source(bindings: list[BindingRow]) -> tuple[uuid.UUID, str] | None:
    """The one PostgreSQL table (not a query, not an incremental read) every binding of a
    sink table reads, if there is one."""
    sources = {
        (b.source_id, b.source_spec.get("table"))
        if b.source_kind == "postgresql"
        and isinstance(b.source_spec.get("table"), str)
        and not b.source_spec.get("incremental")
        and b.source_id is not None
        else None
        for b in bindings
    }
    only = next(iter(sources)) if len(sources) == 1 else None
    return None if only is None else (only[0], str(only[1]))  # type: ignore[index]


def _sliced_runs_of(state: State, sink: SinkTable) -> list[uuid.UUID]:
    return sorted((p for p in state.plans if state.runs[p].binding_id in sink.binding_ids), key=str)


# Key types whose name may appear in the checker's SQL (an allow-list: the plan's
# key_type comes from the source's catalog, and is never pasted otherwise).
SLICE_KEY_TYPES = frozenset(
    {
        "smallint",
        "integer",
        "bigint",
        "date",
        "timestamp without time zone",
        "timestamp with time zone",
        "uuid",
    }
)


def _load_slice_values(state: State, sink: SinkTable, conn: Any, table: str) -> None:
    """For each sliced run writing to this sink: the source's rows by slice, each row
    placed by its key's value with the checker's own comparison (1 + how many of the
    slices' lower bounds, past the first, are <= the key; a NULL key: slice 1), so a
    range the engine reads twice or not at all shows in `check_sink_values`."""
    schema, name = postgresql.parse_table(table)
    relation = sql.Identifier(schema, name) if schema else sql.Identifier(name)
    for parent in _sliced_runs_of(state, sink):
        plan = state.plans[parent]
        ranges = state.slices.get(parent, [])
        if plan.key_type not in SLICE_KEY_TYPES or not ranges:
            continue
        lowers = [s.lower for s in ranges[1:]]
        query = sql.SQL(
            "SELECT t::text, CASE WHEN t.{key} IS NULL THEN 1 ELSE 1 + (SELECT count(*)"
            " FROM unnest(CAST(%s AS text[])) AS b(v) WHERE CAST(b.v AS {type}) <= t.{key})"
            " END FROM {table} t"
        ).format(key=sql.Identifier(plan.key), type=sql.SQL(plan.key_type), table=relation)
        for text, number in conn.execute(query, [lowers]):
            sink.slice_values.setdefault((parent, int(number)), Counter())[text] += 1


def _load_staging(state: State, sink: SinkTable, conn: Any) -> None:
    """A sliced `replace`: each sliced run's staging table (its rows, or None when gone)
    and the sink's record of committed slices (dispatch_slice_commit)."""
    if sink.mode != "replace":
        return
    parents = _sliced_runs_of(state, sink)
    if not parents:
        return
    from dispatch.connectors.postgresql.writer import SLICE_COMMIT_TABLE, staging_name

    for parent in parents:
        stage = sql.Identifier(sink.schema, staging_name(str(parent)))
        present = conn.execute("SELECT to_regclass(%s)", [stage.as_string(conn)]).fetchone()
        sink.staging[parent] = (
            int(conn.execute(sql.SQL("SELECT count(*) FROM {}").format(stage)).fetchone()[0])
            if present and present[0]
            else None
        )
    records = sql.Identifier(sink.schema, SLICE_COMMIT_TABLE)
    present = conn.execute("SELECT to_regclass(%s)", [records.as_string(conn)]).fetchone()
    if present and present[0]:
        for parent, number, run_id in conn.execute(
            sql.SQL(
                "SELECT parent_id, number, run_id FROM {} WHERE parent_id = ANY(%s::uuid[])"
            ).format(records),
            [parents],
        ):
            sink.slice_commits[(parent, number)] = run_id


def load_sinks(state: State, *, values: bool = False) -> list[SinkTable]:
    """Read the fence rows and the row multiplicities of every PostgreSQL sink table that
    a binding in scope writes to; with `values`, every row's text in the sink and in its
    source table (which must not change meanwhile). Sink errors become `SinkTable.error`
    (a violation)."""
    tables: list[SinkTable] = []
    for (datasource_id, spec_table), bindings in sorted(
        _sink_bindings(state).items(), key=lambda kv: (str(kv[0][0]), kv[0][1])
    ):
        schema, name = postgresql.parse_table(spec_table)
        sink = SinkTable(
            datasource_id, schema or "", name, str(bindings[0].sink_spec.get("mode", "append"))
        )
        sink.binding_ids = {b.id for b in bindings}
        sink.incremental = all(isinstance(b.source_spec.get("incremental"), dict) for b in bindings)
        sizes = {
            b.source_spec.get("rows") if b.source_kind == "generate" else None for b in bindings
        }
        sink.rows_per_run = next(iter(sizes)) if len(sizes) == 1 else None
        tables.append(sink)
        try:
            with sink_access.connect(datasource_id) as conn:
                if not sink.schema:
                    sink.schema = conn.execute("SELECT current_schema()").fetchone()[0]
                fence = sql.SQL("{}.{}").format(
                    sql.Identifier(sink.schema), sql.Identifier("dispatch_fence")
                )
                target = sql.SQL("{}.{}").format(sql.Identifier(sink.schema), sql.Identifier(name))
                exists = conn.execute(
                    "SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
                    [fence.as_string(conn), target.as_string(conn)],
                ).fetchone()
                if exists[0]:
                    for row in conn.execute(
                        sql.SQL(
                            "SELECT run_id, binding_id, token, attempt_id, committed_at"
                            " FROM {} WHERE binding_id = ANY(%s::uuid[])"
                        ).format(fence),
                        [list(sink.binding_ids)],
                    ):
                        sink.fences[row[0]] = FenceRow(*row)
                if exists[1] and sink.rows_per_run is not None:
                    # How many ids occur once, twice, ...: an exactly-once sink holds every
                    # id 1..rows as many times as runs committed, and nothing else.
                    sink.multiplicity = dict(
                        conn.execute(
                            sql.SQL(
                                "SELECT c, count(*) FROM (SELECT id, count(*) AS c FROM {}"
                                " GROUP BY id) x GROUP BY c"
                            ).format(target)
                        ).fetchall()
                    )
                    total, low, high = conn.execute(
                        sql.SQL("SELECT count(*), min(id), max(id) FROM {}").format(target)
                    ).fetchone()
                    sink.total_rows, sink.id_range = int(total), (low, high)
                source = _value_source(bindings) if values else None
                if source is not None:
                    sink.sink_values = (
                        _table_values(conn, sink.schema, name) if exists[1] else Counter()
                    )
                _load_staging(state, sink, conn)
            if source is not None:
                with sink_access.connect(source[0]) as conn:
                    sink.source_values = _table_values(conn, *postgresql.parse_table(source[1]))
                    _load_slice_values(state, sink, conn, source[1])
        except sink_access.SINK_ERRORS as exc:  # a sink we cannot read is reported
            sink.error = sink_access.error_text(exc)
    return tables


def check_sink_fences(state: State, sinks: list[SinkTable]) -> list[Violation]:
    """For every run with a PostgreSQL sink: a SUCCEEDED run's fence is committed and names
    an attempt of that run holding the fence's token, which is the SUCCEEDED attempt or an
    earlier one (then the SUCCEEDED one says ALREADY_COMMITTED); a committed fence never
    names an attempt that was not its run's."""
    found = []
    for sink in sinks:
        if sink.error:
            found.append(Violation("sink_fence", sink.name, f"sink unreadable: {sink.error}"))
            continue
        for run in state.runs.values():
            if run.binding_id not in sink.binding_ids:
                continue
            attempts = {a.id: a for a in state.attempts_of(run.id)}
            won = [a for a in attempts.values() if a.status == Status.SUCCEEDED]
            fence = sink.fences.get(run.id)
            subject = f"{run.id} ({sink.name})"
            if run.id in state.plans:
                # A sliced run writes nothing itself: its slices do, each fenced by its
                # own run (checked as any run's).
                if fence is not None:
                    found.append(
                        Violation("sink_fence", subject, "a sliced run has a fence of its own")
                    )
                continue
            if fence is None or fence.committed_at is None:
                if won:
                    found.append(
                        Violation("sink_fence", subject, "SUCCEEDED but its fence is not committed")
                    )
                continue
            holder = attempts.get(fence.attempt_id) if fence.attempt_id else None
            if holder is None:
                found.append(
                    Violation(
                        "sink_fence",
                        subject,
                        f"fence names attempt {fence.attempt_id}, which is not this run's",
                    )
                )
                continue
            if holder.lease_token != fence.token:
                found.append(
                    Violation(
                        "sink_fence",
                        subject,
                        f"fence token {fence.token} is not attempt {holder.number}'s token "
                        f"{holder.lease_token}",
                    )
                )
            if not won:
                continue
            success = won[0]
            if success.number < holder.number:
                found.append(
                    Violation(
                        "sink_fence",
                        subject,
                        f"data committed by attempt {holder.number}, after attempt "
                        f"{success.number} recorded SUCCEEDED",
                    )
                )
            elif success.number > holder.number and success.reason != Reason.ALREADY_COMMITTED:
                found.append(
                    Violation(
                        "sink_fence",
                        subject,
                        f"attempt {success.number} SUCCEEDED without ALREADY_COMMITTED but the "
                        f"data is attempt {holder.number}'s",
                    )
                )
    return found


def check_sink_rows(state: State, sinks: list[SinkTable]) -> list[Violation]:
    """Each committed run's rows are in its sink exactly once: every id 1..rows occurs as
    many times as runs committed (append) or once (replace, upsert), and no other row."""
    found = []
    for sink in sinks:
        if sink.error or sink.rows_per_run is None:
            continue
        committed = sink.committed_fences()
        times = committed if sink.mode == "append" else min(committed, 1)
        rows = sink.rows_per_run
        expected = {times: rows} if times and rows else {}
        ok = sink.multiplicity == expected and sink.total_rows == times * rows
        if ok and expected:
            ok = sink.id_range == (1, rows)
        if not ok:
            found.append(
                Violation(
                    "sink_rows",
                    sink.name,
                    f"{committed} committed run(s) of {rows} rows in {sink.mode} mode should "
                    f"leave each id 1..{rows} {times} time(s) ({times * rows} rows); found "
                    f"{sink.total_rows} rows, ids {sink.id_range}, multiplicities "
                    f"{dict(sorted(sink.multiplicity.items()))}",
                )
            )
    return found


# --- all together ---------------------------------------------------------------------------
RUN_CHECKS: tuple[Callable[[State], list[Violation]], ...] = (
    check_expected_runs_exist,
    check_runs_terminal,
    check_run_status_matches_latest_attempt,
    check_one_success,
    check_attempt_numbers,
    check_retry_budget,
    check_settled_reasons,
    check_no_stale_finish,
    check_sliced_runs,
)


def _committed(sink: SinkTable, run_id: uuid.UUID) -> bool:
    fence = sink.fences.get(run_id)
    return fence is not None and fence.committed_at is not None


def expected_values(state: State, sink: SinkTable) -> tuple[Counter[str], str]:
    """What the sink must hold, from the source's rows and the committed fences: each
    committed run's rows (append: once per committed run; replace, upsert: once), a slice
    run's being its range's rows. A sliced `replace` counts once all its slices committed
    (its slices stage their rows; the last one's commit replaces the target). Also says
    how it counted, for the message."""
    assert sink.source_values is not None
    plain = 0
    slices: list[tuple[uuid.UUID, int]] = []
    for run_id, fence in sink.fences.items():
        if fence.committed_at is None:
            continue
        run = state.runs.get(run_id)
        if run is not None and run.parent_id is not None:
            slices.append((run.parent_id, run.slice_number or 0))
        else:
            plain += 1
    if sink.mode == "append":
        expected = Counter({t: n * plain for t, n in sink.source_values.items() if plain})
        for key in slices:
            expected.update(sink.slice_values.get(key, Counter()))
        how = f"{plain} committed run(s) and {len(slices)} committed slice(s)"
        return expected, how
    complete = sum(
        1
        for parent, plan in state.plans.items()
        if state.runs[parent].binding_id in sink.binding_ids
        and sum(1 for p, _ in slices if p == parent) == plan.total
    )
    if sink.mode == "upsert" and not plain and not complete and slices:
        expected = Counter()
        for key in set(slices):
            expected |= sink.slice_values.get(key, Counter())
        return expected, f"{len(slices)} committed slice(s)"
    times = min(1, plain + complete)
    expected = Counter({t: n * times for t, n in sink.source_values.items() if times})
    return (
        expected,
        f"{plain} committed run(s), {complete} sliced run(s) with every slice committed",
    )


def check_sink_values(state: State, sinks: list[SinkTable]) -> list[Violation]:
    """Each committed run's rows arrived with every value as the source holds it: the
    sink's rows (`row::text`) are the source's, as many times as runs committed (append)
    or once (replace, upsert); a committed slice's rows are those of its range, exactly
    once each (`expected_values`). Compares values, where `check_sink_rows` counts ids."""
    found = []
    for sink in sinks:
        if sink.error or sink.source_values is None or sink.sink_values is None:
            continue
        expected, how = expected_values(state, sink)
        if sink.sink_values == expected:
            continue
        missing = expected - sink.sink_values
        extra = sink.sink_values - expected
        sample = next(iter(extra or missing))
        found.append(
            Violation(
                "sink_values",
                sink.name,
                f"{how} in {sink.mode} mode: {sum(missing.values())} "
                f"source row version(s) missing, {sum(extra.values())} row(s) too many "
                f"(e.g. {sample[:200]!r})",
            )
        )
    return found


def check_sliced_sinks(state: State, sinks: list[SinkTable]) -> list[Violation]:
    """A sliced `replace`: once its run SUCCEEDED, its staging table holds no row (the
    last slice's commit emptied it into the target; dropping it is best effort, noted);
    the sink's record of committed slices names each slice's own run, committed (a stale
    slice's commit is never recorded), and only slices of a run not yet SUCCEEDED (the
    swap's transaction removes them)."""
    found = []
    for sink in sinks:
        if sink.error:
            continue
        for parent, rows in sink.staging.items():
            run = state.runs[parent]
            if run.status == Status.SUCCEEDED and rows:
                found.append(
                    Violation(
                        "slices_sink",
                        f"{parent} ({sink.name})",
                        f"SUCCEEDED but its staging table still holds {rows} row(s)",
                    )
                )
        ranges = {(s.parent_id, s.number): s for v in state.slices.values() for s in v}
        for (parent, number), run_id in sorted(sink.slice_commits.items(), key=str):
            subject = f"{parent} slice {number} ({sink.name})"
            rng = ranges.get((parent, number))
            if rng is None or rng.run_id != run_id:
                found.append(
                    Violation(
                        "slices_sink",
                        subject,
                        f"recorded as committed by run {run_id}, not the slice's run "
                        f"{rng.run_id if rng else '(no such slice)'}",
                    )
                )
            elif not _committed(sink, run_id):
                found.append(
                    Violation(
                        "slices_sink",
                        subject,
                        f"recorded as committed but run {run_id}'s fence is not committed",
                    )
                )
    return found


def check_incremental(items: list[IncrementalSink]) -> list[Violation]:
    """Each incremental binding's cursor chain and rows (dispatch.verify.incremental):
    append holds every row version a committed snapshot held exactly once and nothing
    else; upsert equals the source at the committed cursor."""
    found = []
    for item in items:
        if item.error:
            found.append(Violation("incremental", item.subject, f"unreadable: {item.error}"))
        found.extend(Violation("incremental", item.subject, f) for f in item.findings)
    return found


def notes_for(state: State, sinks: list[SinkTable]) -> list[str]:
    """Facts worth reading that are not violations."""
    notes = []
    waiting = Counter(
        run.binding_id for run in state.runs.values() if waits_behind_auto_disable(state, run)
    )
    for binding_id, count in sorted(waiting.items(), key=lambda kv: str(kv[0])):
        binding = state.bindings[binding_id]
        notes.append(
            f"{count} run(s) wait behind binding {binding.name or binding_id}, disabled by "
            f"the health scan ({binding.health_reason})"
        )
    for sink in sinks:
        for parent, rows in sorted(sink.staging.items(), key=lambda kv: str(kv[0])):
            if rows == 0 and state.runs[parent].status == Status.SUCCEEDED:
                notes.append(
                    f"run {parent}: its empty staging table is still in {sink.schema} (its "
                    "drop after the swap gave up behind a stale slice's lock)"
                )
        if (
            sink.rows_per_run is None
            and sink.source_values is None
            and not sink.error
            and not sink.incremental
        ):
            notes.append(f"{sink.name}: rows not counted (the source is not a generate source)")
        for run in state.runs.values():
            fence = sink.fences.get(run.id)
            if (
                fence is not None
                and fence.committed_at is not None
                and run.status in (Status.FAILED, Status.CANCELLED)
            ):
                # Contract section 4/5: a worker killed between its sink commit and its
                # settlement leaves committed data; recovery settles by policy (a cancel
                # request, or no budget left). The data is there exactly once.
                notes.append(
                    f"run {run.id} is {run.status} but its data was committed to {sink.name}"
                )
    return notes


def app_checks() -> list[Callable[[State], Findings]]:
    """The checks installed apps add for their own tables, in app order: an app's
    `AppConfig.invariant_checks` names them (dotted paths of functions taking the loaded
    `State` and returning `Findings`), so that dispatch runs them without importing the
    app (scheduling's slots: `scheduling.verify.check`)."""
    found: list[Callable[[State], Findings]] = []
    for config in apps.get_app_configs():
        found.extend(import_string(path) for path in getattr(config, "invariant_checks", ()))
    return found


def check(
    scope: Scope = Scope(),  # noqa: B008 - frozen, immutable
    *,
    sinks: bool = True,
    installed_apps: bool = True,
    values: bool = False,
    history: Mapping[str, str] | None = None,
    receipts: bool = False,
) -> Report:
    """Run every check over the scope, then the installed apps' own (`app_checks`, unless
    `installed_apps` is false); the report lists violations and counts. With `values`,
    sinks fed by a PostgreSQL table are compared with it value by value (the source tables
    must not change meanwhile). `history` maps an incremental binding's source table to
    the relation holding its every version (dispatch.verify.incremental). With `receipts`,
    every delivery's receipt is recomputed on its sink (dispatch.verify.receipts) and the
    result recorded on its attempt."""
    state = load(scope)
    report = Report()
    for check_fn in RUN_CHECKS:
        report.violations.extend(check_fn(state))
    sink_tables = load_sinks(state, values=values) if sinks else []
    report.violations.extend(check_sink_fences(state, sink_tables))
    report.violations.extend(check_sink_rows(state, sink_tables))
    report.violations.extend(check_sink_values(state, sink_tables))
    report.violations.extend(check_sliced_sinks(state, sink_tables))
    incremental = invariants_incremental.load(state, history) if sinks else []
    report.violations.extend(check_incremental(incremental))
    report.notes.extend(n for item in incremental for n in item.notes)
    report.incremental = incremental
    if receipts and sinks:
        verified = invariants_receipts.verify(state)
        report.violations.extend(verified.violations)
        report.counts.update(
            receipts_verified=verified.verified,
            receipts_unverifiable=verified.unverifiable,
            receipts_superseded=verified.superseded,
        )
    for app_check in app_checks() if installed_apps else []:
        findings = app_check(state)
        report.violations.extend(findings.violations)
        report.counts.update(findings.counts)
        report.notes.extend(findings.notes)
    report.notes.extend(notes_for(state, sink_tables))
    report.counts.update(
        runs=len(state.runs),
        attempts=sum(len(a) for a in state.attempts.values()),
        sink_tables=len(sink_tables),
        incremental_bindings=len(incremental),
        **Counter(r.status.lower() for r in state.runs.values()),
    )
    waiting = sum(1 for run in state.runs.values() if waits_behind_auto_disable(state, run))
    if waiting:
        report.counts["waiting_auto_disabled"] = waiting
    return report


def parse_run_ids(lines: Iterable[str]) -> frozenset[uuid.UUID]:
    """Run ids, one a line (blank lines and # comments ignored); ValueError names a bad one."""
    ids = set()
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            ids.add(uuid.UUID(text))
        except ValueError:
            raise ValueError(f"line {number}: {text[:60]!r} is not a run id (a UUID)") from None
    return frozenset(ids)
