"""Table health under a soak: continuous triggers and retention for 30 minutes or more,
with dead tuples, table sizes and the claim's cost per run sampled every minute.

Real `runworker` processes (maintenance on, retention of minutes instead of days) drain
a steady stream of no-op runs (some on a failing binding, so FAILED runs and retries
exist too) triggered by this process through `dispatch.services.trigger_many`, below the
workers' capacity. Every 10 s: live and dead tuples of dispatch_run and dispatch_attempt
(pg_stat_user_tables). Every minute: their table and index sizes, autovacuum counts, the
runs triggered, finished and pruned, the database's buffers and transactions
(pg_stat_database) and the two tables' rows and index entries read (pg_stat_user_tables,
pg_stat_user_indexes) per run finished, and the buffers of the real claim call measured
with EXPLAIN (ANALYZE, BUFFERS) inside a transaction that is rolled back. Counts, never
times: the machine is shared.

The server is an embedded PostgreSQL of the benchmark's own at its default settings
(autovacuum on, which a test server may have turned off) unless `--server` names one.
"""

from __future__ import annotations

import argparse
import math
import signal
import statistics
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg

from bench import common
from project.embedded_pg import EmbeddedPostgres
from tools.pgbouncer import free_port

DB = "dispatch_soak"
WORKER_TAG = "soak"
TABLES = ("dispatch_run", "dispatch_attempt")
TICK_SECONDS = 10.0  # the live/dead tuple samples
MINUTE = 60.0  # the cost and size samples
# One run in FAIL_EVERY is on a failing binding (two attempts: a retry, then FAILED).
FAIL_EVERY = 20
OK_BINDINGS, FAIL_BINDINGS = 10, 2
# Claims measured with EXPLAIN per minute, each kind (their median is reported).
PROBES = 5
# finished_at is stamped before the settlement commits: runs are counted in a window that
# ends this long before the sample, so a run stamped just before it is not missed.
FINISH_LAG = timedelta(seconds=5)
# The verdict: a figure is "flat" when its last window is within this factor of its
# first steady window (either way).
FLAT_BOUND = 1.25
WINDOW_MINUTES = 5
# The server's settings the report names (what decides when dead tuples are reclaimed).
SETTINGS = (
    "autovacuum",
    "autovacuum_naptime",
    "autovacuum_max_workers",
    "autovacuum_vacuum_cost_delay",
    "autovacuum_vacuum_cost_limit",
    "shared_buffers",
)


# --- samples ------------------------------------------------------------------------------
@dataclass
class Tick:
    at: float  # minutes since the triggers began
    live: dict[str, int]
    dead: dict[str, int]


@dataclass
class Probe:
    buffers: int
    claimed: int
    index_entries: int  # index entries of dispatch_run + dispatch_attempt returned
    heap_rows: int  # their heap rows fetched or scanned


@dataclass
class Minute:
    minute: int
    triggered: int
    finished: int
    pruned: int
    live_attempts: int  # PENDING + RUNNING attempts at the sample (the backlog)
    live: dict[str, int]
    dead_mean: dict[str, float]
    dead_max: dict[str, int]
    table_bytes: dict[str, int]
    index_bytes: dict[str, int]
    autovacuums: dict[str, int]  # since the start
    blocks: int
    xacts: int
    heap_rows: int
    index_entries: int
    seq_scans: dict[str, int]
    directed: list[Probe] = field(default_factory=list)
    generic: list[Probe] = field(default_factory=list)
    index_sizes: dict[str, int] = field(default_factory=dict)

    def per_run(self, value: float) -> float:
        return value / self.finished if self.finished else math.nan


@dataclass
class Counters:
    """Cumulative counters of the database and the two tables at one instant."""

    db: dict[str, int]
    tables: dict[str, dict[str, int]]
    index_read: int
    index_sizes: dict[str, int]


def read_tables(mon: psycopg.Connection[Any]) -> dict[str, dict[str, int]]:
    mon.execute("SELECT pg_stat_clear_snapshot()")
    rows = mon.execute(
        """
        SELECT relname, n_live_tup, n_dead_tup, autovacuum_count, n_tup_del, seq_scan,
               seq_tup_read + coalesce(idx_tup_fetch, 0),
               pg_table_size(relid), pg_indexes_size(relid)
          FROM pg_stat_user_tables WHERE relname = ANY (%s)
        """,
        [list(TABLES)],
    ).fetchall()
    keys = (
        "live",
        "dead",
        "autovacuums",
        "deleted",
        "seq_scans",
        "heap_rows",
        "table_bytes",
        "index_bytes",
    )
    return {r[0]: dict(zip(keys, map(int, r[1:]), strict=True)) for r in rows}


def read_counters(server: str, mon: psycopg.Connection[Any]) -> Counters:
    tables = read_tables(mon)
    indexes = mon.execute(
        "SELECT indexrelname, idx_tup_read, pg_relation_size(indexrelid)"
        " FROM pg_stat_user_indexes WHERE relname = ANY (%s)",
        [list(TABLES)],
    ).fetchall()
    return Counters(
        db=common.counters(server, DB),
        tables=tables,
        index_read=sum(int(r[1]) for r in indexes),
        index_sizes={r[0]: int(r[2]) for r in indexes},
    )


def db_now(conn: psycopg.Connection[Any]) -> datetime:
    return conn.execute("SELECT clock_timestamp()").fetchone()[0]


# --- the claim, measured --------------------------------------------------------------------
XACT_READS = """
SELECT (SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(i.indexrelid)), 0)
          FROM pg_index i
         WHERE i.indrelid IN ('dispatch_run'::regclass, 'dispatch_attempt'::regclass)),
       (SELECT coalesce(sum(seq_tup_read + coalesce(idx_tup_fetch, 0)), 0)
          FROM pg_stat_xact_user_tables WHERE relname IN ('dispatch_run', 'dispatch_attempt'))
"""


def claim_probe(conn: psycopg.Connection[Any], binding: uuid.UUID, *, generic: bool) -> Probe:
    """The worker's claim statement (`claim`, limit 1) under EXPLAIN (ANALYZE, BUFFERS),
    in a transaction that is rolled back: a run of the probe binding is triggered in it
    (uncommitted, so no worker sees it) and claimed by id (directed), or the generic claim
    takes the oldest eligible attempt (that one, or a worker's, held for milliseconds and
    then released by the rollback). The workers' rows are only ever locked SKIP LOCKED or,
    for the binding, with a 1 s lock_timeout."""
    from dispatch.core.sqlfiles import query

    run = uuid.uuid4()
    with conn.transaction(force_rollback=True):
        conn.execute("SELECT set_config('lock_timeout', '1s', true)")
        conn.execute(
            query("trigger"),
            {
                "ids": [run],
                "bindings": [binding],
                "trigger": "API",
                "requested_by": "soak-probe",
                "keys": None,
                "schedules": None,
                "slots": None,
            },
        )
        before = conn.execute(XACT_READS).fetchone()
        (raw,) = conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query("claim"),
            {
                "worker": "soak-probe",
                "run": None if generic else run,
                "limit": 1,
                "generic": generic,
            },
        ).fetchone()
        after = conn.execute(XACT_READS).fetchone()
    plan = raw[0]["Plan"]
    return Probe(
        buffers=int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"]),
        claimed=int(plan["Actual Rows"]),
        index_entries=int(after[0]) - int(before[0]),
        heap_rows=int(after[1]) - int(before[1]),
    )


def probes(conn: psycopg.Connection[Any], binding: uuid.UUID, *, generic: bool) -> list[Probe]:
    out = []
    for _ in range(PROBES):
        try:
            out.append(claim_probe(conn, binding, generic=generic))
        except psycopg.errors.LockNotAvailable:
            continue  # a worker held the binding for a second: this probe is skipped
    return out


# --- fixtures -------------------------------------------------------------------------------
def make_fixtures() -> tuple[list[Any], list[Any], Any]:
    """No-op bindings, failing bindings (two attempts, 1 s apart, then FAILED) and the
    probe's own binding."""
    from dispatch.models import Datasource, Job, JobBinding

    ok = common.make_bindings(OK_BINDINGS, max_concurrency=8, prefix="soak")
    job = Job.objects.create(
        name="soak-failing-job",
        # 0 rows read, then "fail_after 0 rows reached": a transient error.
        source_spec={"rows": 0, "fail_after": 0},
        sink_spec={},
        max_attempts=2,
        backoff_seconds=1.0,
        backoff_max_seconds=1.0,
        lease_seconds=30,
    )
    failing = []
    for i in range(FAIL_BINDINGS):
        src = Datasource.objects.create(name=f"soak-fail-gen-{i}", kind="generate", config={})
        snk = Datasource.objects.create(name=f"soak-fail-null-{i}", kind="null", config={})
        failing.append(
            JobBinding.objects.create(
                name=f"soak-fail-{i}", job=job, source=src, sink=snk, max_concurrency=8
            )
        )
    [probe] = common.make_bindings(1, max_concurrency=8, prefix="soak-probe")
    return ok, failing, probe


def pick(i: int, ok: list[Any], failing: list[Any]) -> Any:
    if i % FAIL_EVERY == FAIL_EVERY - 1:
        return failing[(i // FAIL_EVERY) % len(failing)]
    return ok[i % len(ok)]


def alive(procs: list[common.Proc]) -> None:
    for p in procs:
        if p.popen.poll() is not None:
            raise RuntimeError(f"{p.log.name} exited {p.popen.returncode}:\n" + p.output()[-3000:])


# --- the soak -------------------------------------------------------------------------------
@dataclass
class Result:
    ticks: list[Tick]
    minutes: list[Minute]
    triggered: int
    statuses: dict[str, int]
    pruned_total: int
    drained: bool


def minute_sample(
    n: int,
    server: str,
    mon: psycopg.Connection[Any],
    probe_conn: psycopg.Connection[Any],
    probe_binding: Any,
    prev: Counters,
    window: tuple[datetime, datetime],
    triggered: int,
    ticks: list[Tick],
) -> tuple[Minute, Counters]:
    # The claims first: their buffers are counted in this minute's database totals, as
    # every minute's are.
    directed = probes(probe_conn, probe_binding.pk, generic=False)
    generic = probes(probe_conn, probe_binding.pk, generic=True)
    now = read_counters(server, mon)
    (finished,) = mon.execute(
        "SELECT count(*) FROM dispatch_run WHERE finished_at >= %s AND finished_at < %s",
        [window[0] - FINISH_LAG, window[1] - FINISH_LAG],
    ).fetchone()
    (backlog,) = mon.execute(
        "SELECT count(*) FROM dispatch_attempt WHERE status IN ('PENDING', 'RUNNING')"
    ).fetchone()
    mine = [t for t in ticks if n - 1 < t.at <= n + 1e-9]
    minute = Minute(
        minute=n,
        triggered=triggered,
        finished=int(finished),
        pruned=now.tables["dispatch_run"]["deleted"] - prev.tables["dispatch_run"]["deleted"],
        live_attempts=int(backlog),
        live={t: now.tables[t]["live"] for t in TABLES},
        dead_mean={t: statistics.fmean(x.dead[t] for x in mine) if mine else 0.0 for t in TABLES},
        dead_max={t: max((x.dead[t] for x in mine), default=0) for t in TABLES},
        table_bytes={t: now.tables[t]["table_bytes"] for t in TABLES},
        index_bytes={t: now.tables[t]["index_bytes"] for t in TABLES},
        autovacuums={t: now.tables[t]["autovacuums"] for t in TABLES},
        blocks=now.db["blks"] - prev.db["blks"],
        xacts=now.db["xact"] - prev.db["xact"],
        heap_rows=sum(now.tables[t]["heap_rows"] - prev.tables[t]["heap_rows"] for t in TABLES),
        index_entries=now.index_read - prev.index_read,
        seq_scans={t: now.tables[t]["seq_scans"] - prev.tables[t]["seq_scans"] for t in TABLES},
        directed=directed,
        generic=generic,
        index_sizes=now.index_sizes,
    )
    return minute, now


def soak(args: Any, env: dict[str, str]) -> Result:
    from django.db import connection
    from django.db.models import Count

    from dispatch import services
    from dispatch.models import Run, Worker

    ok, failing, probe_binding = make_fixtures()
    procs = common.start_workers(args.workers, args.concurrency, env, burst=False, tag=WORKER_TAG)
    try:

        def listening() -> bool:
            alive(procs)
            return Worker.objects.filter(stats__listen_healthy=1).count() == args.workers

        common.wait_for(listening, timeout=120, what="the workers to listen", interval=0.5)
        with (
            common.connect(args.server, DB) as mon,
            common.connect(args.server, DB) as probe_conn,
        ):
            # The first claim in a session compiles the function: not counted.
            claim_probe(probe_conn, probe_binding.pk, generic=False)
            claim_probe(probe_conn, probe_binding.pk, generic=True)
            autovac0 = {t: v["autovacuums"] for t, v in read_tables(mon).items()}
            prev = read_counters(args.server, mon)
            prev_at = db_now(mon)
            base_deleted = prev.tables["dispatch_run"]["deleted"]
            ticks: list[Tick] = []
            minutes: list[Minute] = []
            triggered = in_minute = 0
            start = time.monotonic()
            next_tick, next_minute = start + TICK_SECONDS, start + MINUTE
            while len(minutes) < args.minutes:
                now = time.monotonic()
                # Runs owed at this instant: the rate holds on average even when a sample
                # delays a batch.
                owed = min(500, int(args.rate * (now - start)) - triggered)
                if owed > 0:
                    batch = [pick(triggered + i, ok, failing) for i in range(owed)]
                    services.trigger_many(batch, trigger="API", requested_by="soak")
                    triggered += owed
                    in_minute += owed
                if now >= next_tick:
                    alive(procs)
                    t = read_tables(mon)
                    ticks.append(
                        Tick(
                            at=(now - start) / 60,
                            live={k: t[k]["live"] for k in TABLES},
                            dead={k: t[k]["dead"] for k in TABLES},
                        )
                    )
                    next_tick += TICK_SECONDS
                if now >= next_minute:
                    at = db_now(mon)
                    minute, prev = minute_sample(
                        len(minutes) + 1,
                        args.server,
                        mon,
                        probe_conn,
                        probe_binding,
                        prev,
                        (prev_at, at),
                        in_minute,
                        ticks,
                    )
                    minute.autovacuums = {k: v - autovac0[k] for k, v in minute.autovacuums.items()}
                    minutes.append(minute)
                    prev_at, in_minute = at, 0
                    print(
                        f"  minute {minute.minute}: triggered {minute.triggered}, finished "
                        f"{minute.finished}, pruned {minute.pruned}, dead attempts max "
                        f"{minute.dead_max['dispatch_attempt']}, buffers/run "
                        f"{minute.per_run(minute.blocks):.0f}, generic claim "
                        f"{median([p.buffers for p in minute.generic]):.0f} buffers",
                        flush=True,
                    )
                    next_minute += MINUTE
                time.sleep(0.02)
            # The triggers stop; what was triggered drains.
            drained = True
            try:
                common.wait_for(
                    lambda: not Run.objects.filter(status__in=["PENDING", "RUNNING"]).exists(),
                    timeout=120,
                    what="the last runs to finish",
                    interval=0.5,
                )
            except RuntimeError:
                drained = False
            statuses = {
                row["status"]: row["n"]
                for row in Run.objects.values("status").annotate(n=Count("id"))
            }
            pruned_total = read_tables(mon)["dispatch_run"]["deleted"] - base_deleted
        connection.close()
        return Result(ticks, minutes, triggered, statuses, pruned_total, drained)
    finally:
        common.stop_procs(procs, sig=signal.SIGTERM)


# --- the report -----------------------------------------------------------------------------
def median(values: list[int] | list[float]) -> float:
    return statistics.median(values) if values else math.nan


def fmt(value: float, digits: int = 0) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.{digits}f}"


def mb(n: float) -> str:
    return f"{n / 1024 / 1024:.1f}"


def windows(args: Any, n: int) -> tuple[list[int], list[int]] | None:
    """The first steady window (after retention has begun deleting and the tables have
    had a pass to settle) and the last, in minute numbers; None if too short."""
    warm = math.ceil(args.retention_minutes + 2 * args.retention_interval / 60)
    size = min(WINDOW_MINUTES, (n - warm) // 2)
    if size < 1:
        return None
    return list(range(warm + 1, warm + 1 + size)), list(range(n - size + 1, n + 1))


def judge(first: float, last: float) -> tuple[str, str]:
    if math.isnan(first) or math.isnan(last) or first == 0:
        return "n/a", "n/a"
    ratio = last / first
    word = "flat" if 1 / FLAT_BOUND <= ratio <= FLAT_BOUND else ("GREW" if ratio > 1 else "fell")
    return f"{ratio:.2f}", word


def verdict_rows(
    result: Result, first: list[int], last: list[int]
) -> list[tuple[str, float, float]]:
    """(figure, first window, last window) for every figure the verdict looks at."""

    def ms(window: list[int]) -> list[Minute]:
        return [m for m in result.minutes if m.minute in window]

    def ticks(window: list[int]) -> list[Tick]:
        return [t for t in result.ticks if min(window) - 1 < t.at <= max(window) + 1e-9]

    def per_run(window: list[int], attr: str) -> float:
        got = ms(window)
        runs = sum(m.finished for m in got)
        return sum(getattr(m, attr) for m in got) / runs if runs else math.nan

    def probe(window: list[int], kind: str, attr: str) -> float:
        return median([getattr(p, attr) for m in ms(window) for p in getattr(m, kind)])

    rows: list[tuple[str, float, float]] = []
    for t in TABLES:
        rows.append(
            (
                f"{t} dead tuples, mean of 10 s samples",
                statistics.fmean(x.dead[t] for x in ticks(first)),
                statistics.fmean(x.dead[t] for x in ticks(last)),
            )
        )
        rows.append(
            (
                f"{t} dead tuples, max",
                max(x.dead[t] for x in ticks(first)),
                max(x.dead[t] for x in ticks(last)),
            )
        )
        rows.append(
            (
                f"{t} live tuples, mean",
                statistics.fmean(x.live[t] for x in ticks(first)),
                statistics.fmean(x.live[t] for x in ticks(last)),
            )
        )
        rows.append(
            (
                f"{t} table + indexes, MB (mean)",
                statistics.fmean((m.table_bytes[t] + m.index_bytes[t]) / 2**20 for m in ms(first)),
                statistics.fmean((m.table_bytes[t] + m.index_bytes[t]) / 2**20 for m in ms(last)),
            )
        )
    rows += [
        ("buffers per run (database)", per_run(first, "blocks"), per_run(last, "blocks")),
        ("transactions per run (database)", per_run(first, "xacts"), per_run(last, "xacts")),
        (
            "heap rows read per run (both tables)",
            per_run(first, "heap_rows"),
            per_run(last, "heap_rows"),
        ),
        (
            "index entries read per run (both tables)",
            per_run(first, "index_entries"),
            per_run(last, "index_entries"),
        ),
        (
            "claim, generic: buffers (median)",
            probe(first, "generic", "buffers"),
            probe(last, "generic", "buffers"),
        ),
        (
            "claim, generic: index entries read (median)",
            probe(first, "generic", "index_entries"),
            probe(last, "generic", "index_entries"),
        ),
        (
            "claim, directed: buffers (median)",
            probe(first, "directed", "buffers"),
            probe(last, "directed", "buffers"),
        ),
    ]
    return rows


def plot(result: Result, first: list[int] | None, last: list[int] | None) -> str:
    plt = common.pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    xs = [t.at for t in result.ticks]
    for t, color in zip(TABLES, ("tab:blue", "tab:orange"), strict=True):
        ax1.plot(xs, [x.dead[t] for x in result.ticks], color=color, label=f"{t} dead")
        ax1.plot(
            xs,
            [x.live[t] for x in result.ticks],
            color=color,
            ls="--",
            alpha=0.6,
            label=f"{t} live",
        )
    ax1.set_ylabel("tuples (pg_stat_user_tables)")
    ax1.legend(fontsize=8, ncol=2)
    mx = [m.minute for m in result.minutes]
    for t, color in zip(TABLES, ("tab:blue", "tab:orange"), strict=True):
        ax2.plot(
            mx, [m.table_bytes[t] / 2**20 for m in result.minutes], color=color, label=f"{t} table"
        )
        ax2.plot(
            mx,
            [m.index_bytes[t] / 2**20 for m in result.minutes],
            color=color,
            ls="--",
            label=f"{t} indexes",
        )
    ax2.set_ylabel("MB")
    ax2.legend(fontsize=8, ncol=2)
    ax3.plot(mx, [m.per_run(m.blocks) for m in result.minutes], label="buffers per run (database)")
    ax3.plot(
        mx,
        [median([p.buffers for p in m.generic]) for m in result.minutes],
        label="generic claim, buffers",
    )
    ax3.plot(
        mx,
        [median([p.buffers for p in m.directed]) for m in result.minutes],
        label="directed claim, buffers",
    )
    ax3.set_ylabel("buffers")
    ax3.set_xlabel("minutes since the triggers began")
    ax3.set_ylim(bottom=0)
    ax3.legend(fontsize=8)
    for ax in (ax1, ax2, ax3):
        ax.grid(True, alpha=0.3)
        for window in (first, last):
            if window:
                ax.axvspan(min(window) - 1, max(window), color="grey", alpha=0.12)
    ax1.set_title("Soak: triggers and retention running together")
    fig.tight_layout()
    path = common.plot_path("soak.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__)
    p.add_argument(
        "--server",
        default=None,
        help="PostgreSQL server URL (default: an embedded server of the benchmark's own, "
        "at PostgreSQL's default settings, autovacuum on)",
    )
    p.add_argument("--minutes", type=common.positive, default=30)
    p.add_argument("--rate", type=float, default=30.0, help="runs triggered per second")
    p.add_argument("--workers", type=common.positive, default=2)
    p.add_argument("--concurrency", type=common.positive, default=4)
    p.add_argument(
        "--retention-minutes", type=float, default=4.0, help="how long finished runs are kept"
    )
    p.add_argument(
        "--retention-interval", type=float, default=30.0, help="seconds between retention passes"
    )
    p.add_argument("--keep", action="store_true", help="keep the database afterwards")
    p.add_argument(
        "--quick", action="store_true", help="4 minutes, 1-minute retention (to check the code)"
    )
    p.add_argument("--no-doc", action="store_true", help="print only; do not append to the doc")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.retention_minutes, args.retention_interval = 4, 1.0, 10.0
    pg = None
    args.embedded = args.server is None
    if args.embedded:
        # The server's configuration is part of what is measured (autovacuum above all):
        # a server of the benchmark's own, at PostgreSQL's defaults.
        pg = EmbeddedPostgres(common.ROOT / ".data" / "bench-soak" / "pg", port=free_port())
        pg.start()
        args.server = pg.url("").rstrip("/")
    try:
        report = common.Report(
            "Table health: a soak of triggers and retention", ["soak", *argv], args.server
        )
        result = run(args)
        report_result(report, args, result)
        report.emit(doc=not args.no_doc)
    finally:
        if pg is not None:
            pg.stop()
    return 0


def run(args: Any) -> Result:
    days = str(args.retention_minutes / 1440)
    common.drop_database(args.server, DB)
    try:
        env = common.setup_django(args.server, DB)
        env.update(
            {
                "DISPATCH_MAINTENANCE": "true",
                "DISPATCH_RETENTION_SUCCEEDED_DAYS": days,
                "DISPATCH_RETENTION_FAILED_DAYS": days,
                "DISPATCH_RETENTION_CANCELLED_DAYS": days,
                "DISPATCH_RETENTION_INTERVAL": str(args.retention_interval),
                # The failing bindings fail for good on every run: no warning, no
                # auto-disable (which would leave their runs waiting, blocked).
                "DISPATCH_WARN_FAILURES": "0",
                "DISPATCH_AUTO_DISABLE_FAILURES": "0",
                "LOG_LEVEL": "WARNING",
            }
        )
        return soak(args, env)
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep:
            common.drop_database(args.server, DB)


def server_settings(server: str) -> dict[str, str]:
    with common.connect(server, "postgres") as conn:
        rows = conn.execute(
            "SELECT name, setting || coalesce(unit, '') FROM pg_settings WHERE name = ANY (%s)",
            [list(SETTINGS)],
        ).fetchall()
    return dict(rows)


def report_result(report: common.Report, args: Any, result: Result) -> None:
    n = len(result.minutes)
    conf = server_settings(args.server)
    where = (
        "an embedded PostgreSQL of the benchmark's own (a fresh `initdb`'s defaults)"
        if args.embedded
        else "the server given with `--server`"
    )
    report.add(
        f"{n} minutes of {args.rate:g} runs/s triggered by the benchmark's process "
        f"(`services.trigger_many`, every 20 ms the runs owed by then) over {OK_BINDINGS} "
        f"no-op bindings (`generate` 0 rows -> `null`) and {FAIL_BINDINGS} failing ones "
        f"(one run in {FAIL_EVERY}: `generate` with `fail_after 0`, max_attempts 2, a 1 s "
        f"backoff, so a retry and then FAILED), drained by {args.workers} `runworker` "
        f"processes with `--concurrency {args.concurrency}` and maintenance on, in a "
        f"database of its own (`{DB}`, created and migrated afresh, so the migrations' "
        f"per-table autovacuum settings of docs/operations.md apply) on {where}: "
        + ", ".join(f"`{k}` {conf.get(k, '?')}" for k in SETTINGS)
        + ". Retention: SUCCEEDED, FAILED and CANCELLED runs kept "
        f"{args.retention_minutes:g} minutes (`DISPATCH_RETENTION_*_DAYS` = "
        f"{args.retention_minutes:g}/1440), a pass every {args.retention_interval:g} s "
        "(`DISPATCH_RETENTION_INTERVAL`), default batch; warnings and auto-disable off "
        "(`DISPATCH_WARN_FAILURES=0`, `DISPATCH_AUTO_DISABLE_FAILURES=0`), so the failing "
        "bindings keep running."
    )
    if conf.get("autovacuum") != "on":
        report.add(
            "**autovacuum is off on this server**: dead tuples are reclaimed only by "
            "pruning of heap pages and index entries as statements pass them, not by "
            "vacuum, so they are expected to grow."
        )
    report.add(
        "Sampled: every 10 s, `n_live_tup` and `n_dead_tup` (pg_stat_user_tables); every "
        "minute, table size (`pg_table_size`) and index size (`pg_indexes_size`), "
        "`autovacuum_count`, the runs triggered, the runs finished (`finished_at` in the "
        "minute, 5 s behind the sample) and pruned (`n_tup_del` of dispatch_run), and the "
        "cost per run finished, counted, never timed: the deltas of the database's "
        "`blks_hit + blks_read` and `xact_commit + xact_rollback` (pg_stat_database: "
        "every session of the database, workers, triggers, retention, autovacuum, and "
        "this benchmark's sampling, a constant per minute), of the two tables' heap rows "
        "read (`seq_tup_read + idx_tup_fetch`) and index entries read (`idx_tup_read` of "
        "their indexes), over the runs finished in that minute. The claim itself: each "
        f"minute, {PROBES} directed and {PROBES} generic calls of the worker's claim "
        "statement (`dispatch_claim_v5`, limit 1) under `EXPLAIN (ANALYZE, BUFFERS)`, each in "
        "a transaction that is rolled back, after triggering a run of a probe binding in "
        "it (uncommitted, so no worker sees it): the directed call claims that run by id, "
        "the generic one the oldest eligible attempt (that run or a worker's, held for "
        "milliseconds); buffers are the call's `Shared Hit + Read Blocks`, index entries "
        "the two tables' `pg_stat_get_xact_tuples_returned` over their indexes during the "
        "call; the median of each minute's calls."
    )
    rows = []
    for m in result.minutes:
        rows.append(
            [
                m.minute,
                m.triggered,
                m.finished,
                m.pruned,
                m.live_attempts,
                m.live["dispatch_run"],
                f"{m.dead_max['dispatch_run']:,} ({m.dead_mean['dispatch_run']:,.0f})",
                m.live["dispatch_attempt"],
                f"{m.dead_max['dispatch_attempt']:,} ({m.dead_mean['dispatch_attempt']:,.0f})",
                f"{mb(m.table_bytes['dispatch_run'])} / {mb(m.index_bytes['dispatch_run'])}",
                f"{mb(m.table_bytes['dispatch_attempt'])} / {mb(m.index_bytes['dispatch_attempt'])}",
                f"{m.autovacuums['dispatch_run']} / {m.autovacuums['dispatch_attempt']}",
            ]
        )
    report.add(
        "Tables, per minute (dead: the minute's max of the 10 s samples, mean in "
        "parentheses; sizes in MB, table / indexes; autovacuums since the start, run / "
        "attempt):\n\n"
        + common.table(
            [
                "min",
                "triggered",
                "finished",
                "pruned",
                "pending + running",
                "runs live",
                "runs dead",
                "attempts live",
                "attempts dead",
                "run MB",
                "attempt MB",
                "autovacuums",
            ],
            rows,
        )
    )
    rows = []
    for m in result.minutes:
        rows.append(
            [
                m.minute,
                fmt(m.per_run(m.blocks)),
                fmt(m.per_run(m.xacts), 1),
                fmt(m.per_run(m.heap_rows), 1),
                fmt(m.per_run(m.index_entries), 1),
                f"{m.seq_scans['dispatch_run']} / {m.seq_scans['dispatch_attempt']}",
                fmt(median([p.buffers for p in m.generic])),
                fmt(median([p.index_entries for p in m.generic])),
                fmt(median([p.buffers for p in m.directed])),
                fmt(median([p.index_entries for p in m.directed])),
            ]
        )
    report.add(
        "Cost per run finished, per minute, and the claim measured:\n\n"
        + common.table(
            [
                "min",
                "buffers / run",
                "transactions / run",
                "heap rows read / run",
                "index entries read / run",
                "seq scans (run / attempt)",
                "generic claim: buffers",
                "generic claim: index entries",
                "directed claim: buffers",
                "directed claim: index entries",
            ],
            rows,
        )
    )
    span = windows(args, n)
    if span is None:
        report.add("Too short for a verdict (no two steady windows).")
    else:
        first, last = span
        vrows = []
        grew = []
        for name, a, b in verdict_rows(result, first, last):
            ratio, word = judge(a, b)
            digits = 1 if a < 100 else 0
            vrows.append([name, fmt(a, digits), fmt(b, digits), ratio, word])
            if word == "GREW":
                grew.append(name)
        report.add(
            f"Verdict: minutes {first[0]}-{first[-1]} (the first steady window: retention "
            f"has deleted for {first[0] - 1 - args.retention_minutes:g}+ minutes) against "
            f"minutes {last[0]}-{last[-1]}; *flat* means the ratio is within "
            f"{1 / FLAT_BOUND:.2f}-{FLAT_BOUND:.2f}.\n\n"
            + common.table(["figure", "first window", "last window", "last / first", ""], vrows)
        )
        report.add(
            "**Flat**: every figure within the bound."
            if not grew
            else "**Grew** beyond the bound: " + "; ".join(grew) + "."
        )
        first_sizes = next(m for m in result.minutes if m.minute == first[-1]).index_sizes
        last_sizes = result.minutes[-1].index_sizes
        report.add(
            f"Index sizes (kB) at the end of minute {first[-1]} and at the end:\n\n"
            + common.table(
                ["index", f"minute {first[-1]}", f"minute {last[-1]}", "ratio"],
                [
                    [
                        name,
                        f"{first_sizes.get(name, 0) // 1024:,}",
                        f"{size // 1024:,}",
                        f"{size / first_sizes[name]:.2f}" if first_sizes.get(name) else "n/a",
                    ]
                    for name, size in sorted(last_sizes.items())
                ],
            )
        )
    total = sum(result.statuses.values())
    report.add(
        f"In all: {result.triggered:,} runs triggered, {result.pruned_total:,} pruned, "
        f"{total:,} left ("
        + ", ".join(f"{s} {c:,}" for s, c in sorted(result.statuses.items()))
        + "); "
        + (
            "every run finished after the triggers stopped."
            if result.drained
            else "NOT every run finished within 120 s of the triggers stopping."
        )
    )
    if not args.no_doc:
        name = plot(result, *(span or (None, None)))
        report.add(f"![soak](benchmarks/{name})")
