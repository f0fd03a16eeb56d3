"""A big table copied PostgreSQL -> PostgreSQL as one stream, and as 2, 4 and 8 slices,
by two real `runworker` processes.

    .venv/bin/python -m bench slices [--rows 10000000] [--rounds 3] [--concurrency 4]
                                     [--no-doc] [--quick]

Rows of mixed types (bigint, text, numeric, timestamptz, jsonb, boolean), made by one
INSERT ... SELECT generate_series. Each round starts two fresh workers (`--concurrency`
slots each), waits until both listen, triggers one run, and times it from the trigger to
the run's SUCCEEDED in database time (`dispatch_run.created_at` to `finished_at`: for a
sliced run, to the settlement of its last slice). The cases alternate in each round
(1, 2, 4, 8 slices, then reversed). While a run copies, the CPU time of the workers and
of the PostgreSQL backends of the three databases is sampled from /proc, beside the
machine's busy time from /proc/stat: what limits the speed-up on a small machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from bench import common
from bench.copy_pg import connect, url, vm_hwm_kib

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
SERVER = "postgres://postgres@127.0.0.1:5432"
APP_DB = "dispatch_bench_slices"
SRC_DB, DST_DB = "dispatch_bench_slices_src", "dispatch_bench_slices_dst"
# A throwaway key for the benchmark's own database: its datasources hold no secret.
BENCH_KEY = "YmVuY2gtc2xpY2VzLWtleS1ub3QtYS1zZWNyZXQtMTI="
TABLE, COPY = "events", "events_copy"
COLUMNS = (
    "id bigint, customer text, amount numeric(12,2), created_at timestamptz, "
    "payload jsonb, active boolean"
)
CASES = (1, 2, 4, 8)  # 1: one stream (no slices)
TICK = os.sysconf("SC_CLK_TCK")


def ensure_source(server: str, rows: int) -> None:
    with connect(server, SRC_DB) as c:
        have = c.execute("SELECT to_regclass(%s)", [TABLE]).fetchone()
        if have and have[0]:
            n = c.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(TABLE)))
            if n.fetchone() == (rows,):
                return
        c.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(TABLE)))
        c.execute(sql.SQL("CREATE TABLE {} (" + COLUMNS + ")").format(sql.Identifier(TABLE)))  # type: ignore[operator]
        c.execute(
            sql.SQL(
                "INSERT INTO {} SELECT i, 'customer-' || lpad((i %% 1000)::text, 4, '0'),"
                " ((i * 7919) %% 100000 / 100.0)::numeric(12,2),"
                " timestamptz '2024-01-01' + i * interval '1 second',"
                " jsonb_build_object('n', i, 'tag', 't' || (i %% 97), 'ok', i %% 2 = 0),"
                " i %% 3 = 0"
                " FROM generate_series(1::bigint, %s) AS i"
            ).format(sql.Identifier(TABLE)),
            [rows],
        )
        c.execute(sql.SQL("ALTER TABLE {} ADD PRIMARY KEY (id)").format(sql.Identifier(TABLE)))
        c.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(TABLE)))


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


def setup_app(server: str, slots: int) -> dict[int, Any]:
    """Migrate the benchmark's dispatch database; one binding per case (its job's source
    spec sliced into that many slices, or not)."""
    e = env(server)
    subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "migrate", "-v", "0"], env=e, check=True
    )
    for k in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE", "DISPATCH_ENCRYPTION_KEYS", "SECRET_KEY"):
        os.environ[k] = e[k]
    import django

    django.setup()
    from django.db import connection

    from dispatch.models import Datasource, Job, JobBinding

    s = connection.settings_dict
    base = {"host": s["HOST"] or "127.0.0.1", "port": int(s["PORT"] or 5432), "user": s["USER"]}
    if s.get("PASSWORD"):
        base["password"] = s["PASSWORD"]
    src, _ = Datasource.objects.get_or_create(
        name="bench-slices-src",
        defaults={"kind": "postgresql", "config": {**base, "dbname": SRC_DB}},
    )
    dst, _ = Datasource.objects.get_or_create(
        name="bench-slices-dst",
        defaults={"kind": "postgresql", "config": {**base, "dbname": DST_DB}},
    )
    bindings = {}
    for n in CASES:
        source: dict[str, Any] = {"table": TABLE, "statement_timeout_seconds": 3600}
        if n > 1:
            source["slices"] = {"key": "id", "count": n}
        job, _ = Job.objects.update_or_create(
            name=f"bench-slices-{n}",
            defaults={
                "source_spec": source,
                "sink_spec": {"table": COPY, "mode": "append"},
                "max_attempts": 1,
                "lease_seconds": 60,
            },
        )
        bindings[n], _ = JobBinding.objects.update_or_create(
            name=f"bench-slices-{n}",
            defaults={"job": job, "source": src, "sink": dst, "max_concurrency": slots},
        )
    return bindings


def reset_sink(server: str) -> None:
    with connect(server, DST_DB) as c:
        c.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(COPY)))
        c.execute(sql.SQL("CREATE TABLE {} (" + COLUMNS + ")").format(sql.Identifier(COPY)))  # type: ignore[operator]
        c.execute("DROP TABLE IF EXISTS dispatch_fence, dispatch_slice_commit")
        c.execute("CHECKPOINT")


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of a process (its threads included), in clock ticks; None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return int(fields[11]) + int(fields[12])


def machine_busy() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot (/proc/stat's first line)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


@dataclass
class Sampler:
    """CPU seconds of the workers and of the benchmark's PostgreSQL backends, by sampling
    /proc every `every` seconds (a backend that ends between two samples loses at most
    its last interval's time)."""

    workers: list[int]
    every: float = 0.2
    backend: dict[int, int] = field(default_factory=dict)  # pid -> last ticks seen
    worker_start: dict[int, int] = field(default_factory=dict)
    worker_last: dict[int, int] = field(default_factory=dict)
    busy0: tuple[int, int] = (0, 0)
    busy1: tuple[int, int] = (0, 0)
    samples: int = 0
    wall: float = 0.0  # seconds from start() to stop()

    def start(self) -> None:
        self.wall = time.monotonic()
        self.busy0 = machine_busy()
        for pid in self.workers:
            self.worker_start[pid] = self.worker_last[pid] = cpu_ticks(pid) or 0

    def sample(self, app: psycopg.Connection[Any]) -> None:
        pids = app.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = ANY(%s) AND pid <> pg_backend_pid()",
            [[SRC_DB, DST_DB, APP_DB]],
        ).fetchall()
        for (pid,) in pids:
            ticks = cpu_ticks(pid)
            if ticks is not None:
                # A backend first seen mid-run: what it used before counts (it started in
                # this round: the workers connect per attempt).
                self.backend[pid] = max(ticks, self.backend.get(pid, 0))
        for pid in self.workers:
            ticks = cpu_ticks(pid)
            if ticks is not None:
                self.worker_last[pid] = ticks
        self.samples += 1

    def stop(self) -> None:
        self.busy1 = machine_busy()
        self.wall = time.monotonic() - self.wall

    @property
    def worker_seconds(self) -> float:
        return sum(self.worker_last[p] - self.worker_start[p] for p in self.workers) / TICK

    @property
    def server_seconds(self) -> float:
        return sum(self.backend.values()) / TICK

    @property
    def machine_seconds(self) -> float:
        return (self.busy1[0] - self.busy0[0]) / TICK


@dataclass
class Round:
    case: int
    seconds: float  # trigger -> SUCCEEDED, database time
    peak_kib: int  # the larger VmHWM of the two workers
    worker_cpu: float
    server_cpu: float
    machine_cpu: float
    wall: float  # the sampler's window (trigger to the poll that saw SUCCEEDED)


LOG = ROOT / "bench" / "results" / "slices-worker.log"


def listening(offset: int) -> list[str]:
    """The workers' "listening" lines logged since `offset` (bytes into the log)."""
    with LOG.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return [line for line in text.splitlines() if "LISTEN self-probe answered" in line]


def start_workers(server: str, concurrency: int) -> list[subprocess.Popen[bytes]]:
    log = open(LOG, "ab")  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "manage.py"),
                "runworker",
                "--no-scheduler",
                "--concurrency",
                str(concurrency),
            ],
            env=env(server),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for _ in range(2)
    ]
    log.close()
    return procs


def one_round(server: str, binding: Any, case: int, rows: int, concurrency: int) -> Round:
    from dispatch import services

    reset_sink(server)
    offset = LOG.stat().st_size if LOG.exists() else 0
    procs = start_workers(server, concurrency)
    try:
        with connect(server, APP_DB) as app:
            # Both listening: each logs its LISTEN self-probe's answer, naming its pid.
            common.wait_for(
                lambda: all(any(f":{p.pid}:" in line for line in listening(offset)) for p in procs),
                timeout=60,
                what="both workers to listen",
            )
            sampler = Sampler([p.pid for p in procs])
            sampler.start()
            run = services.trigger(binding)
            status = ""
            while status not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                sampler.sample(app)
                status = app.execute(
                    "SELECT status FROM dispatch_run WHERE id = %s", [run.id]
                ).fetchone()[0]
                if status not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    time.sleep(sampler.every)
            sampler.stop()
            if status != "SUCCEEDED":
                raise SystemExit(
                    f"run {run.id} ({case} slices) ended {status}; see "
                    "bench/results/slices-worker.log"
                )
            (seconds,) = app.execute(
                "SELECT extract(epoch FROM finished_at - created_at) FROM dispatch_run"
                " WHERE id = %s",
                [run.id],
            ).fetchone()
            if case > 1:
                done = app.execute(
                    "SELECT count(*) FROM dispatch_run WHERE parent_id = %s AND status = 'SUCCEEDED'",
                    [run.id],
                ).fetchone()[0]
                if done != case:
                    raise SystemExit(f"run {run.id}: {done} of {case} slices SUCCEEDED")
        peak = max(vm_hwm_kib(p.pid) for p in procs)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
    with connect(server, DST_DB) as c:
        got = c.execute(
            sql.SQL("SELECT count(*), count(DISTINCT id) FROM {}").format(sql.Identifier(COPY))
        ).fetchone()
    if got != (rows, rows):
        raise SystemExit(f"{case} slices: the sink holds {got} (rows, distinct ids), not {rows}")
    return Round(
        case,
        float(seconds),
        peak,
        sampler.worker_seconds,
        sampler.server_seconds,
        sampler.machine_seconds,
        sampler.wall,
    )


def spread(values: list[float], digits: int = 0) -> str:
    return (
        f"{statistics.median(values):,.{digits}f} "
        f"({min(values):,.{digits}f}–{max(values):,.{digits}f})"
    )


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench slices", description=__doc__.split("\n")[0])
    p.add_argument("--server", default=SERVER)
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4, help="slots of each of the 2 workers")
    p.add_argument("--no-doc", action="store_true", help="print only")
    p.add_argument("--quick", action="store_true", help="100,000 rows, one round (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.rounds, args.no_doc = 100_000, 1, True
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    for db in (APP_DB, SRC_DB, DST_DB):
        common.ensure_database(args.server, db)
    ensure_source(args.server, args.rows)
    bindings = setup_app(args.server, 2 * args.concurrency)
    load_before = loadavg()

    results: dict[int, list[Round]] = {n: [] for n in CASES}
    for r in range(args.rounds):
        order = CASES if r % 2 == 0 else tuple(reversed(CASES))
        for case in order:
            got = one_round(args.server, bindings[case], case, args.rows, args.concurrency)
            results[case].append(got)
            print(
                f"round {r + 1}, {case} slice(s): {got.seconds:.2f} s, "
                f"{args.rows / got.seconds:,.0f} rows/s; cpu s: workers {got.worker_cpu:.1f}, "
                f"server {got.server_cpu:.1f}, machine {got.machine_cpu:.1f}; "
                f"rss {got.peak_kib // 1024} MiB; load {loadavg()}",
                flush=True,
            )
    load_after = loadavg()

    base = [x.seconds for x in results[1]]
    cores = os.cpu_count() or 1
    table = []
    for case in CASES:
        rs = results[case]
        secs = [x.seconds for x in rs]
        speedup = [b / s for b, s in zip(base, secs, strict=True)]
        busy = [x.machine_cpu / (cores * x.wall) for x in rs]
        table.append(
            f"| {'1 stream' if case == 1 else f'{case} slices'} "
            f"| {spread([args.rows / s for s in secs])} | {spread(secs, 2)} "
            f"| {spread(speedup, 2)} "
            f"| {spread([x.worker_cpu for x in rs], 1)} | {spread([x.server_cpu for x in rs], 1)} "
            f"| {spread([100 * b for b in busy])} % "
            f"| {spread([x.peak_kib / 1024 for x in rs], 0)} |"
        )

    def median_seconds(case: int) -> float:
        return statistics.median(x.seconds for x in results[case])

    best = max(CASES[1:], key=lambda n: median_seconds(1) / median_seconds(n))
    best_speedup = median_seconds(1) / median_seconds(best)
    # What the copy itself costs in CPU (workers + their server backends): on `cores`
    # CPUs with nothing else running, no number of slices finishes faster than that
    # divided by the cores.
    floors = {n: statistics.median(x.worker_cpu + x.server_cpu for x in results[n]) for n in CASES}
    others = [x.machine_cpu - x.worker_cpu - x.server_cpu for n in CASES for x in results[n]]
    lines = [
        f"## Slices: one table, 1 stream against 2, 4 and 8 slices ({args.rows:,} rows)",
        "",
        f"{dt.date.today().isoformat()}, {args.rounds} rounds, the cases alternated (1, 2, 4, "
        "8, then 8, 4, 2, 1). Each round starts two fresh `runworker` processes "
        f"(`--concurrency {args.concurrency}` each; the binding's `max_concurrency` "
        f"{2 * args.concurrency}), already listening when the run is triggered; time = "
        "trigger → the run's SUCCEEDED in database time (`dispatch_run.created_at` → "
        "`finished_at`; a sliced run's includes its planning attempt and the settlement of "
        "its last slice). Rows: `" + COLUMNS + "`, primary key `id` (the slices' key, "
        "`count` equal ranges); the sink table exists without index, mode `append`. CPU "
        "seconds are sampled from /proc every 0.2 s during the run: the two workers, the "
        "PostgreSQL backends of the three databases (source, sink, dispatch), and the "
        "machine's busy time (all processes, other users' included) as a share of its "
        f"{cores} CPUs over the run.",
        "",
        "| case | rows/s, median (min–max) | seconds | speed-up vs 1 stream | worker CPU s "
        "| server CPU s | machine busy | peak RSS MiB (larger worker) |",
        "|---|---|---|---|---|---|---|---|",
        *table,
        "",
        f"- best: {best} slices, **{best_speedup:.2f} x** one stream (ratio of the median "
        "times; the table's speed-up is the median of each round's ratio)",
        "- CPU of the copy itself (workers + server), median: "
        + ", ".join(f"{n} slice(s) {floors[n]:.1f} CPU-s" for n in CASES)
        + f"; on {cores} idle CPUs the fastest possible 8-slice run takes "
        f"{floors[CASES[-1]] / cores:.1f} s, at most **{median_seconds(1) / (floors[CASES[-1]] / cores):.2f} x** "
        "the median 1-stream run",
        f"- CPU of everything else on the machine during the runs (other processes, "
        f"the sampler): {spread(others, 1)} CPU-s per run",
        f"- load average before: {load_before}; after: {load_after}",
        f"- command: `.venv/bin/python -m bench slices --rows {args.rows} --rounds "
        f"{args.rounds} --concurrency {args.concurrency}`",
        "- machine: " + ", ".join(f"{k} {v}" for k, v in common.machine(args.server).items()),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_doc:
        existing = DOC.read_text() if DOC.exists() else common.DOC_INTRO
        DOC.write_text(existing.rstrip("\n") + "\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
