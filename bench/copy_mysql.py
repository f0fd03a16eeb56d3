"""MariaDB -> PostgreSQL and PostgreSQL -> MariaDB through `runworker` beside the raw
tools, and the worker's peak RSS as the rows grow. Run by `python -m bench copy` (its
`mariadb` and `to-mariadb` cases), or alone (both directions, `--cases` to choose):

    python -m bench copy_mysql [--rows 1000000] [--small 10000] [--mid 100000] [--rounds 3]
                               [--cases mariadb,to-mariadb]

- The MariaDB server is the benchmark's own (tools/mariadb.py: Debian's mariadbd in a
  temporary directory, a port of its own), never the system's.
- Worker: a fresh `runworker --concurrency 1`, listening before the trigger; time =
  trigger -> SUCCEEDED seen in `dispatch_run` (the run's fixed cost included), a `mysql`
  table source into a `postgresql` append sink.
- Raw: `mariadb --batch --skip-column-names -e "SELECT ..." | psql -c "COPY t FROM STDIN"`
  (the client's tab-separated output is PostgreSQL's text COPY format for these values).
- PostgreSQL -> MariaDB (`to-mariadb`): a `postgresql` table source (bench copy's rows)
  into a `mysql` append sink (LOAD DATA LOCAL INFILE of each batch, one transaction);
  raw: `psql -c "COPY (SELECT ...) TO STDOUT" | mariadb -e "LOAD DATA LOCAL INFILE
  '/dev/stdin' ..."`.
- Peak RSS: the worker's VmHWM after one run of `--small`, `--mid` and `--rows` rows.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common, copy_pg
from tools.mariadb import MariaDB

PG_COLUMNS = (
    "id bigint, customer character varying(20), amount numeric(12,2),"
    " created_at timestamp(6) with time zone, attrs jsonb, active smallint"
)
MY_COLUMNS = (
    "id BIGINT PRIMARY KEY, customer VARCHAR(20), amount DECIMAL(12,2), created_at TIMESTAMP(6),"
    " attrs JSON, active BOOLEAN"
)
SELECT = "SELECT id, customer, amount, created_at, attrs, active FROM {t}"


def fill(server: MariaDB, table: str, rows: int) -> None:
    """`table` in the benchmark's MariaDB database with `rows` rows of mixed types (the
    same values as bench copy's PostgreSQL source), made with MariaDB's sequence engine."""
    conn = server.root(database="bench")
    with conn.cursor() as cur:
        cur.execute("SET time_zone = '+00:00'")
        cur.execute(f"DROP TABLE IF EXISTS {table}")
        cur.execute(f"CREATE TABLE {table} ({MY_COLUMNS})")
        cur.execute(
            f"INSERT INTO {table} SELECT seq, CONCAT('customer-', LPAD(seq % 1000, 4, '0')),"
            " (seq * 7919) % 100000 / 100.0,"
            " TIMESTAMP '2024-01-01 00:00:00' + INTERVAL (seq % 400000000) SECOND,"
            " JSON_OBJECT('tier', seq % 5, 'tags', JSON_ARRAY('a', seq % 7)), seq % 3 = 0"
            f" FROM seq_1_to_{int(rows)}"
        )
    conn.close()


def reset_sink(server: str, table: str) -> None:
    with copy_pg.connect(server, copy_pg.DST_DB) as c:
        c.execute(f"DROP TABLE IF EXISTS {table}")
        c.execute(f"CREATE TABLE {table} ({PG_COLUMNS})")
        c.execute("DROP TABLE IF EXISTS dispatch_fence")


def setup(server: str, my: MariaDB, tables: list[str]) -> dict[str, Any]:
    """Migrate; one binding per source table (mysql table -> postgresql append)."""
    copy_pg.setup_app(server, [])
    from django.db import connection

    from dispatch.models import Datasource, Job, JobBinding

    s = connection.settings_dict
    pg = {"host": s["HOST"] or "127.0.0.1", "port": int(s["PORT"] or 5432), "user": s["USER"]}
    src = Datasource.objects.update_or_create(
        name="bench-mariadb",
        defaults={"kind": "mysql", "config": my.config("bench", tls="disabled")},
    )[0]
    dst = Datasource.objects.update_or_create(
        name="bench-dst",
        defaults={"kind": "postgresql", "config": {**pg, "dbname": copy_pg.DST_DB}},
    )[0]
    bindings = {}
    for table in tables:
        name = f"bench-copy-mariadb-{table}"
        job, _ = Job.objects.update_or_create(
            name=name,
            defaults={
                "source_spec": {"table": table},
                "sink_spec": {"table": f"{table}_from_mariadb", "mode": "append"},
                "max_attempts": 1,
                "lease_seconds": 60,
            },
        )
        bindings[table], _ = JobBinding.objects.update_or_create(
            name=name, defaults={"job": job, "source": src, "sink": dst}
        )
    return bindings


def worker_round(server: str, bindings: dict[str, Any], table: str, rows: int) -> tuple[float, int]:
    sink = f"{table}_from_mariadb"
    reset_sink(server, sink)
    with copy_pg.worker(server, f"copy-{sink}.log") as (proc, app):
        elapsed, _ = copy_pg.run_once(app, bindings[table], proc.log)
        peak = copy_pg.vm_hwm_kib(proc.popen.pid)
    got = copy_pg.count(server, sink)
    if got != rows:
        raise RuntimeError(f"{sink} holds {got} rows, expected {rows}")
    return elapsed, peak


def raw_round(server: str, my: MariaDB, table: str, rows: int) -> float:
    sink = f"{table}_from_mariadb"
    reset_sink(server, sink)
    client = shutil.which("mariadb") or "mysql"
    start = time.perf_counter()
    out = subprocess.Popen(
        [client, "--no-defaults", "--batch", "--skip-column-names", "-h", "127.0.0.1",
         "-P", str(my.port), "-u", my.admin_user, f"-p{my.admin_password}",
         "--init-command=SET time_zone = '+00:00'", "bench", "-e", SELECT.format(t=table)],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    subprocess.run(
        ["psql", "-X", "-q", copy_pg.url(server, copy_pg.DST_DB), "-c",
         f"COPY {sink} FROM STDIN"],
        stdin=out.stdout, check=True, capture_output=True,
    )  # fmt: skip
    assert out.stdout is not None
    out.stdout.close()
    out.wait()
    elapsed = time.perf_counter() - start
    got = copy_pg.count(server, sink)
    if got != rows:
        raise RuntimeError(f"raw mariadb left {got} rows in {sink}, expected {rows}")
    return elapsed


def section(server: str, *, rows: int, small: int, mid: int, rounds: int, argv: list[str],
            doc: bool) -> None:  # fmt: skip
    if shutil.which("psql") is None:
        raise SystemExit("psql is needed for the raw side")
    report = common.Report(
        f"MariaDB -> PostgreSQL against the raw pipe ({rows:,} rows)", argv, server
    )
    for db in (copy_pg.APP_DB, copy_pg.DST_DB):
        common.ensure_database(server, db)
    with tempfile.TemporaryDirectory(prefix="bench-mariadb-") as tmp:
        my = MariaDB(Path(tmp))
        my.start()
        try:
            conn = my.root()
            with conn.cursor() as cur:
                cur.execute("CREATE DATABASE IF NOT EXISTS bench")
            conn.close()
            sizes = {"my_small": small, "my_mid": mid, "my_orders": rows}
            for table, n in sizes.items():
                fill(my, table, n)
            bindings = setup(server, my, list(sizes))
            res = common.alternate(
                rounds,
                {
                    "worker": lambda: worker_round(server, bindings, "my_orders", rows),
                    "raw": lambda: raw_round(server, my, "my_orders", rows),
                },
            )
            w = [x[0] for x in res["worker"]]
            ratio = common.Spread([r / x for r, x in zip(res["raw"], w, strict=True)])
            rss = []
            for table, n in sizes.items():
                _, peak = worker_round(server, bindings, table, n)
                rss.append((n, peak / 1024))
                print(f"rss at {n:,} rows: {peak / 1024:.1f} MiB", flush=True)
        finally:
            my.stop()
    flat = max(m for _, m in rss) / min(m for _, m in rss)
    version = "MariaDB (Debian's mariadbd, its own data directory, 64 MiB buffer pool)"
    report.add(
        f"Rows: MariaDB `{MY_COLUMNS}`, into PostgreSQL `{PG_COLUMNS}` (the documented "
        f"mapping); {version}. Worker: a fresh `runworker --concurrency 1` per round, a "
        "`mysql` table source (one consistent snapshot, unbuffered cursor, 5,000-row "
        "batches) into a `postgresql` append sink (text COPY); time = trigger -> SUCCEEDED. "
        "Raw: `mariadb --batch --skip-column-names -e 'SELECT ...' | psql -c 'COPY ... FROM "
        f"STDIN'`. {rounds} alternated rounds; seconds as median (min-max)."
    )
    _finish(report, "mariadb -> postgresql", w, res["raw"], ratio, rss, flat, doc)


# PostgreSQL's text COPY of bench copy's rows in the form LOAD DATA reads into MY_COLUMNS
# (UTC timestamps without zone, booleans as 0/1; the escapes are the same).
PG_SELECT = (
    "SELECT id, customer, amount, created_at AT TIME ZONE 'UTC', attrs, active::int FROM {t}"
)


def reset_my_sink(my: MariaDB, table: str) -> None:
    conn = my.root(database="bench")
    with conn.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {table}")
        cur.execute(f"CREATE TABLE {table} ({MY_COLUMNS}) ENGINE=InnoDB")
    conn.close()


def my_count(my: MariaDB, table: str) -> int:
    conn = my.root(database="bench")
    with conn.cursor() as cur:
        cur.execute(f"SELECT COUNT(*) FROM {table}")  # noqa: S608
        (n,) = cur.fetchone()
    conn.close()
    return int(n)


def sink_setup(my: MariaDB, tables: list[str]) -> dict[str, Any]:
    """One binding per PostgreSQL source table (postgresql table -> mysql append); call
    after copy_pg.setup_app (Django set up on the benchmark's dispatch database)."""
    from dispatch.models import Datasource, Job, JobBinding

    src = Datasource.objects.get(name="bench-src")
    dst = Datasource.objects.update_or_create(
        name="bench-mariadb-sink",
        defaults={"kind": "mysql", "config": my.config("bench", tls="disabled")},
    )[0]
    bindings = {}
    for table in tables:
        name = f"bench-copy-to-mariadb-{table}"
        job, _ = Job.objects.update_or_create(
            name=name,
            defaults={
                "source_spec": {"table": table},
                "sink_spec": {"table": f"{table}_to_mariadb", "mode": "append"},
                "max_attempts": 1,
                "lease_seconds": 60,
            },
        )
        bindings[table], _ = JobBinding.objects.update_or_create(
            name=name, defaults={"job": job, "source": src, "sink": dst}
        )
    return bindings


def sink_worker_round(
    server: str, my: MariaDB, bindings: dict[str, Any], table: str, rows: int
) -> tuple[float, int]:
    sink = f"{table}_to_mariadb"
    reset_my_sink(my, sink)
    with copy_pg.worker(server, f"copy-{sink}.log") as (proc, app):
        elapsed, _ = copy_pg.run_once(app, bindings[table], proc.log)
        peak = copy_pg.vm_hwm_kib(proc.popen.pid)
    got = my_count(my, sink)
    if got != rows:
        raise RuntimeError(f"{sink} holds {got} rows, expected {rows}")
    return elapsed, peak


def sink_raw_round(server: str, my: MariaDB, table: str, rows: int) -> float:
    sink = f"{table}_to_mariadb"
    reset_my_sink(my, sink)
    client = shutil.which("mariadb") or "mysql"
    start = time.perf_counter()
    out = subprocess.Popen(
        ["psql", "-X", "-q", copy_pg.url(server, copy_pg.SRC_DB), "-c",
         f"COPY ({PG_SELECT.format(t=table)}) TO STDOUT"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    subprocess.run(
        [client, "--no-defaults", "--local-infile=1", "-h", "127.0.0.1", "-P", str(my.port),
         "-u", my.admin_user, f"-p{my.admin_password}",
         "--init-command=SET time_zone = '+00:00'", "bench", "-e",
         f"LOAD DATA LOCAL INFILE '/dev/stdin' INTO TABLE {sink}"],
        stdin=out.stdout, check=True, capture_output=True,
    )  # fmt: skip
    assert out.stdout is not None
    out.stdout.close()
    out.wait()
    elapsed = time.perf_counter() - start
    got = my_count(my, sink)
    if got != rows:
        raise RuntimeError(f"raw psql | mariadb left {got} rows in {sink}, expected {rows}")
    return elapsed


def sink_section(server: str, *, rows: int, small: int, mid: int, rounds: int, argv: list[str],
                 doc: bool) -> None:  # fmt: skip
    """PostgreSQL -> MariaDB: the worker beside the raw pipe at `rows`, and its peak RSS
    at `small`, `mid` and `rows` rows."""
    if shutil.which("psql") is None:
        raise SystemExit("psql is needed for the raw side")
    report = common.Report(
        f"PostgreSQL -> MariaDB against the raw pipe ({rows:,} rows)", argv, server
    )
    for db in (copy_pg.APP_DB, copy_pg.SRC_DB, copy_pg.DST_DB):
        common.ensure_database(server, db)
    sizes = {"orders_small": small, "orders_mid": mid, "orders": rows}
    for table, n in sizes.items():
        copy_pg.ensure_source(server, table, n)
    copy_pg.setup_app(server, [])
    with tempfile.TemporaryDirectory(prefix="bench-mariadb-") as tmp:
        my = MariaDB(Path(tmp))
        my.start()
        try:
            conn = my.root()
            with conn.cursor() as cur:
                cur.execute("CREATE DATABASE IF NOT EXISTS bench")
            conn.close()
            bindings = sink_setup(my, list(sizes))
            res = common.alternate(
                rounds,
                {
                    "worker": lambda: sink_worker_round(server, my, bindings, "orders", rows),
                    "raw": lambda: sink_raw_round(server, my, "orders", rows),
                },
            )
            w = [x[0] for x in res["worker"]]
            ratio = common.Spread([r / x for r, x in zip(res["raw"], w, strict=True)])
            rss = []
            for table, n in sizes.items():
                _, peak = sink_worker_round(server, my, bindings, table, n)
                rss.append((n, peak / 1024))
                print(f"rss at {n:,} rows: {peak / 1024:.1f} MiB", flush=True)
        finally:
            my.stop()
    flat = max(m for _, m in rss) / min(m for _, m in rss)
    report.add(
        f"Rows: PostgreSQL `{copy_pg.COLUMNS}` (bench copy's source), into MariaDB "
        f"`{MY_COLUMNS}` (the documented mapping); MariaDB (Debian's mariadbd, its own data "
        "directory, 64 MiB buffer pool). Worker: a fresh `runworker --concurrency 1` per "
        "round, a `postgresql` table source into a `mysql` append sink (every value checked "
        "against its column, then LOAD DATA LOCAL INFILE of each batch, one transaction "
        "ending with the fence); time = trigger -> SUCCEEDED. Raw: `psql -c 'COPY (SELECT "
        "...) TO STDOUT' | mariadb -e \"LOAD DATA LOCAL INFILE '/dev/stdin' ...\"`. "
        f"{rounds} alternated rounds; seconds as median (min-max). The seconds depend on "
        "the machine's load (it is shared); the peak RSS does not."
    )
    _finish(report, "postgresql -> mariadb", w, res["raw"], ratio, rss, flat, doc)


def _finish(
    report: Any, case: str, worker: Any, raw: Any, ratio: Any, rss: Any, flat: float, doc: Any
) -> None:
    """The table of one direction's seconds, its peak RSS line, and the report written."""
    report.add(
        common.table(
            ["case", "worker s", "raw s", "raw / worker"],
            [[case, common.Spread(worker).fmt(3), common.Spread(raw).fmt(3), ratio.fmt()]],
        )
    )
    report.add(
        "Peak RSS (VmHWM) of a fresh worker after one run: "
        + ", ".join(f"{m:.1f} MiB at {n:,} rows" for n, m in rss)
        + f"; largest / smallest **{flat:.2f}** (flat: {common.verdict(flat <= 1.25)})."
    )
    report.emit(doc=doc)


def main(argv: list[str]) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=common.positive, default=1_000_000)
    p.add_argument("--small", type=common.positive, default=10_000)
    p.add_argument("--mid", type=common.positive, default=100_000)
    p.add_argument("--prefix", default="dispatch_bench_copy", help="names of the databases")
    p.add_argument("--cases", default="mariadb,to-mariadb", help="mariadb, to-mariadb or both")
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if not cases or not set(cases) <= {"mariadb", "to-mariadb"}:
        raise SystemExit("--cases: mariadb, to-mariadb or both")
    if args.quick:
        args.rows, args.small, args.mid, args.rounds = 50_000, 2_000, 10_000, 1
    copy_pg.set_prefix(args.prefix)
    kwargs = {"rows": args.rows, "small": args.small, "mid": args.mid, "rounds": args.rounds}
    if "mariadb" in cases:
        section(args.server, **kwargs, argv=["copy_mysql", *argv], doc=not args.no_doc)
    if "to-mariadb" in cases:
        sink_section(args.server, **kwargs, argv=["copy_mysql", *argv], doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
