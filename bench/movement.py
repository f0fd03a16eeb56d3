"""Data movement beyond `copy_pg`'s append: PostgreSQL -> PostgreSQL in `replace` and
`upsert` modes, and CSV -> PostgreSQL, each against the raw `psql` COPY that does the same
work, side by side; and the worker's peak RSS at a small and the full row count.

Reuses `bench.copy_pg` (databases, source tables, the app database and its helpers).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from psycopg import sql

from bench import common
from bench import copy_pg as cp


def sink_ddl(table: str, *, key: bool) -> sql.Composed:
    ddl = sql.SQL("CREATE TABLE {} (" + cp.COLUMNS + ")").format(sql.Identifier(table))  # type: ignore[operator]
    if key:
        ddl += sql.SQL("; ALTER TABLE {} ADD PRIMARY KEY (id)").format(sql.Identifier(table))
    return ddl


def reset_sink(server: str, table: str, *, key: bool) -> None:
    with cp.connect(server, cp.DST_DB) as c:
        c.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
        c.execute(sink_ddl(table, key=key))
        c.execute("DROP TABLE IF EXISTS dispatch_fence")


def export_csv(server: str, table: str) -> Path:
    """The source table as a CSV file with a header (made once per size)."""
    path = common.csv_dir() / f"{table}.csv"
    if not path.exists():
        with cp.connect(server, cp.SRC_DB) as c, path.open("wb") as f:
            stmt = sql.SQL("COPY {} TO STDOUT (FORMAT csv, HEADER)").format(sql.Identifier(table))
            with c.cursor().copy(stmt) as copy:
                for block in copy:
                    f.write(block)
    return path


def setup(server: str) -> dict[tuple[str, str], Any]:
    """One binding per (case, source table)."""
    cp.setup_app(server)
    from dispatch.models import Datasource, Job, JobBinding

    src = Datasource.objects.get(name="bench-src")
    dst = Datasource.objects.get(name="bench-dst")
    csv_src = Datasource.objects.filter(name="bench-csv").first() or Datasource(
        name="bench-csv", kind="csv"
    )
    # This run's directory (common.csv_dir), even if another checkout made the row first.
    if csv_src._state.adding or csv_src.config != {"base_dir": str(common.csv_dir())}:
        csv_src.config = {"base_dir": str(common.csv_dir())}
        csv_src.save()
    specs = {
        "replace": (src, lambda t: {"table": t}, {"mode": "replace"}),
        "upsert": (src, lambda t: {"table": t}, {"mode": "upsert", "key": ["id"]}),
        "csv": (csv_src, lambda t: {"path": f"{t}.csv"}, {"mode": "append"}),
    }
    bindings = {}
    for case, (source, source_spec, sink_mode) in specs.items():
        for table in ("orders_small", "orders"):
            name = f"bench-move-{case}-{table}"
            job, _ = Job.objects.get_or_create(
                name=name,
                defaults={
                    "source_spec": source_spec(table),
                    "sink_spec": {"table": f"{table}_{case}", **sink_mode},
                    "max_attempts": 1,
                    "lease_seconds": 60,
                },
            )
            bindings[case, table], _ = JobBinding.objects.get_or_create(
                name=name, defaults={"job": job, "source": source, "sink": dst}
            )
    return bindings


def worker_round(server: str, binding: Any, sink: str, rows: int, key: bool) -> tuple[float, int]:
    """Seconds from trigger to SUCCEEDED with a warm, idle worker; and its peak RSS (KiB)."""
    from dispatch import services

    reset_sink(server, sink, key=key)
    proc = common.start(
        [
            sys.executable,
            str(common.ROOT / "manage.py"),
            "runworker",
            "--no-scheduler",
            "--concurrency",
            "1",
        ],
        cp.env(server),
        f"movement-{sink}.log",
    )
    try:
        with cp.connect(server, cp.APP_DB) as app:
            cp.wait(
                lambda: app.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE datname = %s AND query ILIKE 'LISTEN%%'",
                    [cp.APP_DB],
                ).fetchone(),
                60,
                "the worker to listen",
            )
            start = time.perf_counter()
            run = services.trigger(binding)
            status = cp.wait(
                lambda: app.execute(
                    "SELECT status FROM dispatch_run WHERE id = %s AND status IN "
                    "('SUCCEEDED', 'FAILED')",
                    [run.id],
                ).fetchone(),
                600,
                "the run",
            )[0]
            elapsed = time.perf_counter() - start
        peak = cp.vm_hwm_kib(proc.popen.pid)
    finally:
        common.stop_procs([proc])
    if status != "SUCCEEDED":
        raise RuntimeError(f"run {run.id} ended {status}; see {proc.log}")
    check_rows(server, sink, rows)
    return elapsed, peak


def check_rows(server: str, table: str, rows: int) -> None:
    with cp.connect(server, cp.DST_DB) as c:
        got = c.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))
        ).fetchone()[0]
    if got != rows:
        raise RuntimeError(f"{table} holds {got} rows, expected {rows}")


def raw_round(server: str, case: str, table: str, rows: int) -> float:
    """The same work with psql alone: COPY out | (TRUNCATE + COPY in) for replace, COPY
    into a staging table + INSERT ... ON CONFLICT for upsert, COPY csv for CSV."""
    sink = f"{table}_{case}"
    reset_sink(server, sink, key=case == "upsert")
    dst = cp.url(server, cp.DST_DB)
    # Constant identifiers (the benchmark's own table names), not user input.
    if case == "replace":
        load = ["-1", "-c", f"TRUNCATE {sink}", "-c", f"COPY {sink} FROM STDIN"]
    elif case == "upsert":
        load = [
            "-1",
            "-c", f"CREATE TEMP TABLE staging (LIKE {sink}) ON COMMIT DROP",
            "-c", "COPY staging FROM STDIN",
            "-c", f"INSERT INTO {sink} SELECT * FROM staging ON CONFLICT (id) DO UPDATE SET "
            "customer = EXCLUDED.customer, amount = EXCLUDED.amount, "
            "created_at = EXCLUDED.created_at",
        ]  # fmt: skip
    else:
        load = ["-c", f"COPY {sink} FROM STDIN (FORMAT csv, HEADER)"]
    start = time.perf_counter()
    if case == "csv":
        with (common.csv_dir() / f"{table}.csv").open("rb") as f:
            subprocess.run(["psql", "-X", "-q", dst, *load], stdin=f, check=True,
                           capture_output=True)  # fmt: skip
    else:
        out = subprocess.Popen(
            ["psql", "-X", "-q", cp.url(server, cp.SRC_DB), "-c",
             f"COPY (SELECT * FROM {table}) TO STDOUT"],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        subprocess.run(["psql", "-X", "-q", dst, *load], stdin=out.stdout, check=True,
                       capture_output=True)  # fmt: skip
        assert out.stdout is not None
        out.stdout.close()
        out.wait()
    elapsed = time.perf_counter() - start
    check_rows(server, sink, rows)
    return elapsed


def main(argv: list[str]) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=common.positive, default=1_000_000)
    p.add_argument("--small", type=common.positive, default=10_000)
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.small, args.rounds = 50_000, 2_000, 1
    report = common.Report(
        "Data movement: replace, upsert and CSV -> PostgreSQL", ["movement", *argv], args.server
    )
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    for db in (cp.APP_DB, cp.SRC_DB, cp.DST_DB):
        cp.ensure_db(args.server, db)
    cp.ensure_source(args.server, "orders", args.rows)
    cp.ensure_source(args.server, "orders_small", args.small)
    # Sizes may have changed since the files were written: write them anew.
    for t in ("orders", "orders_small"):
        (common.csv_dir() / f"{t}.csv").unlink(missing_ok=True)
        export_csv(args.server, t)
    bindings = setup(args.server)
    rows = []
    for case in ("replace", "upsert", "csv"):
        key = case == "upsert"
        res = common.alternate(
            args.rounds,
            {
                "worker": lambda c=case, k=key: (
                    worker_round(args.server, bindings[c, "orders"], f"orders_{c}", args.rows, k),
                    worker_round(
                        args.server,
                        bindings[c, "orders_small"],
                        f"orders_small_{c}",
                        args.small,
                        k,
                    ),
                ),  # fmt: skip
                "raw": lambda c=case: raw_round(args.server, c, "orders", args.rows),
            },
        )
        big = [w[0] for w in res["worker"]]
        small = [w[1] for w in res["worker"]]
        speed = common.Spread([r / b[0] for r, b in zip(res["raw"], big, strict=True)])
        rss = common.Spread([b[1] / s[1] for b, s in zip(big, small, strict=True)])
        rows.append(
            [
                case,
                common.Spread([args.rows / b[0] for b in big]).fmt(0),
                common.Spread([args.rows / r for r in res["raw"]]).fmt(0),
                f"{speed.fmt()} {common.verdict(speed.median >= 0.85)}",
                f"{statistics.median(s[1] for s in small) / 1024:.0f} / "
                f"{statistics.median(b[1] for b in big) / 1024:.0f}",
                f"{rss.fmt()} {common.verdict(rss.median <= 1.25)}",
            ]
        )
    report.add(
        f"{args.rows:,} rows (`{cp.COLUMNS}`) per run; a fresh `runworker --concurrency 1` per "
        "worker round, listening before the trigger (time = trigger -> SUCCEEDED); the raw "
        "side is `psql` alone doing the same work (replace: `COPY ... TO STDOUT | TRUNCATE + "
        "COPY FROM STDIN` in one transaction; upsert: COPY into a staging table, then "
        "`INSERT ... ON CONFLICT (id) DO UPDATE`, into a table keyed on `id`; CSV: `COPY ... "
        f"FROM STDIN (FORMAT csv, HEADER)` from the same file); {args.rounds} alternated "
        f"rounds. Peak RSS is the worker's VmHWM at {args.small:,} and {args.rows:,} rows."
    )
    report.add(
        common.table(
            [
                "case",
                "worker rows/s",
                "raw rows/s",
                "worker / raw (goal >= 0.85)",
                "peak RSS MiB small / full",
                "RSS full / small (goal <= 1.25)",
            ],
            rows,
        )  # fmt: skip
    )
    report.emit(doc=not args.no_doc)
    return 0
