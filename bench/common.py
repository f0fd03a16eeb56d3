"""Shared helpers of the benchmarks: databases, fixtures in bulk, worker processes, the
peer (Procrastinate), side-by-side rounds, and the report appended to docs/benchmarks.md.

Every figure a benchmark reports is a ratio of two things measured in the same run,
alternated over several rounds (A B, then B A), as a median with its min-max: a bare time
on a shared machine says little.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import logging
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
PLOTS = ROOT / "docs" / "benchmarks"
RESULTS = ROOT / "bench" / "results"  # worker logs of the last run (git-ignored)
SERVER = "postgres://postgres@127.0.0.1:5432"
DISPATCH_DB = "dispatch_bench"
PEER_DB = "procrastinate_bench"
# A throwaway key for the benchmark databases only: their datasources hold no secret.
BENCH_FERNET_KEY = "YmVuY2gtb25seS1rZXktbm90LWEtc2VjcmV0LTEyMzQ="


# --- command line -----------------------------------------------------------------------
def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=description)
    p.add_argument("--server", default=SERVER, help=f"PostgreSQL server URL (default {SERVER})")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds (default 3)")
    p.add_argument(
        "--quick", action="store_true", help="small sizes, to check the code (not for the doc)"
    )
    p.add_argument("--no-doc", action="store_true", help="print only; do not append to the doc")
    return p


def positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return n


# --- databases --------------------------------------------------------------------------
def db_url(server: str, dbname: str) -> str:
    return f"{server.rstrip('/')}/{dbname}"


def connect(server: str, dbname: str, **kwargs: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(db_url(server, dbname), autocommit=True, **kwargs)


def ensure_database(server: str, dbname: str, *, template: str | None = None) -> bool:
    """Create `dbname` if missing; True if it was created."""
    with connect(server, "postgres") as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [dbname]).fetchone():
            return False
        stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname))
        if template:
            stmt += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        conn.execute(stmt)
        return True


def drop_database(server: str, dbname: str) -> None:
    with connect(server, "postgres") as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
        )


def csv_dir() -> Path:
    """Where the CSV benchmark's files live: outside the checkout, which the CSV connector
    refuses (Python imports from it; docs/security.md)."""
    from project.dev import private_temp_dir

    return private_temp_dir("bench-csv")


def setup_django(server: str, dbname: str = DISPATCH_DB) -> dict[str, str]:
    """Point Django at the benchmark database, migrate it, and return the environment the
    worker processes get (the same settings, production defaults otherwise)."""
    ensure_database(server, dbname)
    env = {
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DATABASE_URL": db_url(server, dbname),
        "SECRET_KEY": "bench-only",
        # Production settings: a development .env may say DEBUG=true, which would wrap
        # every cursor in Django's query-logging wrapper.
        "DEBUG": "false",
        "DISPATCH_ENCRYPTION_KEYS": BENCH_FERNET_KEY,
        "DISPATCH_CONNECTORS": "bench.common.LoopbackConnector",
        "DISPATCH_CSV_BASE_DIRS": str(csv_dir()),
        "PYTHONUNBUFFERED": "1",
    }
    os.environ.update(env)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    # The benchmark's own triggers need no log line each; the workers keep their logging.
    logging.getLogger("dispatch").setLevel(logging.WARNING)
    return {**os.environ, **env}


def reset_dispatch(conn: psycopg.Connection[Any]) -> None:
    """Empty every dispatch table (bindings included): each round starts alike."""
    conn.execute(
        "TRUNCATE dispatch_attempt, dispatch_run, dispatch_worker, dispatch_jobbinding, "
        "dispatch_job, dispatch_datasource CASCADE"
    )


def make_bindings(
    n: int,
    *,
    max_concurrency: int,
    prefix: str = "bench",
    opposite_roles: bool = False,
    lease_seconds: int = 30,
) -> list[Any]:
    """`n` bindings of one no-op job (generate 0 rows -> null), through the models (the
    config is encrypted as in production). With `opposite_roles`, the bindings use loopback
    datasources in pairs swapped source <-> sink, so two claims lock the same two
    datasources from opposite sides."""
    from dispatch.models import Datasource, Job, JobBinding

    job = Job.objects.create(
        name=f"{prefix}-job",
        source_spec={"rows": 0} if not opposite_roles else {},
        sink_spec={},
        max_attempts=3,
        backoff_seconds=0.0,
        backoff_max_seconds=0.0,
        lease_seconds=lease_seconds,
    )
    bindings = []
    if opposite_roles:
        pool = [
            Datasource.objects.create(name=f"{prefix}-loop-{i}", kind="loopback", config={})
            for i in range(max(2, n // 4))
        ]
        for i in range(n):
            a, b = pool[(i // 2) % len(pool)], pool[(i // 2 + 1) % len(pool)]
            src, snk = (a, b) if i % 2 == 0 else (b, a)
            bindings.append(
                JobBinding.objects.create(
                    name=f"{prefix}-{i}",
                    job=job,
                    source=src,
                    sink=snk,
                    max_concurrency=max_concurrency,
                )
            )
        return bindings
    for i in range(n):
        src = Datasource.objects.create(name=f"{prefix}-gen-{i}", kind="generate", config={})
        snk = Datasource.objects.create(name=f"{prefix}-null-{i}", kind="null", config={})
        bindings.append(
            JobBinding.objects.create(
                name=f"{prefix}-{i}",
                job=job,
                source=src,
                sink=snk,
                max_concurrency=max_concurrency,
            )
        )
    return bindings


def bulk_runs(
    conn: psycopg.Connection[Any],
    n: int,
    *,
    status: str = "PENDING",
    offset: int = 0,
) -> None:
    """`n` runs with their attempt 1, spread round-robin over every binding, in two
    INSERT ... SELECT generate_series statements (what `trigger` writes, without the
    wake-up). `status` PENDING: due now; SUCCEEDED: finished history; RUNNING: held by a
    worker that is gone (lease already expired, tokens from the real sequence)."""
    run_status = "PENDING" if status == "PENDING" else status
    with conn.transaction():
        conn.execute("CREATE TEMP TABLE IF NOT EXISTS bench_ids (i int, run uuid, binding uuid)")
        conn.execute("TRUNCATE bench_ids")
        conn.execute(
            """
            INSERT INTO bench_ids
            SELECT g, gen_random_uuid(), b.ids[1 + (g %% cardinality(b.ids))]
              FROM generate_series(%(lo)s::int, %(hi)s::int) g,
                   (SELECT array_agg(id ORDER BY name) AS ids FROM dispatch_jobbinding) b
            """,
            {"lo": offset + 1, "hi": offset + n},
        )
        conn.execute(
            """
            INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at,
                                      finished_at, requested_by)
            SELECT run, binding, 'API', %(status)s::text,
                   clock_timestamp() - make_interval(secs => 3600 - i * 1e-4),
                   CASE WHEN %(status)s::text = 'SUCCEEDED' THEN clock_timestamp() END, 'bench'
              FROM bench_ids
            """,
            {"status": run_status},
        )
        # available_at strictly increasing with i, so "oldest first" drains in order.
        conn.execute(
            """
            INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at,
                available_at, error, rows_read, rows_written, worker_id, lease_token,
                lease_until, claimed_at, heartbeat_at, finished_at)
            SELECT gen_random_uuid(), run, 1, 'TRIGGER', %(status)s::text,
                   clock_timestamp() - make_interval(secs => 3600 - i * 1e-4),
                   clock_timestamp() - make_interval(secs => 3600 - i * 1e-4), '', 0, 0,
                   CASE WHEN %(status)s::text <> 'PENDING' THEN 'gone:1' END,
                   CASE WHEN %(status)s::text <> 'PENDING' THEN nextval('dispatch_lease_token_seq') END,
                   CASE WHEN %(status)s::text <> 'PENDING' THEN clock_timestamp() - interval '1 minute' END,
                   CASE WHEN %(status)s::text <> 'PENDING' THEN clock_timestamp() - interval '2 minutes' END,
                   CASE WHEN %(status)s::text <> 'PENDING' THEN clock_timestamp() - interval '2 minutes' END,
                   CASE WHEN %(status)s::text = 'SUCCEEDED' THEN clock_timestamp() END
              FROM bench_ids
            """,
            {"status": status},
        )
        conn.execute("TRUNCATE bench_ids")


# --- processes --------------------------------------------------------------------------
@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start(argv: Sequence[str], env: dict[str, str], log_name: str) -> Proc:
    RESULTS.mkdir(parents=True, exist_ok=True)
    log = RESULTS / log_name
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            list(argv), env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )
    return Proc(popen, log)


def start_workers(
    n: int, concurrency: int, env: dict[str, str], *, burst: bool, tag: str
) -> list[Proc]:
    args = [
        sys.executable,
        str(ROOT / "manage.py"),
        "runworker",
        "--no-scheduler",
        "--concurrency",
        str(concurrency),
    ]
    if burst:
        args.append("--burst")
    return [start([*args, "--worker-id", f"{tag}-{i}"], env, f"{tag}-{i}.log") for i in range(n)]


def wait_procs(procs: Sequence[Proc], timeout: float) -> None:
    """Wait for every process to exit by itself; fail (killing them) past `timeout`."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop_procs(procs, sig=signal.SIGKILL)
            raise RuntimeError(f"{p.log.name} did not finish within {timeout}s") from None
    bad = [p for p in procs if p.popen.returncode != 0]
    if bad:
        raise RuntimeError(
            f"{bad[0].log.name} exited {bad[0].popen.returncode}:\n" + bad[0].output()[-2000:]
        )


def stop_procs(procs: Sequence[Proc], *, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(sig)
    for p in procs:
        try:
            p.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait(5)


def wait_for(
    predicate: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.02
) -> Any:
    """Poll an observable state (a database count) until true, with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# --- the server's own counters ----------------------------------------------------------------
# Seconds PostgreSQL may hold a backend's counters before publishing them (its idle
# statistics flush interval is 10 s).
STATS_SETTLE = 11.0


def counters(server: str, dbname: str) -> dict[str, int]:
    """Transactions, buffers and tuples read so far in `dbname` (pg_stat_database)."""
    with connect(server, "postgres") as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        xact, blks, tup = conn.execute(
            "SELECT xact_commit + xact_rollback, blks_hit + blks_read,"
            " tup_returned + tup_fetched FROM pg_stat_database WHERE datname = %s",
            [dbname],
        ).fetchone()
    return {"xact": int(xact), "blks": int(blks), "tup": int(tup)}


def delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in a}


# --- CPU: where a benchmark's time goes -----------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int, *, children: bool = False) -> float | None:
    """user + system seconds of a live process (with its reaped children's if asked)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICK


def server_cpu(server: str) -> float | None:
    """CPU seconds the PostgreSQL server has used so far (the postmaster with its reaped
    backends, plus every live child), when it runs on this machine; else None."""
    with connect(server, "postgres") as conn:
        (backend,) = conn.execute("SELECT pg_backend_pid()").fetchone()
        try:
            stat = Path(f"/proc/{backend}/stat").read_text()
        except OSError:
            return None
    postmaster = int(stat.rsplit(")", 1)[1].split()[1])
    total = _proc_cpu(postmaster, children=True) or 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == postmaster:
            total += _proc_cpu(int(entry.name)) or 0.0
    return total


def cpu_seconds(procs: Sequence[Proc], server: str = SERVER) -> dict[str, float | None]:
    """CPU seconds so far of the benchmark's worker processes and of the server."""
    workers = [_proc_cpu(p.popen.pid) for p in procs]
    return {
        "workers": sum(w for w in workers if w is not None),
        "server": server_cpu(server),
    }


def wait_procs_cpu(
    procs: Sequence[Proc], timeout: float, server: str = SERVER
) -> dict[str, float | None]:
    """`wait_procs`, returning the CPU seconds the processes used in all (from their
    resource usage at exit) and the server's after they exited."""
    deadline = time.monotonic() + timeout
    used = 0.0
    for p in procs:
        while True:
            pid, status, usage = os.wait4(p.popen.pid, os.WNOHANG)
            if pid:
                p.popen.returncode = os.waitstatus_to_exitcode(status)
                used += usage.ru_utime + usage.ru_stime
                break
            if time.monotonic() > deadline:
                stop_procs(procs, sig=signal.SIGKILL)
                raise RuntimeError(f"{p.log.name} did not finish within {timeout}s")
            time.sleep(0.05)
    wait_procs(procs, timeout=1)  # exit codes checked as usual
    return {"workers": used, "server": server_cpu(server)}


def cpu_per_run(
    before: dict[str, float | None], after: dict[str, float | None], n: int
) -> dict[str, float | None]:
    """Milliseconds of CPU per run, workers and server, between two readings."""
    out: dict[str, float | None] = {}
    for key in ("workers", "server"):
        a, b = before[key], after[key]
        out[f"{key}_ms"] = None if a is None or b is None else (b - a) * 1000 / n
    return out


# --- the peer: Procrastinate ------------------------------------------------------------
def peer_app(url: str) -> Any:
    """A Procrastinate app with one async no-op task (its fastest kind of task)."""
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))

    @app.task(name="noop")
    async def noop() -> None:
        return None

    return app


def ensure_peer_schema(server: str) -> None:
    created = ensure_database(server, PEER_DB)
    with connect(server, PEER_DB) as conn:
        exists = conn.execute("SELECT to_regclass('procrastinate_jobs')").fetchone()[0]
        if created or exists is None:
            from procrastinate import schema

            conn.execute(schema.SchemaManager.get_schema())


def reset_peer(server: str) -> None:
    with connect(server, PEER_DB) as conn:
        conn.execute(
            "TRUNCATE procrastinate_events, procrastinate_periodic_defers, procrastinate_jobs, "
            "procrastinate_workers CASCADE"
        )


def peer_defer(server: str, n: int, *, batch: int = 1000) -> None:
    """Enqueue `n` no-op jobs with Procrastinate's own batch defer (one statement per
    `batch` jobs)."""
    app = peer_app(db_url(server, PEER_DB))

    async def go() -> None:
        async with app.open_async():
            task = app.tasks["noop"]
            for lo in range(0, n, batch):
                await task.batch_defer_async(*[{} for _ in range(min(batch, n - lo))])

    asyncio.run(go())


def peer_worker_main(url: str, concurrency: int, wait: bool) -> None:
    """Entry point of a peer worker process (`python -c`): Procrastinate's own worker."""
    app = peer_app(url)
    with app.open():
        app.run_worker(concurrency=concurrency, wait=wait, listen_notify=True)


def start_peer_workers(
    server: str, n: int, concurrency: int, *, wait: bool, tag: str
) -> list[Proc]:
    code = (
        "import sys; from bench.common import peer_worker_main; "
        "peer_worker_main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == '1')"
    )
    url = db_url(server, PEER_DB)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return [
        start(
            [sys.executable, "-c", code, url, str(concurrency), "1" if wait else "0"],
            env,
            f"{tag}-{i}.log",
        )
        for i in range(n)
    ]


# --- a connector for the contention benchmark -----------------------------------------------
def _loopback() -> type:
    from dispatch.connectors.base import (
        Connector,
        SimpleReader,
        WriteResult,
        check_unknown,
        require_object,
    )

    class _Writer:
        def write(self, batch: list[Any]) -> int:
            return len(batch)

        def commit(self) -> WriteResult:
            return WriteResult(rows_written=0)

    class Loopback(Connector):
        """A datasource that can be a source and a sink: reads nothing, discards all."""

        kind = "loopback"
        label = "Loopback (benchmarks)"
        roles = frozenset({"source", "sink"})

        @classmethod
        def validate_source_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
            check_unknown(require_object(spec, "source_spec"), set())
            return spec

        @classmethod
        def validate_sink_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
            check_unknown(require_object(spec, "sink_spec"), set())
            return spec

        @classmethod
        @contextlib.contextmanager
        def open_reader(cls, config: Any, spec: Any, ctx: Any) -> Iterator[Any]:
            yield SimpleReader(columns=[])

        @classmethod
        @contextlib.contextmanager
        def open_writer(cls, config: Any, spec: Any, ctx: Any, columns: Any) -> Iterator[Any]:
            yield _Writer()

    Loopback.__qualname__ = Loopback.__name__ = "LoopbackConnector"
    Loopback.__module__ = __name__
    return Loopback


def __getattr__(name: str) -> Any:
    # Built on first use: dispatch's modules need Django set up, this module does not.
    if name == "LoopbackConnector":
        cls = _loopback()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


# --- statistics ---------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


@dataclass
class Spread:
    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    def fmt(self, digits: int = 2) -> str:
        if not self.values:
            return "n/a"
        if len(self.values) == 1:
            return f"{self.values[0]:.{digits}f}"
        return f"{self.median:.{digits}f} ({min(self.values):.{digits}f}-{max(self.values):.{digits}f})"


def alternate(rounds: int, cases: dict[str, Callable[[], Any]]) -> dict[str, list[Any]]:
    """Run every case once per round, order reversed every other round (A B, B A, ...), so
    a drift of the machine's load weighs on each side alike."""
    names = list(cases)
    results: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            print(f"  round {r + 1}/{rounds}: {name} ...", flush=True)
            results[name].append(cases[name]())
    return results


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# --- report -------------------------------------------------------------------------------
def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def machine(server: str) -> dict[str, str]:
    with connect(server, "postgres") as conn:
        pg = conn.execute("SHOW server_version").fetchone()[0]
    mem_kb = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    load = os.getloadavg()
    return {
        "cores": str(os.cpu_count()),
        "memory": f"{mem_kb / 1024 / 1024:.0f} GiB",
        "postgresql": pg,
        "load": f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        "python": platform.python_version(),
        "versions": ", ".join(f"{d} {_version(d)}" for d in ("Django", "psycopg", "procrastinate")),
    }


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


@dataclass
class Report:
    title: str
    argv: list[str]
    server: str
    load_before: str = ""
    blocks: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.load_before = machine(self.server)["load"]

    def add(self, text: str) -> None:
        self.blocks.append(text.strip("\n"))

    def render(self) -> str:
        m = machine(self.server)
        when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python -m bench " + " ".join(shlex.quote(a) for a in self.argv)
        head = [
            f"## {self.title}",
            "",
            f"`{command}` — {when}",
            "",
            f"Machine: {m['cores']} cores, {m['memory']}, PostgreSQL {m['postgresql']} on "
            f"127.0.0.1, Python {m['python']}; {m['versions']}. Load average (1/5/15 min) "
            f"{self.load_before} before, {m['load']} after (the machine is shared).",
            "",
        ]
        return "\n".join(head) + "\n" + "\n\n".join(self.blocks) + "\n"

    def emit(self, *, doc: bool) -> None:
        text = self.render()
        print("\n" + text, flush=True)
        if doc:
            DOC.parent.mkdir(parents=True, exist_ok=True)
            if not DOC.exists():
                DOC.write_text(DOC_INTRO)
            with DOC.open("a") as f:
                f.write("\n" + text)


# The head of docs/benchmarks.md when a benchmark writes it first.
DOC_INTRO = (
    "# Benchmarks\n\nEach section is appended by one run of `python -m bench NAME` (`make "
    "bench` runs them all). Every figure is a ratio of two things measured side by side in "
    "the same run, alternated over several rounds, as a median with its min-max.\n"
)


def plot_path(name: str) -> Path:
    PLOTS.mkdir(parents=True, exist_ok=True)
    return PLOTS / name


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
