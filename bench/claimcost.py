"""Claim cost as the table grows: one generic `dispatch_claim_v5` call (limit 1, rolled back) with
1k, 100k and 1M pending attempts, and with 1M finished attempts beside 1k pending; each
against the 1k case. The goal is flat: the candidate query must stay an index scan."""

from __future__ import annotations

import statistics
import time

from django.db import connections

from bench import common

# The worker's own claim (`dispatch/sql/queries.sql`, `claim`): no notified run, generic.
CLAIM = "SELECT * FROM dispatch_claim_v5('bench-claim', NULL, 1, true)"


def cases(quick: bool) -> dict[str, tuple[int, int]]:
    """name -> (pending, finished history)."""
    if quick:
        return {"1k": (1000, 0), "10k": (10_000, 0), "50k": (50_000, 0), "hist": (1000, 50_000)}
    return {"1k": (1000, 0), "100k": (100_000, 0), "1M": (1_000_000, 0), "hist": (1000, 1_000_000)}


def dbname(case: str) -> str:
    return f"bench_claim_{case.lower()}"


def load(server: str, case: str, pending: int, finished: int, reload: bool) -> None:
    """A scratch database per case, cloned from the migrated benchmark database (with its
    20 bindings), then filled in bulk. Kept between runs unless its counts differ."""
    name = dbname(case)
    if not reload:
        try:
            with common.connect(server, name) as conn:
                counts = dict(
                    conn.execute("SELECT status, count(*) FROM dispatch_attempt GROUP BY status")
                )
            if counts == {k: v for k, v in (("PENDING", pending), ("SUCCEEDED", finished)) if v}:
                return
        except Exception:  # noqa: BLE001 - missing or broken: rebuild it
            pass
    common.drop_database(server, name)
    common.ensure_database(server, name, template=common.DISPATCH_DB)
    with common.connect(server, name) as conn:
        step = 100_000
        for lo in range(0, finished, step):
            common.bulk_runs(conn, min(step, finished - lo), status="SUCCEEDED", offset=lo)
        for lo in range(0, pending, step):
            common.bulk_runs(conn, min(step, pending - lo), offset=finished + lo)
        conn.execute("VACUUM ANALYZE")


def sample(server: str, case: str, n: int, claim: str = CLAIM) -> float:
    """Median wall time (ms) of one claim round trip, each rolled back so every call sees
    the same table."""
    times = []
    with common.connect(server, dbname(case)) as conn:
        conn.autocommit = False
        for i in range(n + 5):
            t0 = time.perf_counter()
            rows = conn.execute(claim).fetchall()
            t1 = time.perf_counter()
            conn.rollback()
            if len(rows) != 1:
                raise RuntimeError(f"{case}: the claim returned {len(rows)} rows")
            if i >= 5:  # the first calls plan the function's statements
                times.append((t1 - t0) * 1000)
    return statistics.median(times)


def explain(server: str, case: str, claim: str = CLAIM) -> str:
    """The plans of the statements inside the claim, as executed (auto_explain with
    ANALYZE and BUFFERS, sent back to this connection as messages)."""
    notes: list[str] = []
    with common.connect(server, dbname(case)) as conn:
        conn.add_notice_handler(lambda d: notes.append(d.message_primary or ""))
        conn.autocommit = False
        for _ in range(10):  # warm: the plan shown is the one a long-lived worker runs
            conn.execute(claim).fetchall()
            conn.rollback()
        for stmt in (
            "LOAD 'auto_explain'",
            "SET auto_explain.log_min_duration = 0",
            "SET auto_explain.log_analyze = on",
            "SET auto_explain.log_buffers = on",
            "SET auto_explain.log_timing = on",
            "SET auto_explain.log_nested_statements = on",
            "SET auto_explain.log_level = notice",
        ):
            conn.execute(stmt)
        conn.execute(claim).fetchall()
        conn.rollback()
    plans = [n for n in notes if "SKIP LOCKED" in n and "ORDER BY a.available_at" in n]
    return plans[0] if plans else "\n\n".join(notes)


def main(argv: list[str]) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--samples", type=common.positive, default=200)
    p.add_argument("--reload", action="store_true", help="rebuild the scratch databases")
    args = p.parse_args(argv)
    if args.quick:
        args.samples, args.rounds = 40, 1
    report = common.Report("Claim cost as the table grows", ["claimcost", *argv], args.server)
    common.setup_django(args.server)
    with common.connect(args.server, common.DISPATCH_DB) as conn:
        common.reset_dispatch(conn)
        common.make_bindings(20, max_concurrency=8)
    connections.close_all()  # a template database must have no other connection
    plan_cases = cases(args.quick)
    for case, (pending, finished) in plan_cases.items():
        print(f"  loading {case}: {pending} pending, {finished} finished ...", flush=True)
        load(args.server, case, pending, finished, args.reload)

    results = common.alternate(
        args.rounds,
        {c: (lambda c=c: sample(args.server, c, args.samples)) for c in plan_cases},
    )
    base = results["1k"]
    rows = []
    for case, (pending, finished) in plan_cases.items():
        ratio = common.Spread([a / b for a, b in zip(results[case], base, strict=True)])
        goal = ""
        if case in ("1M", "50k"):
            goal = f"<= 1.3 {common.verdict(ratio.median <= 1.3)}"
        rows.append(
            [
                case,
                f"{pending:,}",
                f"{finished:,}",
                common.Spread(results[case]).fmt(2),
                ratio.fmt(),
                goal,
            ]
        )
    report.add(
        f"Each case is its own scratch database (`bench_claim_*`) with 20 bindings, loaded "
        f"with `INSERT ... SELECT generate_series` and `VACUUM ANALYZE`d; {args.samples} "
        "claims per case per round, each `dispatch_claim_v5('...', NULL, 1, true)` (the "
        "worker's generic claim) in a transaction "
        f"rolled back, timed as a client round trip; {args.rounds} alternated rounds."
    )
    report.add(
        common.table(["case", "pending", "finished", "median claim ms", "/ 1k case", "goal"], rows)
    )
    big = "50k" if args.quick else "1M"
    for case, label in ((big, f"{big} pending"), ("hist", "1k pending beside the history")):
        report.add(
            f"The claim's candidate query with {label}, as run inside the function "
            f"(`auto_explain`, ANALYZE, BUFFERS):\n\n```\n{explain(args.server, case)}\n```"
        )
    report.emit(doc=not args.no_doc)
    return 0
