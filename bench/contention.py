"""Contention: 8 workers x 4 slots on a 2-core machine against 20 bindings whose
datasources are shared in opposite roles (A -> B and B -> A), with live triggers on top
of a pre-enqueued backlog. Reports runs/s (against 2 x 4 workers on independent bindings,
side by side) and the deadlocks, serialization failures and claim misses it saw."""

from __future__ import annotations

import re
import signal
import threading
from typing import Any

from bench import common

ERROR_PATTERNS = {
    "deadlock": re.compile(r"deadlock detected", re.I),
    "serialization": re.compile(r"could not serialize|40001", re.I),
    "database error": re.compile(r"database error|outcome not recorded|heartbeat failed", re.I),
}


def one_round(args: Any, env: dict[str, str], *, contended: bool) -> dict[str, Any]:
    from dispatch import services

    workers, concurrency = (args.workers, args.concurrency) if contended else (2, 4)
    total = args.backlog + args.live
    tag = "contention" if contended else "contention-base"
    with common.connect(args.server, common.DISPATCH_DB) as conn:
        common.reset_dispatch(conn)
        bindings = common.make_bindings(
            20,
            max_concurrency=args.max_concurrency if contended else 8,
            opposite_roles=contended,
        )
        common.bulk_runs(conn, args.backlog)
        conn.execute("ANALYZE dispatch_run, dispatch_attempt")
        conn.execute("SELECT pg_stat_clear_snapshot()")
        (deadlocks0,) = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        procs = common.start_workers(workers, concurrency, env, burst=False, tag=tag)
        try:
            # Live triggers while the backlog drains: directed claims race 8 listeners.
            def fire() -> None:
                for i in range(args.live):
                    services.trigger(bindings[i % len(bindings)])

            t = threading.Thread(target=fire)
            common.wait_for(
                lambda: conn.execute(
                    "SELECT count(*) FROM dispatch_attempt WHERE status <> 'PENDING'"
                ).fetchone()[0],
                timeout=120,
                what="the first claim",
            )
            t.start()
            t.join()
            common.wait_for(
                lambda: conn.execute(
                    "SELECT count(*) = %s FROM dispatch_attempt WHERE status = 'SUCCEEDED'",
                    [total],
                ).fetchone()[0],
                timeout=900,
                what="every run to finish",
            )
        finally:
            common.stop_procs(procs, sig=signal.SIGTERM)
        (span,) = conn.execute(
            "SELECT EXTRACT(EPOCH FROM max(finished_at) - min(claimed_at))::float8 "
            "FROM dispatch_attempt"
        ).fetchone()
        (attempts,) = conn.execute("SELECT count(*) FROM dispatch_attempt").fetchone()
        stats: dict[str, int] = {}
        for (s,) in conn.execute("SELECT stats FROM dispatch_worker"):
            for k, v in (s or {}).items():
                stats[k] = stats.get(k, 0) + int(v)
        # Backends flush their statistics when they exit; the workers have exited.
        conn.execute("SELECT pg_stat_clear_snapshot()")
        (deadlocks1,) = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    logs = "".join(p.output() for p in procs)
    errors = {k: len(rx.findall(logs)) for k, rx in ERROR_PATTERNS.items()}
    return {
        "rate": total / span,
        "deadlocks": deadlocks1 - deadlocks0,
        "errors": errors,
        "stats": stats,
        "extra_attempts": attempts - total,  # retries: an error or a lost lease
    }


def main(argv: list[str]) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--workers", type=common.positive, default=8)
    p.add_argument("--concurrency", type=common.positive, default=4)
    p.add_argument("--backlog", type=common.positive, default=3000)
    p.add_argument("--live", type=common.positive, default=500)
    p.add_argument("--max-concurrency", type=common.positive, default=2)
    args = p.parse_args(argv)
    if args.quick:
        args.backlog, args.live, args.rounds = 300, 100, 1
    report = common.Report(
        "Contention: 8 workers x 4 slots, datasources shared in opposite roles",
        ["contention", *argv],
        args.server,
    )
    env = common.setup_django(args.server)
    results = common.alternate(
        args.rounds,
        {
            "contended": lambda: one_round(args, env, contended=True),
            "baseline": lambda: one_round(args, env, contended=False),
        },
    )
    c, b = results["contended"], results["baseline"]
    ratio = common.Spread([x["rate"] / y["rate"] for x, y in zip(c, b, strict=True)])
    deadlocks = sum(r["deadlocks"] for r in c)
    serial = sum(r["errors"]["serialization"] for r in c)
    log_deadlocks = sum(r["errors"]["deadlock"] for r in c)
    db_errors = sum(r["errors"]["database error"] for r in c)
    st = {
        k: sum(r["stats"].get(k, 0) for r in c)
        for k in (
            "directed_hits",
            "directed_misses",
            "claims_directed",
            "claims_generic",
            "notifications_without_slot",
            "lease_lost",
            "settle_failed",
        )
    }
    extra = sum(r["extra_attempts"] for r in c)
    report.add(
        f"Contended: {args.workers} `runworker` processes x `--concurrency {args.concurrency}` "
        f"on {common.machine(args.server)['cores']} cores; 20 bindings (max_concurrency "
        f"{args.max_concurrency}) over 5 `loopback` datasources (a no-op kind that can be "
        "source and sink), consecutive bindings swapped (A -> B, B -> A), so claims lock the "
        f"same datasources from opposite roles; {args.backlog} runs pre-enqueued plus "
        f"{args.live} triggered live (with NOTIFY) while they drain. Baseline: 2 x 4 workers, "
        "20 independent `generate` -> `null` bindings, the same runs. Runs/s in database "
        f"time; {args.rounds} alternated rounds."
    )
    report.add(
        common.table(
            ["", "median (min-max)"],
            [
                ["contended runs/s", common.Spread([r["rate"] for r in c]).fmt(0)],
                ["baseline runs/s", common.Spread([r["rate"] for r in b]).fmt(0)],
                ["contended / baseline", ratio.fmt()],
            ],
        )
    )
    report.add(
        common.table(
            ["over all contended rounds", "count", "must be"],
            [
                [
                    "deadlocks (`pg_stat_database.deadlocks` delta)",
                    deadlocks,
                    f"0 {common.verdict(deadlocks == 0)}",
                ],
                [
                    "deadlocks in worker logs",
                    log_deadlocks,
                    f"0 {common.verdict(log_deadlocks == 0)}",
                ],
                [
                    "serialization failures in worker logs",
                    serial,
                    f"0 {common.verdict(serial == 0)}",
                ],
                ["other database errors in worker logs", db_errors, "reported"],
                [
                    "directed claims hit / missed",
                    f"{st['directed_hits']} / {st['directed_misses']}",
                    "reported",
                ],
                [
                    "claims directed / generic",
                    f"{st['claims_directed']} / {st['claims_generic']}",
                    "reported",
                ],
                [
                    "notifications heard with no free slot",
                    st["notifications_without_slot"],
                    "reported",
                ],
                [
                    "leases lost / outcomes not recorded",
                    f"{st['lease_lost']} / {st['settle_failed']}",
                    "0",
                ],
                ["attempts beyond one per run (retries)", extra, "0"],
            ],
        )
    )
    report.add(
        "A directed miss here is expected and harmless: every worker hears every NOTIFY, one "
        "wins the run, the others fall back to generic work in the same call."
    )
    report.emit(doc=not args.no_doc)
    return 0
