"""A single stream against the raw pipe: PostgreSQL -> PostgreSQL in `append`, `replace`,
`upsert` and `mirror` modes and CSV -> PostgreSQL through `runworker`, each side by side with `psql`
doing the same work; the fixed cost of a run; the worker's peak RSS as the rows grow;
(case `parquet`) PostgreSQL -> Parquet beside `psql` COPY + pyarrow; and (bench/copy_mysql.py)
MariaDB -> PostgreSQL beside `mariadb | psql` (case `mariadb`) and PostgreSQL -> MariaDB
beside `psql | mariadb` (case `to-mariadb`).

    python -m bench copy [--rows 1000000] [--small 10000] [--rows-big N] [--rounds 3]
                         [--fixed-runs 30] [--prefix dispatch_bench_copy] [--quick] [--no-doc]

- Throughput: a fresh `runworker --concurrency 1` per worker round, listening before the
  trigger; time = trigger -> SUCCEEDED seen in `dispatch_run` (the fixed cost included).
  The raw side: `psql -c "COPY (SELECT * FROM t) TO STDOUT" | psql -c "COPY ... FROM STDIN"`
  (replace: TRUNCATE + COPY in one transaction; upsert: COPY into a staging table, then
  INSERT ... ON CONFLICT; CSV: `psql -c "\\copy t FROM 'file' (FORMAT csv, HEADER)"`).
  Worker and raw rounds alternate (A B, then B A).
- Fixed cost: one warm worker runs a 1-row `append` job `--fixed-runs` times; the database's
  own clock gives trigger -> SUCCEEDED (`dispatch_run.finished_at - created_at`) and claim
  -> settle (`dispatch_attempt.finished_at - claimed_at`); an in-process run of the same
  job, timed stage by stage, says where that time goes.
- Peak RSS: the worker's VmHWM after an `append` run (and a `mirror` run, 10 % of the
  sink deleted) of `--small`, `--rows` and, with `--rows-big`, that many rows (a fresh
  worker each).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from bench import common

SERVER = common.SERVER
BENCH_KEY = common.BENCH_FERNET_KEY
COLUMNS = (
    "id bigint, customer text, amount numeric(12,2), created_at timestamptz, attrs jsonb,"
    " active boolean"
)
CASES = (
    "append", "replace", "truncate", "upsert", "mirror", "csv", "parquet", "mariadb", "to-mariadb"
)  # fmt: skip
# The cases whose sink is keyed on id.
KEYED = ("upsert", "mirror")
# The cases of a PostgreSQL or CSV source into PostgreSQL or Parquet; `mariadb` and
# `to-mariadb` are bench/copy_mysql.py's sections.
PG_CASES = CASES[:-2]
# Set from --prefix in main(): the benchmark's three databases.
APP_DB = SRC_DB = DST_DB = ""


def set_prefix(prefix: str) -> None:
    global APP_DB, SRC_DB, DST_DB
    APP_DB, SRC_DB, DST_DB = prefix, f"{prefix}_src", f"{prefix}_dst"


set_prefix("dispatch_bench_copy")


def url(server: str, db: str) -> str:
    return common.db_url(server, db)


def connect(server: str, db: str) -> psycopg.Connection[Any]:
    return common.connect(server, db)


# The rows of every table: `rows` of them, of mixed types.
GENERATE = sql.SQL(
    "SELECT i::bigint AS id,"
    " 'customer-' || lpad((i %% 1000)::text, 4, '0') AS customer,"
    " ((i::bigint * 7919) %% 100000 / 100.0)::numeric(12,2) AS amount,"
    " timestamptz '2024-01-01' + i * interval '1 second' AS created_at,"
    " jsonb_build_object('tier', i %% 5, 'tags', jsonb_build_array('a', i %% 7)) AS attrs,"
    " i %% 3 = 0 AS active"
    " FROM generate_series(1, %s) AS i"
)


def ensure_source(server: str, table: str, rows: int) -> None:
    """`table` with `rows` rows of mixed types, made once per size (and analyzed)."""
    with connect(server, SRC_DB) as c:
        have = c.execute("SELECT to_regclass(%s)", [table]).fetchone()
        if have and have[0]:
            stats = c.execute(
                "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass", [table]
            ).fetchone()
            if stats == (rows,):
                return
        c.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
        c.execute(sql.SQL("CREATE TABLE {} AS ").format(sql.Identifier(table)) + GENERATE, [rows])
        c.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(table)))


def export_csv(server: str, table: str) -> Path:
    """The source table as a CSV file with a header."""
    path = common.csv_dir() / f"{table}.csv"
    with connect(server, SRC_DB) as c, path.open("wb") as f:
        stmt = sql.SQL("COPY {} TO STDOUT (FORMAT csv, HEADER)").format(sql.Identifier(table))
        with c.cursor().copy(stmt) as copy:
            for block in copy:
                f.write(block)
    return path


def env(server: str) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": url(server, APP_DB),
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DISPATCH_ENCRYPTION_KEYS": BENCH_KEY,
        "DISPATCH_CSV_BASE_DIRS": str(common.csv_dir()),
        "DISPATCH_PARQUET_BASE_DIRS": str(common.csv_dir()),
        "SECRET_KEY": "bench-only",
        "DEBUG": "false",
        "PYTHONUNBUFFERED": "1",
    }


def sink_spec(case: str, table: str) -> dict[str, Any]:
    sink = f"{table}_{case}"
    if case == "parquet":
        return {"path": sink, "mode": "replace"}
    if case in KEYED:
        return {"table": sink, "mode": case, "key": ["id"]}
    if case == "truncate":
        return {"table": sink, "mode": "replace", "truncate": True}
    return {"table": sink, "mode": "replace" if case == "replace" else "append"}


def setup_app(server: str, tables: list[str]) -> dict[tuple[str, str], Any]:
    """Migrate the benchmark's dispatch database; one binding per (case, source table)."""
    e = env(server)
    subprocess.run(
        [sys.executable, str(common.ROOT / "manage.py"), "migrate", "-v", "0"], env=e, check=True
    )
    os.environ.update({k: e[k] for k in e if k.startswith(("DATABASE", "DJANGO", "DISPATCH"))})
    os.environ["SECRET_KEY"] = e["SECRET_KEY"]
    import django

    django.setup()
    from django.db import connection

    from dispatch.models import Datasource, Job, JobBinding

    s = connection.settings_dict
    base = {"host": s["HOST"] or "127.0.0.1", "port": int(s["PORT"] or 5432), "user": s["USER"]}
    if s.get("PASSWORD"):
        base["password"] = s["PASSWORD"]
    sources = {
        "pg": Datasource.objects.update_or_create(
            name="bench-src", defaults={"kind": "postgresql", "config": {**base, "dbname": SRC_DB}}
        )[0],
        "csv": Datasource.objects.update_or_create(
            name="bench-csv",
            defaults={"kind": "csv", "config": {"base_dir": str(common.csv_dir())}},
        )[0],
    }
    dst = Datasource.objects.update_or_create(
        name="bench-dst", defaults={"kind": "postgresql", "config": {**base, "dbname": DST_DB}}
    )[0]
    parquet = Datasource.objects.update_or_create(
        name="bench-parquet",
        defaults={"kind": "parquet", "config": {"base_dir": str(common.csv_dir())}},
    )[0]
    bindings = {}
    for case in PG_CASES:
        for table in tables:
            name = f"bench-copy-{case}-{table}"
            source_spec = {"path": f"{table}.csv"} if case == "csv" else {"table": table}
            job, _ = Job.objects.update_or_create(
                name=name,
                defaults={
                    "source_spec": source_spec,
                    "sink_spec": sink_spec(case, table),
                    "max_attempts": 1,
                    "lease_seconds": 60,
                },
            )
            bindings[case, table], _ = JobBinding.objects.update_or_create(
                name=name,
                defaults={
                    "job": job,
                    "source": sources["csv" if case == "csv" else "pg"],
                    "sink": parquet if case == "parquet" else dst,
                },
            )
    return bindings


def reset_sink(server: str, table: str, *, key: bool, rows: int = 0) -> None:
    """A fresh sink table of the source's types (keyed on id for upsert), holding `rows`
    old rows (a replace has that many to remove)."""
    with connect(server, DST_DB) as c:
        ident = sql.Identifier(table)
        c.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(ident))
        c.execute(sql.SQL("CREATE TABLE {} (" + COLUMNS + ")").format(ident))  # type: ignore[operator]
        if key:
            c.execute(sql.SQL("ALTER TABLE {} ADD PRIMARY KEY (id)").format(ident))
        if rows:
            c.execute(sql.SQL("INSERT INTO {} ").format(ident) + GENERATE, [rows])
            c.execute(sql.SQL("VACUUM ANALYZE {}").format(ident))
        c.execute("DROP TABLE IF EXISTS dispatch_fence")


def old_rows(case: str, rows: int) -> int:
    """What the sink holds before a round: a replace replaces a table as large as the
    source (so the time to clear it counts); a mirror holds the source's rows and a tenth
    more, so that 10 % of its rows are deleted; the other cases start empty."""
    if case == "mirror":
        return rows + rows // 9
    return rows if case in ("replace", "truncate") else 0


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def count(server: str, table: str) -> int:
    with connect(server, DST_DB) as c:
        row = c.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()
    return int(row[0]) if row else -1


@contextlib.contextmanager
def worker(server: str, log_name: str) -> Iterator[tuple[common.Proc, psycopg.Connection[Any]]]:
    """A fresh `runworker --concurrency 1`, idle and listening, and an app connection."""
    proc = common.start(
        [
            sys.executable,
            str(common.ROOT / "manage.py"),
            "runworker",
            "--no-scheduler",
            "--concurrency",
            "1",
        ],
        env(server),
        log_name,
    )
    try:
        with connect(server, APP_DB) as app:
            # Idle and listening: its LISTEN connection heard its own probe.
            common.wait_for(
                lambda: "LISTEN self-probe answered" in proc.output(),
                timeout=60,
                what="the worker to listen",
                interval=0.005,
            )
            yield proc, app
    finally:
        common.stop_procs([proc])


def run_once(app: psycopg.Connection[Any], binding: Any, log: Path) -> tuple[float, Any]:
    """Trigger `binding`, wait for its run to finish; wall seconds and the run id."""
    from dispatch import services

    start = time.perf_counter()
    run = services.trigger(binding)
    status = common.wait_for(
        lambda: app.execute(
            "SELECT status FROM dispatch_run WHERE id = %s AND status IN "
            "('SUCCEEDED', 'FAILED', 'RETRY_SCHEDULED', 'CANCELLED')",
            [run.id],
        ).fetchone(),
        timeout=900,
        what="the run",
        interval=0.002,
    )[0]
    elapsed = time.perf_counter() - start
    if status != "SUCCEEDED":
        raise RuntimeError(f"run {run.id} ended {status}; see {log}")
    return elapsed, run.id


def parquet_rows(name: str) -> int:
    import pyarrow.dataset as pads

    return int(pads.dataset(str(common.csv_dir() / name), format="parquet").count_rows())


def worker_round(
    server: str, bindings: dict[tuple[str, str], Any], case: str, table: str, rows: int
) -> tuple[float, int]:
    """Seconds from trigger to SUCCEEDED with a fresh, idle worker; its peak RSS (KiB)."""
    sink = f"{table}_{case}"
    if case == "parquet":
        shutil.rmtree(common.csv_dir() / sink, ignore_errors=True)
    else:
        reset_sink(server, sink, key=case in KEYED, rows=old_rows(case, rows))
    with worker(server, f"copy-{sink}.log") as (proc, app):
        elapsed, _ = run_once(app, bindings[case, table], proc.log)
        peak = vm_hwm_kib(proc.popen.pid)
    got = parquet_rows(sink) if case == "parquet" else count(server, sink)
    if got != rows:
        raise RuntimeError(f"{sink} holds {got} rows, expected {rows}")
    return elapsed, peak


def raw_parquet(server: str, table: str, rows: int) -> float:
    """PostgreSQL -> Parquet with the raw tools: `psql` COPY ... TO STDOUT (CSV) into a
    file, then pyarrow's CSV reader (multi-threaded C++) and Parquet writer (zstd, as the
    connector's default)."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as papq

    spool = common.csv_dir() / f"{table}_raw.csv"
    out = common.csv_dir() / f"{table}_raw.parquet"
    start = time.perf_counter()
    with spool.open("wb") as f:
        subprocess.run(
            ["psql", "-X", "-q", url(server, SRC_DB), "-c",
             f"COPY (SELECT * FROM {table}) TO STDOUT (FORMAT csv, HEADER)"],
            stdout=f, check=True,
        )  # fmt: skip
    papq.write_table(pacsv.read_csv(spool), out, compression="zstd")
    elapsed = time.perf_counter() - start
    got = papq.ParquetFile(out).metadata.num_rows
    spool.unlink()
    out.unlink()
    if got != rows:
        raise RuntimeError(f"raw parquet wrote {got} rows, expected {rows}")
    return elapsed


def raw_round(server: str, case: str, table: str, rows: int) -> float:
    """The same work with psql alone."""
    if case == "parquet":
        return raw_parquet(server, table, rows)
    sink = f"{table}_{case}"
    reset_sink(server, sink, key=case in KEYED, rows=old_rows(case, rows))
    dst = url(server, DST_DB)
    # Constant identifiers (the benchmark's own table names), not user input.
    if case in ("replace", "truncate"):
        load = ["-1", "-c", f"TRUNCATE {sink}", "-c", f"COPY {sink} FROM STDIN"]
    elif case in KEYED:
        load = [
            "-1",
            "-c", f"CREATE TEMP TABLE staging (LIKE {sink}) ON COMMIT DROP",
            "-c", "COPY staging FROM STDIN",
            "-c", f"INSERT INTO {sink} SELECT * FROM staging ON CONFLICT (id) DO UPDATE SET "
            "customer = EXCLUDED.customer, amount = EXCLUDED.amount, "
            "created_at = EXCLUDED.created_at, attrs = EXCLUDED.attrs, active = EXCLUDED.active",
        ]  # fmt: skip
        if case == "mirror":
            load += [
                "-c", "ANALYZE staging",
                "-c", f"DELETE FROM {sink} t WHERE NOT EXISTS "
                "(SELECT FROM staging s WHERE s.id = t.id)",
            ]  # fmt: skip
    elif case == "csv":
        path = common.csv_dir() / f"{table}.csv"
        load = ["-c", f"\\copy {sink} FROM '{path}' (FORMAT csv, HEADER)"]
    else:
        load = ["-c", f"COPY {sink} FROM STDIN"]
    start = time.perf_counter()
    if case == "csv":
        subprocess.run(["psql", "-X", "-q", dst, *load], check=True, capture_output=True)
    else:
        out = subprocess.Popen(
            ["psql", "-X", "-q", url(server, SRC_DB), "-c",
             f"COPY (SELECT * FROM {table}) TO STDOUT"],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        subprocess.run(["psql", "-X", "-q", dst, *load], stdin=out.stdout, check=True,
                       capture_output=True)  # fmt: skip
        assert out.stdout is not None
        out.stdout.close()
        out.wait()
    elapsed = time.perf_counter() - start
    got = count(server, sink)
    if got != rows:
        raise RuntimeError(f"raw {case} left {got} rows in {sink}, expected {rows}")
    return elapsed


def fixed_cost(server: str, binding: Any, runs: int) -> dict[str, list[float]]:
    """A warm worker runs a 1-row job `runs` times: milliseconds in database time."""
    reset_sink(server, "orders_one_append", key=False)
    out: dict[str, list[float]] = {"trigger_ms": [], "claim_ms": [], "wall_ms": []}
    with worker(server, "copy-fixed.log") as (proc, app):
        run_once(app, binding, proc.log)  # warm: imports, first connections
        for _ in range(runs):
            wall, run_id = run_once(app, binding, proc.log)
            row = app.execute(
                "SELECT extract(epoch FROM r.finished_at - r.created_at) * 1000,"
                " extract(epoch FROM a.finished_at - a.claimed_at) * 1000"
                " FROM dispatch_run r JOIN dispatch_attempt a ON a.run_id = r.id"
                " WHERE r.id = %s",
                [run_id],
            ).fetchone()
            assert row is not None
            out["trigger_ms"].append(float(row[0]))
            out["claim_ms"].append(float(row[1]))
            out["wall_ms"].append(wall * 1000)
    return out


# --- where a 1-row run's time goes (in-process, timed stage by stage) ---------------------------
STAGES = (
    ("claim", "dispatch.worker.claims", "claim"),
    ("decrypt", "dispatch.security.crypto", "decrypt_config"),
    ("open reader", "dispatch.connectors.postgresql.reader", "_Reader.open"),
    ("open writer", "dispatch.connectors.postgresql.writer", "_Writer.open"),
    ("transfer", "dispatch.worker.runner", "Runner._transfer"),
    ("commit (fence)", "dispatch.connectors.postgresql.writer", "_Writer.commit"),
    ("close", "dispatch.connectors.postgresql.cancel", "_Canceller.close"),
    ("settle", "dispatch.worker.claims", "settle"),
)


def _timed(
    owner: Any, attr: str, label: str, spent: dict[str, float], static: bool = False
) -> Callable[[], None]:
    original = owner.__dict__[attr]
    fn = original.__func__ if static else original

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0

    setattr(owner, attr, staticmethod(wrapper) if static else wrapper)
    return lambda: setattr(owner, attr, original)


def split_fixed(binding: Any, runs: int) -> dict[str, float]:
    """Median milliseconds per stage of a 1-row run executed in this process."""
    import importlib

    from dispatch import services
    from dispatch.worker import claims
    from dispatch.worker.runner import ExecutionControl, Runner

    per: dict[str, list[float]] = {}
    for i in range(runs + 1):
        spent: dict[str, float] = {}
        undo = []
        for label, module, name in STAGES:
            owner: Any = importlib.import_module(module)
            attr = name
            if "." in name:
                cls, attr = name.split(".")
                owner = getattr(owner, cls)
            static = isinstance(owner.__dict__[attr], staticmethod)
            undo.append(_timed(owner, attr, label, spent, static))
        try:
            t0 = time.perf_counter()
            run = services.trigger(binding)
            spent["trigger"] = time.perf_counter() - t0
            (claimed,) = claims.claim("bench-split", run_id=run.id, limit=1, generic=False)
            t0 = time.perf_counter()
            status = Runner(claimed, ExecutionControl(claimed)).execute()
            spent["execute"] = time.perf_counter() - t0
        finally:
            for u in reversed(undo):
                u()
        if status != "SUCCEEDED":
            raise RuntimeError(f"in-process run ended {status}")
        if i == 0:
            continue  # warm-up
        for k, v in spent.items():
            per.setdefault(k, []).append(v * 1000)
    return {k: statistics.median(v) for k, v in per.items()}


def main(argv: list[str]) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=common.positive, default=1_000_000)
    p.add_argument("--small", type=common.positive, default=10_000)
    p.add_argument("--rows-big", type=int, default=0, help="also peak RSS at this many rows")
    p.add_argument("--fixed-runs", type=common.positive, default=30)
    p.add_argument("--cases", default=",".join(CASES), help="subset of " + ",".join(CASES))
    p.add_argument("--prefix", default="dispatch_bench_copy", help="names of the databases")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.small, args.rounds, args.fixed_runs = 50_000, 2_000, 1, 5
    cases = [c for c in args.cases.split(",") if c]
    if not set(cases) <= set(CASES):
        raise SystemExit(f"--cases: unknown {sorted(set(cases) - set(CASES))}")
    if shutil.which("psql") is None:
        raise SystemExit("psql is needed for the raw side")
    set_prefix(args.prefix)
    if "mariadb" in cases:
        from bench import copy_mysql

        copy_mysql.section(args.server, rows=args.rows, small=args.small,
                           mid=min(100_000, args.rows), rounds=args.rounds,
                           argv=["copy", *argv], doc=not args.no_doc)  # fmt: skip
        cases.remove("mariadb")
    if "to-mariadb" in cases:
        from bench import copy_mysql

        copy_mysql.sink_section(args.server, rows=args.rows, small=args.small,
                                mid=min(100_000, args.rows), rounds=args.rounds,
                                argv=["copy", *argv], doc=not args.no_doc)  # fmt: skip
        cases.remove("to-mariadb")
    if not cases:
        return 0
    report = common.Report(
        f"Single stream against the raw pipe ({args.rows:,} rows)", ["copy", *argv], args.server
    )
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    for db in (APP_DB, SRC_DB, DST_DB):
        common.ensure_database(args.server, db)
    sizes = {"orders_one": 1, "orders_small": args.small, "orders": args.rows}
    if args.rows_big:
        sizes["orders_big"] = args.rows_big
    for table, n in sizes.items():
        ensure_source(args.server, table, n)
    if "csv" in cases:
        export_csv(args.server, "orders")
    bindings = setup_app(args.server, list(sizes))

    # Throughput, each case against its raw equivalent, alternated.
    speed_rows = []
    ratios: dict[str, float] = {}
    for case in cases:
        res = common.alternate(
            args.rounds,
            {
                "worker": lambda c=case: worker_round(
                    args.server, bindings, c, "orders", args.rows
                ),
                "raw": lambda c=case: raw_round(args.server, c, "orders", args.rows),
            },
        )
        w = [x[0] for x in res["worker"]]
        ratio = common.Spread([r / x for r, x in zip(res["raw"], w, strict=True)])
        ratios[case] = ratio.median
        goal = 0.9 if case in ("upsert", "mirror", "csv") else 0.95
        # Parquet has no goal: its raw side is another program (pyarrow's C++ CSV reader).
        verdict = (
            ""
            if case == "parquet"
            else f" (goal >= {goal}: {common.verdict(ratio.median >= goal)})"
        )
        speed_rows.append(
            [
                case,
                common.Spread(w).fmt(3),
                common.Spread(res["raw"]).fmt(3),
                f"{ratio.fmt()}{verdict}",
            ]
        )
        print(f"{case}: {speed_rows[-1]}", flush=True)

    # The fixed cost of a run.
    fixed = fixed_cost(args.server, bindings["append", "orders_one"], args.fixed_runs)
    split = split_fixed(bindings["append", "orders_one"], args.fixed_runs)
    trig = common.Spread(fixed["trigger_ms"])

    # Peak RSS as the rows grow (append, a fresh worker each).
    rss: list[tuple[int, float]] = []
    for table, n in sizes.items():
        if table == "orders_one":
            continue
        _, peak = worker_round(args.server, bindings, "append", table, n)
        rss.append((n, peak / 1024))
        print(f"rss at {n:,} rows: {peak / 1024:.1f} MiB", flush=True)
    flat = max(m for _, m in rss) / min(m for _, m in rss)
    # The same for mirror (its deletes run on the sink's server: the worker stays flat).
    mirror_rss: list[tuple[int, float]] = []
    for table, n in sizes.items():
        if table == "orders_one" or "mirror" not in cases:
            continue
        _, peak = worker_round(args.server, bindings, "mirror", table, n)
        mirror_rss.append((n, peak / 1024))
        print(f"mirror rss at {n:,} rows: {peak / 1024:.1f} MiB", flush=True)
    # The same for PostgreSQL -> Parquet (row groups streamed: memory flat as well).
    rss_parquet: list[tuple[int, float]] = []
    if "parquet" in cases:
        for table, n in sizes.items():
            if table != "orders_one":
                _, peak = worker_round(args.server, bindings, "parquet", table, n)
                rss_parquet.append((n, peak / 1024))
                print(f"parquet rss at {n:,} rows: {peak / 1024:.1f} MiB", flush=True)

    report.add(
        f"Rows: `{COLUMNS}`, {args.rows:,} of them; each sink table exists with the same "
        "types (keyed on `id` for upsert and mirror); it is empty, except for replace "
        "(default: `DELETE`; `truncate`: the spec's `truncate: true`), where it holds as "
        "many old rows as the source, and mirror, where it holds those and a ninth more "
        "(deleted by the run: 10 % of the sink). A fresh `runworker --concurrency 1` "
        "per worker round, listening before the trigger; time = trigger -> SUCCEEDED (wall "
        "clock, seen in `dispatch_run`: the run's fixed cost included). Raw: `psql` alone "
        "doing the same work (text COPY out | COPY in; replace: TRUNCATE + COPY in one "
        "transaction; upsert: COPY into a staging table + `INSERT ... ON CONFLICT (id) DO "
        "UPDATE`; mirror: that, then `DELETE ... WHERE NOT EXISTS` (the staging table); CSV: `psql -c \"\\copy ... FROM 'file' (FORMAT csv, HEADER)\"`). "
        f"{args.rounds} alternated rounds; seconds as median (min-max)."
    )
    report.add(common.table(["case", "worker s", "raw s", "raw / worker"], speed_rows))
    report.add(
        f"Fixed cost of a run (a 1-row `append` job, {args.fixed_runs} runs on one warm "
        f"worker, database time): trigger -> SUCCEEDED **{trig.fmt(1)} ms** (goal <= 20: "
        f"{common.verdict(trig.median <= 20)}); claim -> settle "
        f"{common.Spread(fixed['claim_ms']).fmt(1)} ms; trigger call -> SUCCEEDED seen by "
        f"the benchmark's 2 ms poll {common.Spread(fixed['wall_ms']).fmt(1)} ms.\n\n"
        "Where a 1-row run's time goes (the same job executed in the benchmark's process, "
        "each stage timed, median ms):\n\n"
        + common.table(
            ["stage", "ms"],
            [[k, f"{v:.2f}"] for k, v in split.items()],
        )
    )
    report.add(
        "Peak RSS (VmHWM) of a fresh worker after one `append` run: "
        + ", ".join(f"{m:.1f} MiB at {n:,} rows" for n, m in rss)
        + f"; largest / smallest **{flat:.2f}** (flat: {common.verdict(flat <= 1.25)})."
    )
    if mirror_rss:
        mirror_flat = max(m for _, m in mirror_rss) / min(m for _, m in mirror_rss)
        report.add(
            "Peak RSS of a fresh worker after one `mirror` run (the sink holds the source's "
            "rows and a ninth more, so a tenth of its rows are deleted): "
            + ", ".join(f"{m:.1f} MiB at {n:,} rows" for n, m in mirror_rss)
            + f"; largest / smallest **{mirror_flat:.2f}** "
            f"(flat: {common.verdict(mirror_flat <= 1.25)})."
        )
    if rss_parquet:
        flat_parquet = max(m for _, m in rss_parquet) / min(m for _, m in rss_parquet)
        report.add(
            "The same after one PostgreSQL -> `parquet` run: "
            + ", ".join(f"{m:.1f} MiB at {n:,} rows" for n, m in rss_parquet)
            + f"; largest / smallest **{flat_parquet:.2f}**."
        )
    report.emit(doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
