"""Idle fleets: transactions per trigger and idle load with 1, 8 and 32 idle workers,
dispatch beside Procrastinate.

Each side runs W worker processes with one slot each at their default settings, on an
embedded PostgreSQL of this benchmark's own (max_connections 400, so 32 workers connect
directly). Per case: start the workers and wait until they are settled (dispatch: every
worker row reports its LISTEN connection confirmed; Procrastinate: every worker has
registered and heartbeated); count the server's transactions for an idle window; then
send T triggers (dispatch: `services.trigger`; Procrastinate: one `defer` each) spaced
50 ms apart, wait until all have finished, let the statistics settle, and count the
transactions, buffers and tuples read from just before the first trigger to then. Per
trigger: that count minus the idle load over the same span, over T. The server's own
counters (pg_stat_database) of the side's database, so every session is counted: workers,
their LISTEN connections, and the benchmark's triggers and reads alike.

Goal (the scale issue): with 32 idle workers a trigger costs at most twice what it costs
with one.
"""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

from bench import common
from project.embedded_pg import EmbeddedPostgres
from tools.pgbouncer import free_port

DB = "dispatch_bench_herd"
FLEETS = (1, 8, 32)
STATS_SETTLE = common.STATS_SETTLE
counters = common.counters
delta = common.delta


def measure(
    server: str,
    dbname: str,
    workers: int,
    args: Any,
    send: Any,
    done: Any,
) -> dict[str, float]:
    """The idle window and the trigger phase of one settled fleet (see the docstring)."""
    before = counters(server, dbname)
    time.sleep(args.idle)
    idle = delta(before, counters(server, dbname))
    idle_rate = {k: v / args.idle for k, v in idle.items()}
    start = counters(server, dbname)
    t0 = time.monotonic()
    for _ in range(args.triggers):
        send()
        time.sleep(0.05)
    common.wait_for(done, timeout=120, what="every trigger to finish")
    time.sleep(STATS_SETTLE)
    span = time.monotonic() - t0
    phase = delta(start, counters(server, dbname))
    per = {k: (phase[k] - idle_rate[k] * span) / args.triggers for k in phase}
    return {
        "idle_tx_per_worker_s": idle_rate["xact"] / workers,
        "tx_per_trigger": per["xact"],
        "blks_per_trigger": per["blks"],
        "tup_per_trigger": per["tup"],
    }


def dispatch_case(server: str, env: dict[str, str], workers: int, args: Any) -> dict[str, float]:
    from dispatch import services
    from dispatch.models import Run, Worker

    with common.connect(server, DB) as conn:
        common.reset_dispatch(conn)
    [binding] = common.make_bindings(1, max_concurrency=workers)
    procs = common.start_workers(workers, 1, env, burst=False, tag=f"herd-dispatch-{workers}")
    try:
        common.wait_for(
            lambda: Worker.objects.filter(stats__listen_healthy=1).count() == workers,
            timeout=120,
            what=f"{workers} dispatch workers listening",
        )
        time.sleep(STATS_SETTLE)  # start-up's transactions published before counting
        return measure(
            server,
            DB,
            workers,
            args,
            lambda: services.trigger(binding, requested_by="bench"),
            lambda: Run.objects.filter(status="SUCCEEDED").count() >= args.triggers,
        )
    finally:
        common.stop_procs(procs, sig=signal.SIGTERM)


def peer_case(server: str, workers: int, args: Any) -> dict[str, float]:
    common.reset_peer(server)
    procs = common.start_peer_workers(server, workers, 1, wait=True, tag=f"herd-peer-{workers}")
    app = common.peer_app(common.db_url(server, common.PEER_DB))
    try:
        with common.connect(server, common.PEER_DB) as conn:

            def finished() -> bool:
                (n,) = conn.execute(
                    "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
                ).fetchone()
                return int(n) >= args.triggers

            def registered() -> bool:
                (n,) = conn.execute("SELECT count(*) FROM procrastinate_workers").fetchone()
                return int(n) == workers

            common.wait_for(registered, timeout=120, what=f"{workers} Procrastinate workers")
            time.sleep(STATS_SETTLE)
            with app.open():
                task = app.tasks["noop"]
                return measure(
                    server, common.PEER_DB, workers, args, lambda: task.defer(), finished
                )
    finally:
        common.stop_procs(procs, sig=signal.SIGTERM)


def main(argv: list[str]) -> int:
    p = common.parser(__doc__ or "")
    p.add_argument("--triggers", type=common.positive, default=100)
    p.add_argument("--idle", type=float, default=30.0, help="seconds of the idle window")
    p.add_argument(
        "--fleets", default=",".join(map(str, FLEETS)), help="worker counts, comma-separated"
    )
    args = p.parse_args(argv)
    fleets = [int(x) for x in args.fleets.split(",")]
    if args.quick:
        args.triggers, args.idle, args.rounds = 30, 15.0, 1
    data = common.ROOT / ".data" / "bench-herd"
    pg = EmbeddedPostgres(data / "pg", port=free_port(), max_connections=400)
    pg.start()
    try:
        server = pg.url("").rstrip("/")
        pg.create_database(DB)
        env = common.setup_django(server, DB)
        common.ensure_peer_schema(server)
        report = common.Report(
            "Idle fleets: transactions per trigger and idle load", ["herd", *argv], server
        )
        cases: dict[str, Any] = {}
        for w in fleets:
            cases[f"dispatch-{w}"] = lambda w=w: dispatch_case(server, env, w, args)
            cases[f"peer-{w}"] = lambda w=w: peer_case(server, w, args)
        results = common.alternate(args.rounds, cases)
        print(results, flush=True)

        def cell(name: str, key: str, digits: int = 2) -> str:
            return common.Spread([r[key] for r in results[name]]).fmt(digits)

        rows = []
        for w in fleets:
            for side, label in (("dispatch", "dispatch"), ("peer", "Procrastinate")):
                name = f"{side}-{w}"
                rows.append(
                    [
                        label,
                        w,
                        cell(name, "tx_per_trigger"),
                        cell(name, "blks_per_trigger", 0),
                        cell(name, "tup_per_trigger", 0),
                        cell(name, "idle_tx_per_worker_s", 3),
                    ]
                )
        report.add(
            f"{args.triggers} triggers per case, 50 ms apart, one no-op binding (`generate` "
            f"0 rows -> `null`); idle window {args.idle:.0f} s; {args.rounds} alternated "
            f"round(s){' (--quick)' if args.quick else ''}. Each side's workers at their "
            "defaults, `--concurrency 1` (Procrastinate: `run_worker(concurrency=1, "
            "listen_notify=True)`). Per trigger: the server's transactions, buffers (hit + "
            "read) and tuples read (returned + fetched) of the side's database from just "
            f"before the first trigger until all had finished plus {STATS_SETTLE:.0f} s "
            "(statistics publication), minus the idle load over that span, over the "
            "triggers. Idle load: transactions per second per worker in the idle window."
        )
        report.add(
            common.table(
                [
                    "side",
                    "idle workers",
                    "transactions per trigger",
                    "buffers per trigger",
                    "tuples read per trigger",
                    "idle transactions /s per worker",
                ],
                rows,
            )
        )
        if 1 in fleets and 32 in fleets:
            one = common.Spread([r["tx_per_trigger"] for r in results["dispatch-1"]]).median
            many = common.Spread([r["tx_per_trigger"] for r in results["dispatch-32"]]).median
            report.add(
                f"dispatch, 32 idle workers / 1: **{many / one:.2f}** transactions per trigger "
                f"(goal <= 2): {common.verdict(many <= 2 * one)}. Idle load goal <= 0.3 per "
                "worker: "
                + common.verdict(
                    all(
                        common.Spread(
                            [r["idle_tx_per_worker_s"] for r in results[f"dispatch-{w}"]]
                        ).median
                        <= 0.3
                        for w in fleets
                    )
                )
                + "."
            )
        report.emit(doc=not args.no_doc)
    finally:
        pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
