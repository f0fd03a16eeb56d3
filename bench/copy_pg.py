"""PostgreSQL -> PostgreSQL copy through `runworker`, side by side with the raw floor
`psql -c "COPY (...) TO STDOUT" | psql -c "COPY t FROM STDIN"` between the same databases.

    .venv/bin/python -m bench copy [--rows 1000000] [--rounds 3] [--no-doc]

Rounds alternate (worker then raw, then raw then worker); each figure is a median with its
min-max. Each worker round starts a fresh `runworker` process, so its peak RSS (VmHWM) is
that of one copy: measured for a small and the full row count.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
SERVER = "postgres://postgres@127.0.0.1:5432"
APP_DB, SRC_DB, DST_DB = "dispatch_bench_copy", "dispatch_bench_copy_src", "dispatch_bench_copy_dst"
# A throwaway key for the benchmark's own database: its datasources hold no secret.
BENCH_KEY = "YmVuY2gtY29weS1rZXktbm90LWEtc2VjcmV0LTEyMzQ="
COLUMNS = "id bigint, customer text, amount numeric(12,2), created_at timestamptz"
INTRO = """# Benchmarks

Measured on the machine named in each section; every figure compares two things measured
in the same run, alternated over several rounds, as a median with its min-max.
"""


def url(server: str, db: str) -> str:
    return f"{server.rstrip('/')}/{db}"


def connect(server: str, db: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url(server, db), autocommit=True)


def ensure_db(server: str, db: str) -> None:
    with connect(server, "postgres") as c:
        if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", [db]).fetchone():
            c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))


def ensure_source(server: str, table: str, rows: int) -> None:
    with connect(server, SRC_DB) as c:
        have = c.execute("SELECT to_regclass(%s)", [table]).fetchone()
        if (
            have
            and have[0]
            and c.execute(
                sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))
            ).fetchone()
            == (rows,)
        ):
            return
        c.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
        c.execute(
            sql.SQL(
                "CREATE TABLE {} AS SELECT i::bigint AS id,"
                " 'customer-' || lpad((i %% 1000)::text, 4, '0') AS customer,"
                " ((i::bigint * 7919) %% 100000 / 100.0)::numeric(12,2) AS amount,"
                " timestamptz '2024-01-01' + i * interval '1 second' AS created_at"
                " FROM generate_series(1, %s) AS i"
            ).format(sql.Identifier(table)),
            [rows],
        )
        c.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(table)))


def env(server: str) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": url(server, APP_DB),
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DISPATCH_ENCRYPTION_KEYS": BENCH_KEY,
        "SECRET_KEY": "bench-only",
        "DEBUG": "false",
        "DISPATCH_POLL_INTERVAL": "0.5",
        "PYTHONUNBUFFERED": "1",
    }


def setup_app(server: str) -> dict[str, Any]:
    """Migrate the benchmark's dispatch database and create one binding per size."""
    e = env(server)
    subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "migrate", "-v", "0"], env=e, check=True
    )
    os.environ.update(
        {
            k: e[k]
            for k in (
                "DATABASE_URL",
                "DJANGO_SETTINGS_MODULE",
                "DISPATCH_ENCRYPTION_KEYS",
                "SECRET_KEY",
            )
        }
    )
    import django

    django.setup()
    from django.db import connection

    from dispatch.models import Datasource, Job, JobBinding

    s = connection.settings_dict
    base = {"host": s["HOST"] or "127.0.0.1", "port": int(s["PORT"] or 5432), "user": s["USER"]}
    if s.get("PASSWORD"):
        base["password"] = s["PASSWORD"]
    src, _ = Datasource.objects.get_or_create(
        name="bench-src", defaults={"kind": "postgresql", "config": {**base, "dbname": SRC_DB}}
    )
    dst, _ = Datasource.objects.get_or_create(
        name="bench-dst", defaults={"kind": "postgresql", "config": {**base, "dbname": DST_DB}}
    )
    bindings = {}
    for table in ("orders_small", "orders"):
        job, _ = Job.objects.get_or_create(
            name=f"bench-copy-{table}",
            defaults={
                "source_spec": {"table": table},
                "sink_spec": {"table": f"{table}_copy", "mode": "append"},
                "max_attempts": 1,
                "lease_seconds": 60,
            },
        )
        bindings[table], _ = JobBinding.objects.get_or_create(
            name=f"bench-copy-{table}", defaults={"job": job, "source": src, "sink": dst}
        )
    return bindings


def reset_sink(server: str, table: str) -> None:
    with connect(server, DST_DB) as c:
        c.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
        c.execute(sql.SQL("CREATE TABLE {} (" + COLUMNS + ")").format(sql.Identifier(table)))  # type: ignore[operator]
        c.execute("DROP TABLE IF EXISTS dispatch_fence")


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.005)


def worker_round(server: str, binding: Any, table: str, rows: int) -> tuple[float, int]:
    """Seconds from trigger to SUCCEEDED with a warm, idle worker; and its peak RSS."""
    from dispatch import services

    reset_sink(server, f"{table}_copy")
    log = open(ROOT / "bench" / "results" / "copy-worker.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "manage.py"),
            "runworker",
            "--no-scheduler",
            "--concurrency",
            "1",
        ],
        env=env(server),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with connect(server, APP_DB) as app:
            # Idle and listening: its LISTEN statement is the last one on its connection.
            wait(
                lambda: app.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE datname = %s AND query ILIKE 'LISTEN%%'",
                    [APP_DB],
                ).fetchone(),
                60,
                "the worker to listen",
            )
            start = time.perf_counter()
            run = services.trigger(binding)
            status = wait(
                lambda: (
                    (
                        s := app.execute(
                            "SELECT status FROM dispatch_run WHERE id = %s", [run.id]
                        ).fetchone()[0]
                    )
                    in ("SUCCEEDED", "FAILED", "RETRY_SCHEDULED")
                    and s
                ),
                600,
                "the run",
            )
            elapsed = time.perf_counter() - start
            if status != "SUCCEEDED":
                raise SystemExit(f"run {run.id} ended {status}; see bench/results/copy-worker.log")
        peak = vm_hwm_kib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    with connect(server, DST_DB) as c:
        got = c.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(f"{table}_copy"))
        ).fetchone()
    if got != (rows,):
        raise SystemExit(f"sink holds {got} rows, expected {rows}")
    return elapsed, peak


def raw_round(server: str, table: str, rows: int) -> float:
    reset_sink(server, f"{table}_copy")
    out = subprocess.Popen(
        ["psql", "-X", "-q", url(server, SRC_DB), "-c", f"COPY (SELECT * FROM {table}) TO STDOUT"],
        stdout=subprocess.PIPE,
    )
    start = time.perf_counter()
    result = subprocess.run(
        ["psql", "-X", "-q", url(server, DST_DB), "-c", f"COPY {table}_copy FROM STDIN"],
        stdin=out.stdout,
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout is not None
    out.stdout.close()
    out.wait()
    elapsed = time.perf_counter() - start
    with connect(server, DST_DB) as c:
        got = c.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(f"{table}_copy"))
        ).fetchone()
    if got != (rows,):
        raise SystemExit(f"raw copy left {got} rows, expected {rows}: {result.stderr}")
    return elapsed


def spread(values: list[float], digits: int = 0) -> str:
    return (
        f"{statistics.median(values):,.{digits}f} "
        f"({min(values):,.{digits}f}–{max(values):,.{digits}f})"
    )


def machine(server: str) -> str:
    with connect(server, "postgres") as c:
        pg = c.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    mem = next(
        (
            line.split()[1]
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        ),
        "?",
    )
    psql = subprocess.run(["psql", "--version"], capture_output=True, text=True).stdout.strip()
    return (
        f"{cpu}, {os.cpu_count()} CPUs, {int(mem) // 1024} MiB RAM; Linux "
        f"{platform.release()}; PostgreSQL {pg} (same host, TCP 127.0.0.1); {psql}; "
        f"Python {platform.python_version()}, psycopg {psycopg.__version__} "
        f"({psycopg.pq.__impl__})"
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench copy", description=__doc__.split("\n")[0])
    p.add_argument("--server", default=SERVER)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--small", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-doc", action="store_true", help="print only")
    p.add_argument("--quick", action="store_true", help="small sizes, one round (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.small, args.rounds = 50_000, 2_000, 1
    if shutil.which("psql") is None:
        raise SystemExit("psql is needed for the raw floor")
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    for db in (APP_DB, SRC_DB, DST_DB):
        ensure_db(args.server, db)
    ensure_source(args.server, "orders", args.rows)
    ensure_source(args.server, "orders_small", args.small)
    bindings = setup_app(args.server)

    worker_s: list[float] = []
    raw_s: list[float] = []
    rss_big: list[int] = []
    rss_small: list[int] = []
    for r in range(args.rounds):
        order = ["worker", "raw"] if r % 2 == 0 else ["raw", "worker"]
        for case in order:
            if case == "worker":
                t, peak = worker_round(args.server, bindings["orders"], "orders", args.rows)
                worker_s.append(t)
                rss_big.append(peak)
                _, small_peak = worker_round(
                    args.server, bindings["orders_small"], "orders_small", args.small
                )
                rss_small.append(small_peak)
            else:
                raw_s.append(raw_round(args.server, "orders", args.rows))
        print(
            f"round {r + 1}: worker {worker_s[-1]:.3f}s raw {raw_s[-1]:.3f}s "
            f"rss {rss_small[-1] // 1024}/{rss_big[-1] // 1024} MiB",
            flush=True,
        )

    ratios = [raw / w for raw, w in zip(raw_s, worker_s, strict=True)]
    rss_ratio = [b / s for b, s in zip(rss_big, rss_small, strict=True)]
    ok_speed = statistics.median(ratios) >= 0.85
    ok_rss = statistics.median(rss_ratio) <= 1.25
    rows = [
        (
            "runworker (COPY pass-through)",
            spread([args.rows / t for t in worker_s]),
            spread(worker_s, 3),
        ),
        ("raw `psql … \\| psql …`", spread([args.rows / t for t in raw_s]), spread(raw_s, 3)),
    ]
    lines = [
        f"## PostgreSQL → PostgreSQL copy ({args.rows:,} rows)",
        "",
        f"{dt.date.today().isoformat()}, {args.rounds} alternated rounds; a fresh worker per "
        "worker round, already listening when the run is triggered (time = trigger → "
        "SUCCEEDED, as seen in `dispatch_run`). Rows: `id bigint, customer text, amount "
        "numeric(12,2), created_at timestamptz`; the sink table exists with the same types "
        "(binary COPY pass-through), mode `append`.",
        "",
        "| path | rows/s, median (min–max) | seconds |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
        f"- throughput ratio worker / raw: **{spread(ratios, 2)}** (goal ≥ 0.85: "
        f"{'met' if ok_speed else 'missed'})",
        f"- worker peak RSS (VmHWM): {spread([x / 1024 for x in rss_small], 1)} MiB at "
        f"{args.small:,} rows, {spread([x / 1024 for x in rss_big], 1)} MiB at {args.rows:,} "
        f"rows; ratio **{spread(rss_ratio, 2)}** (goal ≤ 1.25: {'met' if ok_rss else 'missed'})",
        f"- command: `.venv/bin/python -m bench copy --rows {args.rows} --rounds {args.rounds}`",
        f"- machine: {machine(args.server)}",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_doc:
        existing = DOC.read_text() if DOC.exists() else INTRO
        DOC.write_text(existing.rstrip("\n") + "\n\n" + text)
    return 0 if ok_speed and ok_rss else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
