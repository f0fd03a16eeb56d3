"""PgBouncer: 32 worker processes x 4 slots draining a backlog, with their working
connections through a transaction-pooling PgBouncer and LISTEN direct, on a server whose
max_connections is 100 — beside the same load with direct connections (which need more
than 100: the server is restarted with 300 for that side). Runs drained, peak server
connections, throughput (runs/s from the first claim to the last finish).

Uses an embedded PostgreSQL of its own (its max_connections set here), not --server.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from bench import common
from project.embedded_pg import EmbeddedPostgres
from tools.pgbouncer import PgBouncer, free_port

DB = "dispatch_bench_pgbouncer"


def peak_connections(server: str, stop: threading.Event, out: list[int]) -> None:
    """Sample the server's client backends every 20 ms until `stop`."""
    with common.connect(server, "postgres") as conn:
        while not stop.is_set():
            (n,) = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
            ).fetchone()
            out.append(int(n))
            stop.wait(0.02)


def one_round(
    args: Any, pg: EmbeddedPostgres, env: dict[str, str], bouncer: PgBouncer | None
) -> dict[str, Any]:
    from django.db import connection

    connection.close()  # the server may have restarted since the last round
    server = pg.url("").rstrip("/")
    with common.connect(server, DB) as conn:
        common.reset_dispatch(conn)
        common.make_bindings(args.workers, max_concurrency=args.slots * 2)
        common.bulk_runs(conn, args.runs)
        conn.execute("ANALYZE dispatch_run, dispatch_attempt")
    worker_env = dict(env)
    if bouncer is not None:
        worker_env["DATABASE_URL"] = bouncer.url(DB)
        worker_env["DISPATCH_LISTEN_URL"] = common.db_url(server, DB)
    samples: list[int] = []
    stop = threading.Event()
    sampler = threading.Thread(target=peak_connections, args=(server, stop, samples))
    sampler.start()
    tag = "pgbouncer" if bouncer is not None else "direct"
    try:
        procs = common.start_workers(args.workers, args.slots, worker_env, burst=True, tag=tag)
        common.wait_procs(procs, timeout=1800)
    finally:
        stop.set()
        sampler.join()
    with common.connect(server, DB) as conn:
        drained, span = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'SUCCEEDED'),"
            " EXTRACT(EPOCH FROM max(finished_at) - min(claimed_at))::float8"
            " FROM dispatch_attempt"
        ).fetchone()
    return {
        "drained": int(drained),
        "rate": drained / max(span or 0.0, 1e-9),
        "peak": max(samples) if samples else 0,
    }


def main(argv: list[str]) -> int:
    p = common.parser(__doc__ or "")
    p.add_argument("--workers", type=common.positive, default=32)
    p.add_argument("--slots", type=common.positive, default=4)
    p.add_argument("--runs", type=common.positive, default=20_000)
    p.add_argument("--pool-size", type=common.positive, default=20)
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.rounds = 2_000, 1
    data = common.ROOT / ".data" / "bench-pgbouncer"
    pg = EmbeddedPostgres(data / "pg", port=free_port(), max_connections=100)
    pg.start()
    bouncer: PgBouncer | None = None
    try:
        server = pg.url("").rstrip("/")
        pg.create_database(DB)
        env = common.setup_django(server, DB)
        report = common.Report("PgBouncer: 32 workers x 4 slots, max_connections 100", argv, server)
        bouncer = PgBouncer(
            Path(data / "pgbouncer"),
            server_host="127.0.0.1",
            server_port=pg.port,
            pool_size=args.pool_size,
            max_client_conn=2000,
        )
        bouncer.start()
        pooled = [one_round(args, pg, env, bouncer) for _ in range(args.rounds)]
        # Direct connections need W x P x (C + 3): more than 100. Same server, raised.
        pg.stop()
        pg.max_connections = 300
        pg.start()
        direct = [one_round(args, pg, env, None) for _ in range(args.rounds)]
        print("pooled", pooled, "direct", direct, flush=True)
        rows = []
        for name, results, limit in (
            (f"PgBouncer (pool {args.pool_size}), LISTEN direct", pooled, 100),
            ("direct", direct, 300),
        ):
            rows.append(
                [
                    name,
                    limit,
                    f"{sum(r['drained'] for r in results)} / {args.runs * len(results)}",
                    common.Spread([r["peak"] for r in results]).fmt(0),
                    common.Spread([r["rate"] for r in results]).fmt(0),
                ]
            )
        ratio = common.Spread(
            [a["rate"] / b["rate"] for a, b in zip(pooled, direct, strict=True)]
        ).fmt(2)
        report.add(
            f"{args.workers} `runworker --burst --concurrency {args.slots}` processes drain "
            f"{args.runs} due no-op runs (generate 0 rows -> null) per round; "
            f"{args.rounds} round(s){' (--quick)' if args.quick else ''}. Peak: client "
            "backends on the server, sampled every 20 ms. Throughput: runs from the first "
            "claim to the last finish."
        )
        report.add(
            common.table(
                ["connections", "max_connections", "drained", "peak server connections", "runs/s"],
                rows,
            )
        )
        report.add(f"Throughput through PgBouncer / direct: {ratio}.")
        report.emit(doc=not args.no_doc)
    finally:
        if bouncer is not None:
            bouncer.stop()
        pg.stop()
    return 0
