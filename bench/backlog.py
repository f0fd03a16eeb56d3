"""Throughput beside a backlog: warm `runworker` processes drain the same no-op runs with
nothing else in the tables, beside a long finished history, beside a large blocked backlog
(due attempts of a disabled binding, older than the measured runs) and as the oldest of a
large due backlog; each against the empty tables. The goal: each state >= 0.8 x empty.

The rate is the measured runs over database time (first claimed_at to last finished_at of
those runs only); buffers per run are the scratch database's pg_stat_database
blks_hit + blks_read delta over the drain, per run finished in it.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from django.db import connections

from bench import common

STATES = ("empty", "finished", "blocked", "due")
# Migrated afresh every run, so its SQL functions are the current files' (a migration
# installs them once: a database migrated earlier keeps the text of its day).
TEMPLATE_DB = "bench_backlog_template"
TAG = "bench-backlog"  # requested_by of the measured runs
WORKER_TAG = "backlog"
# Poll interval of the workers (DISPATCH_POLL_INTERVAL's default): an idle worker sees
# newly inserted future work within this and sets its timer to it.
POLL_SECONDS = 2.0
# The release: measured runs due 1 us apart, then (in `due`) the backlog from 1 ms after
# the last of them, 0.1 us apart (timestamps keep microseconds: ties go by id).
RUN_STEP, GAP, BACKLOG_STEP = 1e-6, 1e-3, 1e-7


@dataclass
class Sizes:
    runs: int
    finished: int
    blocked: int
    due: int


def dbname(state: str) -> str:
    return f"bench_backlog_{state}"


# --- loading ----------------------------------------------------------------------------------
def insert_runs(
    conn: psycopg.Connection[Any],
    prefix: str,
    n: int,
    *,
    status: str = "PENDING",
    tag: str = "bench",
    start: float = 0.0,
    step: float = 1e-4,
    offset: int = 0,
) -> None:
    """`n` runs with their attempt 1, round-robin over the bindings named `prefix-*`, in
    INSERT ... SELECT generate_series statements, in the caller's transaction (or its own).
    Run i's attempt is available at now() + start + i * step seconds (negative: in the
    past); `status` PENDING (the insert trigger fills binding_id and blocked_reason) or
    SUCCEEDED (a finished history)."""
    params = {
        "prefix": f"{prefix}-%",
        "lo": offset + 1,
        "hi": offset + n,
        "status": status,
        "tag": tag,
        "start": start,
        "step": step,
    }
    with conn.transaction():
        conn.execute("CREATE TEMP TABLE IF NOT EXISTS backlog_ids (i int, run uuid, binding uuid)")
        conn.execute("TRUNCATE backlog_ids")
        conn.execute(
            """
            INSERT INTO backlog_ids
            SELECT g, gen_random_uuid(), b.ids[1 + (g %% cardinality(b.ids))]
              FROM generate_series(%(lo)s::int, %(hi)s::int) g,
                   (SELECT array_agg(id ORDER BY name) AS ids FROM dispatch_jobbinding
                     WHERE name LIKE %(prefix)s) b
            """,
            params,
        )
        at = "(now() + make_interval(secs => %(start)s::float8 + i * %(step)s::float8))"
        conn.execute(
            f"""
            INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at,
                                      finished_at, requested_by)
            SELECT run, binding, 'API', %(status)s::text, least(now(), {at}),
                   CASE WHEN %(status)s::text = 'SUCCEEDED'
                        THEN {at} + interval '2 milliseconds' END,
                   %(tag)s::text
              FROM backlog_ids
            """,
            params,
        )
        conn.execute(
            f"""
            INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at,
                available_at, error, rows_read, rows_written, worker_id, claimed_at,
                heartbeat_at, finished_at)
            SELECT gen_random_uuid(), run, 1, 'TRIGGER', %(status)s::text,
                   least(now(), {at}), {at}, '', 0, 0,
                   CASE WHEN %(status)s::text = 'SUCCEEDED' THEN 'gone:1' END,
                   CASE WHEN %(status)s::text = 'SUCCEEDED'
                        THEN {at} + interval '1 millisecond' END,
                   CASE WHEN %(status)s::text = 'SUCCEEDED'
                        THEN {at} + interval '1 millisecond' END,
                   CASE WHEN %(status)s::text = 'SUCCEEDED'
                        THEN {at} + interval '2 milliseconds' END
              FROM backlog_ids
            """,
            params,
        )
        conn.execute("TRUNCATE backlog_ids")


def load(server: str, state: str, sizes: Sizes) -> tuple[float, float | None]:
    """The state's scratch database, cloned from the template (its bindings),
    with the backlog that stays across rounds. Returns the seconds it took and, for
    `blocked`, the rate of its PENDING inserts (rows/s), which sizes the release's hold."""
    t0 = time.monotonic()
    rate = None
    name = dbname(state)
    common.drop_database(server, name)
    common.ensure_database(server, name, template=TEMPLATE_DB)
    with common.connect(server, name) as conn:
        step = 100_000
        if state == "finished":
            # A day ago, 0.1 ms apart: older than anything else.
            for lo in range(0, sizes.finished, step):
                insert_runs(
                    conn,
                    "bench",
                    min(step, sizes.finished - lo),
                    status="SUCCEEDED",
                    start=-86_400.0,
                    offset=lo,
                )
        elif state == "blocked":
            # The binding is disabled already (in the template): each attempt is marked as
            # it is inserted. Two hours ago: older than the measured runs.
            t1 = time.monotonic()
            for lo in range(0, sizes.blocked, step):
                insert_runs(
                    conn, "blocked", min(step, sizes.blocked - lo), start=-7200.0, offset=lo
                )
            rate = sizes.blocked / (time.monotonic() - t1)
        conn.execute("VACUUM ANALYZE")
    return time.monotonic() - t0, rate


def reset(conn: psycopg.Connection[Any], state: str) -> None:
    """Remove what the previous round left: the measured runs (and in `due`, the backlog
    the workers went on to), the worker rows; the loaded backlog stays."""
    if state in ("empty", "due"):
        conn.execute("TRUNCATE dispatch_attempt, dispatch_run, dispatch_worker")
        return
    with conn.transaction():
        conn.execute(
            "DELETE FROM dispatch_attempt WHERE run_id IN "
            "(SELECT id FROM dispatch_run WHERE requested_by = %s)",
            [TAG],
        )
        conn.execute("DELETE FROM dispatch_run WHERE requested_by = %s", [TAG])
        conn.execute("TRUNCATE dispatch_worker")
    conn.execute("VACUUM dispatch_run, dispatch_attempt")


# --- one measurement ----------------------------------------------------------------------------
def alive(procs: list[common.Proc]) -> bool:
    """True while every worker runs; a worker that exited fails the round with its log."""
    for p in procs:
        if p.popen.poll() is not None:
            raise RuntimeError(f"{p.log.name} exited {p.popen.returncode}:\n" + p.output()[-3000:])
    return True


def blocks(conn: psycopg.Connection[Any], name: str) -> int:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT blks_hit + blks_read FROM pg_stat_database WHERE datname = %s", [name]
    ).fetchone()
    return int(row[0])


def measure(
    args: Any, env: dict[str, str], state: str, sizes: Sizes, insert_rate: float
) -> dict[str, float]:
    name = dbname(state)
    url = common.db_url(args.server, name)
    with common.connect(args.server, name) as conn:
        reset(conn, state)
    tag = f"{WORKER_TAG}-{state}"
    procs = common.start_workers(
        args.workers, args.concurrency, {**env, "DATABASE_URL": url}, burst=False, tag=tag
    )
    try:
        with common.connect(args.server, name) as mon:
            # Listening: each LISTEN connection is open and has heard its own start-up
            # probe (the first generic poll runs as it connects).
            common.wait_for(
                lambda: (
                    mon.execute(
                        "SELECT count(*) = %s FROM pg_stat_activity WHERE datname = %s "
                        "AND application_name LIKE %s",
                        [args.workers, name, f"dispatch-listen {tag}-%"],
                    ).fetchone()[0]
                    and alive(procs)
                    and all("LISTEN self-probe answered" in p.output() for p in procs)
                ),
                timeout=120,
                what="the workers to listen",
            )
            # The release: every measured run (and in `due`, the backlog behind it) inserted
            # in one transaction while the workers idle, due `hold` seconds later. Each idle
            # worker's next poll sees the earliest future available_at and sets its timer
            # to it: both wake when the runs fall due, all at once (1 us apart). The hold
            # covers the insert (twice its expected time), a poll and a margin.
            extra = sizes.due - sizes.runs if state == "due" else 0
            hold = POLL_SECONDS + 2.0 + 2 * (sizes.runs + extra) / insert_rate
            with common.connect(args.server, name) as load_conn:
                with load_conn.transaction():
                    insert_runs(load_conn, "bench", sizes.runs, tag=TAG, start=hold, step=RUN_STEP)
                    if extra:
                        # Newer than every measured run: due 1 ms after the last of them.
                        insert_runs(
                            load_conn,
                            "other",
                            extra,
                            start=hold + sizes.runs * RUN_STEP + GAP,
                            step=BACKLOG_STEP,
                        )
                    due_at = load_conn.execute(
                        "SELECT EXTRACT(EPOCH FROM now() + make_interval(secs => %s))::float8",
                        [hold],
                    ).fetchone()[0]
                load_conn.execute("ANALYZE dispatch_run, dispatch_attempt")
                left = load_conn.execute(
                    "SELECT %s - EXTRACT(EPOCH FROM clock_timestamp())::float8", [due_at]
                ).fetchone()[0]
            # Closed: the loading connection's statistics are flushed before the snapshot.
            if left < POLL_SECONDS + 0.5:
                raise RuntimeError(
                    f"{state}: the runs fall due {left:.2f}s after loading, less than a poll "
                    "interval: the workers may not be waiting on their timers"
                )
            time.sleep(max(0.0, left - 0.5))
            before = blocks(mon, name)

            def measured_left() -> bool:
                time.sleep(0.03)
                return alive(procs) and (
                    mon.execute(
                        """
                        SELECT (SELECT count(*) FROM dispatch_attempt
                                 WHERE status = 'PENDING' AND binding_id = ANY(b.ids))
                             + (SELECT count(*) FROM dispatch_attempt
                                 WHERE status = 'RUNNING' AND binding_id = ANY(b.ids))
                          FROM (SELECT array_agg(id) AS ids FROM dispatch_jobbinding
                                 WHERE name LIKE 'bench-%%') b
                        """,
                        {},
                    ).fetchone()[0]
                    == 0
                )

            common.wait_for(measured_left, timeout=600, what=f"{state}: the measured runs")
            common.stop_procs(procs, sig=signal.SIGTERM)
            # Their backends gone: every statistic of the drain is flushed.
            common.wait_for(
                lambda: mon.execute(
                    "SELECT count(*) = 0 FROM pg_stat_activity WHERE datname = %s "
                    "AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
                    [name],
                ).fetchone()[0],
                timeout=60,
                what="the workers' connections to close",
            )
            after = blocks(mon, name)
            done, span = mon.execute(
                """
                SELECT count(*) FILTER (WHERE a.status = 'SUCCEEDED'),
                       EXTRACT(EPOCH FROM max(a.finished_at) - min(a.claimed_at))::float8
                  FROM dispatch_attempt a JOIN dispatch_run r ON r.id = a.run_id
                 WHERE r.requested_by = %s
                """,
                [TAG],
            ).fetchone()
            finished_in_drain = mon.execute(
                "SELECT count(*) FROM dispatch_attempt WHERE status = 'SUCCEEDED' "
                "AND claimed_at >= to_timestamp(%s)",
                [due_at],
            ).fetchone()[0]
            early = mon.execute(
                "SELECT count(*) FROM dispatch_attempt WHERE claimed_at < to_timestamp(%s) "
                "AND worker_id LIKE %s",
                [due_at, f"{tag}-%"],
            ).fetchone()[0]
    finally:
        common.stop_procs(procs, sig=signal.SIGKILL)
    if done != sizes.runs:
        raise RuntimeError(f"{state}: {done} of {sizes.runs} measured runs succeeded")
    if early:
        raise RuntimeError(f"{state}: {early} attempts were claimed before the release")
    return {
        "rate": sizes.runs / span,
        "span": span,
        "buffers": (after - before) / max(1, finished_in_drain),
        "drained": finished_in_drain,
    }


# --- the benchmark --------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=common.positive, default=1000, help="measured runs")
    p.add_argument("--finished", type=common.positive, default=1_000_000)
    p.add_argument("--blocked", type=common.positive, default=100_000)
    p.add_argument("--due", type=common.positive, default=100_000, help="due runs in all")
    p.add_argument("--workers", type=common.positive, default=2)
    p.add_argument("--concurrency", type=common.positive, default=4)
    p.add_argument("--bindings", type=common.positive, default=20)
    p.add_argument("--max-concurrency", type=common.positive, default=8)
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.finished, args.blocked, args.due = 300, 100_000, 10_000, 10_000
        args.rounds = 1
    if args.due <= args.runs:
        p.error("--due counts the measured runs too: it must be larger than --runs")
    sizes = Sizes(args.runs, args.finished, args.blocked, args.due)
    report = common.Report(
        "Throughput beside a backlog (real workers)", ["backlog", *argv], args.server
    )
    loaded: dict[str, float] = {}
    try:
        common.drop_database(args.server, TEMPLATE_DB)
        env = common.setup_django(args.server, TEMPLATE_DB)
        with common.connect(args.server, TEMPLATE_DB) as conn:
            common.reset_dispatch(conn)
            # The same bindings in every state: the measured runs', one that is disabled
            # (the blocked backlog's) and the due backlog's.
            common.make_bindings(args.bindings, max_concurrency=args.max_concurrency)
            common.make_bindings(1, max_concurrency=args.max_concurrency, prefix="blocked")
            common.make_bindings(
                args.bindings, max_concurrency=args.max_concurrency, prefix="other"
            )
            conn.execute(
                "UPDATE dispatch_jobbinding SET enabled = false WHERE name LIKE 'blocked-%'"
            )
        connections.close_all()  # a template database must have no other connection
        insert_rate = 0.0
        for state in STATES:
            print(f"  loading {state} ...", flush=True)
            loaded[state], rate = load(args.server, state, sizes)
            insert_rate = rate or insert_rate
        print(f"  PENDING inserts: {insert_rate:,.0f} rows/s", flush=True)
        results = common.alternate(
            args.rounds,
            {s: (lambda s=s: measure(args, env, s, sizes, insert_rate)) for s in STATES},
        )
    finally:
        for name in [*map(dbname, STATES), TEMPLATE_DB]:
            common.drop_database(args.server, name)

    base = [r["rate"] for r in results["empty"]]
    what = {
        "empty": "nothing else",
        "finished": f"{sizes.finished:,} finished (SUCCEEDED) runs of the same bindings",
        "blocked": f"{sizes.blocked:,} due PENDING attempts of a disabled binding, older",
        "due": f"the oldest {sizes.runs:,} of {sizes.due:,} due runs (the rest newer, of "
        f"{args.bindings} other bindings)",
    }
    rows = []
    for state in STATES:
        rates = [r["rate"] for r in results[state]]
        ratio = common.Spread([a / b for a, b in zip(rates, base, strict=True)])
        goal = "" if state == "empty" else f">= 0.8 {common.verdict(ratio.median >= 0.8)}"
        rows.append(
            [
                state,
                what[state],
                common.Spread(rates).fmt(0),
                ratio.fmt(),
                goal,
                common.Spread([r["buffers"] for r in results[state]]).fmt(0),
            ]
        )
    clients = args.workers * args.concurrency
    spread_ms = 1000 * (sizes.runs * RUN_STEP + GAP + (sizes.due - sizes.runs) * BACKLOG_STEP)
    report.add(
        f"{sizes.runs:,} no-op runs (`generate` 0 rows -> `null`, as in the throughput "
        f"benchmark) over {args.bindings} bindings (max_concurrency {args.max_concurrency}), "
        f"drained by {args.workers} warm `runworker` processes with `--concurrency "
        f"{args.concurrency}` ({clients} slots), beside four states of the tables. Each state "
        "is its own scratch database (`bench_backlog_*`), cloned from a template migrated "
        "afresh for the run with the same bindings in all four (the measured runs' "
        f"{args.bindings}, one disabled binding, {args.bindings} others); backlogs are "
        "inserted with `INSERT ... SELECT generate_series` (the insert trigger fills "
        "binding_id and blocked_reason; the binding was disabled before its attempts were "
        "inserted). `finished` and `blocked` are loaded once per benchmark run and `VACUUM "
        "ANALYZE`d, and each round deletes the previous round's measured runs and vacuums; "
        "`empty` and `due` are emptied each round. Each round starts the workers and waits "
        "until both listen and have heard their own probe, then inserts the measured runs "
        "(in `due`, with the rest of the due backlog, newer, of the other bindings) in one "
        "transaction with available_at a few seconds ahead, 1 µs apart (`due`'s backlog "
        f"from 1 ms after the last measured run, all of it due within {spread_ms:.0f} ms), "
        "and ANALYZEs. An idle worker's poll sets its timer to the earliest available_at: "
        "both wake when the runs fall due, all at once (a round fails if any attempt was "
        "claimed earlier). Rate: the measured runs over database time, first claimed_at to last "
        "finished_at of those runs only; then the workers are stopped with SIGTERM (in "
        "`due` they have gone on to the backlog). Buffers per run: the scratch database's "
        "pg_stat_database `blks_hit + blks_read` delta from just before the runs fall due "
        "to the workers' exit (every statement of the workers and of the benchmark's "
        "completion poll), over the runs finished in that time (in `due`, some of the "
        f"backlog too). {args.rounds} alternated rounds."
    )
    report.add(
        common.table(
            [
                "state",
                "beside the measured runs",
                "runs/s",
                "/ empty",
                "goal",
                "buffers per run",
            ],
            rows,
        )
    )
    report.add(
        "Loading the scratch databases (once per benchmark run) took: "
        + ", ".join(f"{s} {loaded[s]:.0f} s" for s in STATES)
        + ". Runs finished between the snapshots in `due` (measured plus backlog): "
        + ", ".join(str(int(r["drained"])) for r in results["due"])
        + "."
    )
    report.emit(doc=not args.no_doc)
    return 0
