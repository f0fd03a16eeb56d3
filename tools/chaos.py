"""The fault-injection campaign: real workers, a stream of triggers and schedules, and
seeded faults against an embedded PostgreSQL the campaign owns; then quiescence and the
invariant checker (`dispatch.verify.invariants`).

The campaign drops and recreates its own databases on its own server (never the shared
one: it restarts it). The times and kinds of faults come from `random.Random(seed)`, so a
seed replays the same fault plan; the victims (which worker, which run) are drawn by the
same generator among what is live at that moment. See docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from django.apps import apps
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.db.models import Exists, OuterRef, Q
from psycopg import sql

from dispatch import services
from dispatch.core import conf
from dispatch.core.db import DB_ERRORS, db_now
from dispatch.core.states import BlockedReason, Status
from dispatch.models import Attempt, Datasource, Job, JobBinding, Run
from dispatch.models.ops import HealthState
from dispatch.verify import invariants
from tools.blackhole import BlackholeProxy

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
DATABASE = "dispatch_chaos"
SINK_DATABASE = "dispatch_chaos_sink"
# The typed binding's source: one column of each of 35 types (tools/typesample.py).
SOURCE_DATABASE = "dispatch_chaos_source"
TYPED = "chaos-pg-types"
# The campaign's own connections carry this name, so killing "working connections" never
# hits the campaign itself.
APP_NAME = "dispatch-chaos"
LEASE_SECONDS = 3
SLOW_COMMIT = "chaos-pg-slow-commit"
FAULT_KINDS = (
    "kill",
    "stop",
    "listen_kill",
    "conn_kill",
    "pg_restart",
    "notify_flood",
    "cancel",
    "retry",
    "edit_datasource",
    "disable_binding",
    "partition",
    "stall",
    "sink_partition",
)
# Relative frequency of each kind after the first round (which injects every kind once).
WEIGHTS = {
    "kill": 3,
    "stop": 2,
    "listen_kill": 2,
    "conn_kill": 2,
    "pg_restart": 1,
    "notify_flood": 2,
    "cancel": 3,
    "retry": 3,
    "edit_datasource": 1,
    "disable_binding": 1,
    "partition": 1,
    "stall": 1,
    "sink_partition": 1,
}
# A silent partition lasts four leases: the worker's deadlines must notice it, its
# executions stop, recovery hands its runs to others, and it rejoins after the heal.
PARTITION_SECONDS = LEASE_SECONDS * 4
# A stall holds a worker's bytes back for two leases and then delivers them: requests
# its deadlines gave up on reach the server late (a late heartbeat, claim or settlement).
STALL_SECONDS = LEASE_SECONDS * 2
# The PostgreSQL sink's own path goes silent for as long: heartbeats still confirm the
# leases, so only the connectors' probes (DISPATCH_CONNECTOR_PROBE_SECONDS) end the waits
# of the executions writing there; their retries succeed after the heal.
SINK_PARTITION_SECONDS = PARTITION_SECONDS
SINK = "sink"  # the proxy slot of the PostgreSQL sink's connections
PROBE_SECONDS = 2
# The incremental bindings' source: a table that keeps receiving inserts and updates
# during the campaign, one version per transaction from one writer (so the versions become
# visible in cursor order), every version also kept in a history table by a trigger in
# the writer's own transaction, for the checker (dispatch.verify.incremental).
INCREMENTAL_TABLE = "public.events"
INCREMENTAL_SOURCE = """
CREATE TABLE public.events (
    id bigserial PRIMARY KEY,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    version integer NOT NULL DEFAULT 1,
    payload text
);
CREATE INDEX events_cursor ON public.events (updated_at, id);
CREATE TABLE public.events_history (LIKE public.events);
CREATE FUNCTION public.events_keep_version() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.events_history SELECT NEW.*;
    RETURN NULL;
END $$;
CREATE TRIGGER events_keep_version AFTER INSERT OR UPDATE ON public.events
    FOR EACH ROW EXECUTE FUNCTION public.events_keep_version();
"""
INCREMENTAL_CURSOR = {"cursor": ["updated_at", "id"]}
# The sliced bindings' source: a table that does not change (the checker compares the
# sinks with it value by value, slice by slice), of mixed types, split on its key.
SLICED_TABLE = "public.sliced"
SLICED_ROWS = 20_000
SLICED_SOURCE = f"""
CREATE TABLE public.sliced (id bigint PRIMARY KEY, name text, amount numeric(12,2),
    at timestamptz, doc jsonb, flag boolean);
INSERT INTO public.sliced
SELECT i, 'row-' || i, (i * 7919 %% 100000) / 100.0, timestamptz '2024-01-01' + i * interval '1 minute',
       jsonb_build_object('i', i, 'tag', 't' || (i %% 13)), i %% 3 = 0
  FROM generate_series(1, {SLICED_ROWS}) AS i;
ANALYZE public.sliced;
"""
SLICED = ("chaos-sliced-append", "chaos-sliced-replace")
# The append sink of the sliced binding exists before the campaign, with a row trigger
# that sleeps 0.2 ms per row: a slice of 6,667 rows copies for over a second, so a kill or
# a stop lands mid-COPY and the heartbeats carry its progress (the rows are unchanged).
SLICED_SINK = """
CREATE TABLE public.chaos_sliced_append (id bigint, name text, amount numeric(12,2),
    at timestamptz, doc jsonb, flag boolean);
CREATE FUNCTION public.chaos_slow_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_sleep(0.0002);
    RETURN NEW;
END $$;
CREATE TRIGGER chaos_slow_row BEFORE INSERT ON public.chaos_sliced_append
    FOR EACH ROW EXECUTE FUNCTION public.chaos_slow_row();
"""
MUTATIONS_PER_SECOND = 8.0


def mutate_source(conn: psycopg.Connection[Any], kind: str, row: int | None = None) -> int:
    """One change of the incremental source, in a transaction of its own (`conn` is in
    autocommit): a new row (its id is returned), or a new version of row `row` (its cursor
    moves past every earlier version's; 0 when there is no such row: ids have gaps where an
    insert rolled back or the server restarted)."""
    if kind == "insert":
        return int(
            conn.execute(
                "INSERT INTO public.events (payload) VALUES (md5(random()::text)) RETURNING id"
            ).fetchone()[0]  # type: ignore[index]
        )
    updated = conn.execute(
        "UPDATE public.events SET version = version + 1, updated_at = clock_timestamp(),"
        " payload = md5(random()::text) WHERE id = %s",
        [row],
    ).rowcount
    return int(row or 0) if updated else 0


@dataclass
class Options:
    duration: float = 60.0
    workers: int = 3
    seed: int = 1
    concurrency: int = 2
    data_dir: Path = ROOT / ".data" / "chaos-pg"
    port: int = 54341
    out_dir: Path = ROOT / ".data" / "chaos"
    fault_interval: float = 2.5
    trigger_rate: float = 2.0
    reconcilers: int = 3
    quiesce_timeout: float = 120.0
    keep_server: bool = False


@dataclass
class Proc:
    role: str  # worker | reconciler
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    stopped_until: float | None = None  # SIGSTOPped until this monotonic time
    killed_by_us: bool = False


@dataclass
class Summary:
    seed: int
    duration: float
    workers: int
    runs_created: int = 0
    scheduled_runs: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    faults: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    attempts_by_origin: dict[str, int] = field(default_factory=dict)
    worker_stats: Counter[str] = field(default_factory=Counter)
    fenced_commit_log_lines: int = 0
    # Sink commits a stale worker made after its attempt was settled without a successor.
    stale_commits_accepted: int = 0
    unexpected_exits: list[dict[str, Any]] = field(default_factory=list)
    harness_db_retries: int = 0
    throughput_during_faults: float = 0.0
    trigger_rate: float = 0.0
    quiesce_seconds: float = 0.0
    partition_dropped_bytes: int = 0
    stall_held_bytes: int = 0
    sink_dropped_bytes: int = 0
    postgresql_sink: bool = False
    schedules: int = 0
    # The incremental source: committed changes (inserts, updates), and the catch-up
    # runs after the faults (one per incremental binding, until one succeeds).
    source_inserts: int = 0
    source_updates: int = 0
    source_write_retries: int = 0
    catch_up_runs: int = 0
    incremental: dict[str, Any] = field(default_factory=dict)
    # Bindings the product's health scan disabled (name -> its reason), and the runs of
    # the campaign left waiting behind them (PENDING, marked BINDING_DISABLED).
    auto_disabled: dict[str, str] = field(default_factory=dict)
    waiting_auto_disabled: int = 0
    # Slices: the sliced runs and their slice runs by final status, and the faults that
    # hit a slice (a kill or stop of a worker holding one; a retry of a sliced run after
    # one of its slices failed).
    sliced_runs: dict[str, int] = field(default_factory=dict)
    slice_runs: dict[str, int] = field(default_factory=dict)
    slice_faults: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        lines = [
            f"chaos campaign seed={self.seed} duration={self.duration:.0f}s "
            f"workers={self.workers} postgresql_sink={self.postgresql_sink} "
            f"schedules={self.schedules}",
            f"  runs created: {self.runs_created} triggered + {self.scheduled_runs} scheduled; "
            f"final statuses {dict(sorted(self.statuses.items()))}",
            f"  faults injected: {sum(self.faults.values())} "
            + str(dict(sorted(self.faults.items()))),
            f"  operator refusals (expected races): {dict(sorted(self.refusals.items()))}",
            f"  attempts by origin: {dict(sorted(self.attempts_by_origin.items()))}",
            f"  stale sink commits rejected by the fence: "
            f"{self.worker_stats.get('fenced_commits', 0)} (worker stats), "
            f"{self.fenced_commit_log_lines} (log lines); stale sink commits accepted: "
            f"{self.stale_commits_accepted}",
            "  worker stats: "
            + ", ".join(
                f"{k}={self.worker_stats[k]}"
                for k in (
                    "lease_lost",
                    "recovered",
                    "released",
                    "listen_reconnects",
                    "notifications_malformed",
                    "directed_hits",
                    "directed_misses",
                    "settle_failed",
                )
            ),
            f"  throughput during faults: {self.throughput_during_faults:.2f} runs/s succeeded "
            f"(triggers offered {self.trigger_rate:.2f}/s); quiesced in {self.quiesce_seconds:.1f}s",
            f"  silent partitions: {self.faults.get('partition', 0)} "
            f"({self.partition_dropped_bytes} bytes swallowed by the black hole); stalls: "
            f"{self.faults.get('stall', 0)} ({self.stall_held_bytes} bytes delivered late); "
            f"sink partitions: {self.faults.get('sink_partition', 0)} "
            f"({self.sink_dropped_bytes} bytes swallowed)",
            f"  incremental source: {self.source_inserts} inserts and {self.source_updates} "
            f"updates during the campaign ({self.source_write_retries} retried); "
            f"{self.catch_up_runs} catch-up run(s) after it",
            *(f"    {name}: {figures}" for name, figures in sorted(self.incremental.items())),
            f"  bindings auto-disabled by the health scan: {len(self.auto_disabled)} "
            f"({self.waiting_auto_disabled} run(s) left waiting behind them)",
            *(f"    {name}: {reason}" for name, reason in sorted(self.auto_disabled.items())),
            f"  sliced runs by status {dict(sorted(self.sliced_runs.items()))}; their slice "
            f"runs {dict(sorted(self.slice_runs.items()))}; faults on slices "
            f"{dict(sorted(self.slice_faults.items()))}",
            f"  harness database retries: {self.harness_db_retries}",
            f"  unexpected process exits: {len(self.unexpected_exits)}",
        ]
        for exit_info in self.unexpected_exits[:10]:
            lines.append(f"    {exit_info['name']} exit {exit_info['code']}: {exit_info['tail']}")
        lines.append(f"  violations: {len(self.violations)}")
        lines.extend(f"    {v}" for v in self.violations[:100])
        lines.extend(f"  note: {n}" for n in self.notes[:50])
        return "\n".join(lines)


class Campaign:
    def __init__(self, options: Options, out: Callable[[str], None] = print) -> None:
        from project.embedded_pg import EmbeddedPostgres

        self.o = options
        self.out = out
        # The campaign's own triggers and cancels would drown the summary; workers log to
        # their own files.
        logging.getLogger("dispatch").setLevel(logging.WARNING)
        self.rng = random.Random(options.seed)
        self.server = EmbeddedPostgres(options.data_dir, options.port)
        self.tag = f"chaos-{options.seed}"
        self.summary = Summary(options.seed, options.duration, options.workers)
        self.procs: list[Proc] = []
        self.generation = Counter[str]()
        self.bindings: list[JobBinding] = []
        self.sink_datasources: list[Datasource] = []
        self.schedule_ids: list[uuid.UUID] = []
        self.run_ids: set[uuid.UUID] = set()
        self.reenable_at: dict[uuid.UUID, float] = {}
        self.triggers = 0
        self.last_restart = -1e9
        # Each worker slot reaches the database (working and LISTEN connections) through
        # a proxy of its own, which the `partition` fault turns into a black hole.
        self.proxies: dict[str, BlackholeProxy] = {}
        self.partitioned_until: dict[str, float] = {}
        self.incremental_bindings: list[JobBinding] = []
        self.writer_stop = threading.Event()
        self.writer: threading.Thread | None = None

    # --- set-up -----------------------------------------------------------------------------
    def setup(self) -> None:
        self.o.out_dir.mkdir(parents=True, exist_ok=True)
        for old in self.o.out_dir.glob("*.log"):
            old.unlink()
        self.server.start()
        with psycopg.connect(self.server.url("postgres"), autocommit=True) as admin:
            for name in (DATABASE, SINK_DATABASE, SOURCE_DATABASE):
                # A fresh slate per campaign, so a seed replays from the same state.
                admin.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
                admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        from tools.typesample import ROWS, TYPES

        # The typed source, and its enum and domain in the sink (which `create: true` uses).
        with psycopg.connect(self.server.url(SOURCE_DATABASE), autocommit=True) as c:
            c.execute(TYPES.format(table="source"))
            c.execute(ROWS)
            c.execute(INCREMENTAL_SOURCE)
            c.execute(SLICED_SOURCE.replace("%%", "%"))
            for _ in range(50):
                mutate_source(c, "insert")
        with psycopg.connect(self.server.url(SINK_DATABASE), autocommit=True) as c:
            c.execute(TYPES.format(table="chaos_types_definition"))
            c.execute(SLICED_SINK)
        db = connection.settings_dict
        connection.close()
        db.update(NAME=DATABASE, HOST="127.0.0.1", PORT=str(self.o.port), USER="postgres")
        db["PASSWORD"] = ""
        db.setdefault("OPTIONS", {})["application_name"] = APP_NAME
        call_command("migrate", verbosity=0, interactive=False)
        self._create_definitions()

    def _create_definitions(self) -> None:
        source = _datasource("chaos-source", "generate", {})
        null = _datasource("chaos-null", "null", {})

        def job(
            name: str, source_spec: dict[str, Any], sink_spec: dict[str, Any], **kw: Any
        ) -> Job:
            j = Job(
                name=name,
                source_spec=source_spec,
                sink_spec=sink_spec,
                max_attempts=kw.pop("max_attempts", 8),
                backoff_seconds=0.2,
                backoff_max_seconds=2.0,
                lease_seconds=LEASE_SECONDS,
                **kw,
            )
            j.save()
            return j

        def binding(
            name: str,
            j: Job,
            sink: Datasource,
            concurrency: int = 2,
            source_ds: Datasource | None = None,
        ) -> JobBinding:
            b = JobBinding(
                name=name,
                job=j,
                source=source_ds or source,
                sink=sink,
                max_concurrency=concurrency,
            )
            b.full_clean()
            b.save()
            return b

        self.bindings.append(
            binding(
                "chaos-null",
                job("chaos-null", {"rows": 200, "batch": 20, "delay_ms": 100}, {}),
                null,
            )
        )
        self.bindings.append(
            binding(
                "chaos-flaky",
                job("chaos-flaky", {"rows": 60, "batch": 10, "fail_after": 30}, {}, max_attempts=3),
                null,
            )
        )
        if self._postgresql_available():
            self.summary.postgresql_sink = True
            # The sink's connections go through a proxy of their own (`sink_partition`).
            sink = _datasource(
                "chaos-pg-sink",
                "postgresql",
                {
                    "host": "127.0.0.1",
                    "port": self._proxy(SINK).port,
                    "dbname": SINK_DATABASE,
                    "user": "postgres",
                    "sslmode": "disable",
                },
            )
            self.sink_datasources.append(sink)
            # Every type PostgreSQL can COPY, with awkward values, copied again and again
            # (replace): the checker compares the sink with the source value by value.
            typed_source = _datasource(
                "chaos-pg-types-source",
                "postgresql",
                {
                    "host": "127.0.0.1",
                    "port": self.o.port,
                    "dbname": SOURCE_DATABASE,
                    "user": "postgres",
                    "sslmode": "disable",
                },
            )
            self.bindings.append(
                binding(
                    TYPED,
                    job(
                        TYPED,
                        {"table": "public.source"},
                        {
                            "table": "public.chaos_types",
                            "mode": "replace",
                            "create": True,
                            "receipt": True,
                        },
                    ),
                    sink,
                    concurrency=1,
                    source_ds=typed_source,
                )
            )
            for mode in ("append", "replace"):
                self.bindings.append(
                    binding(
                        f"chaos-pg-{mode}",
                        job(
                            f"chaos-pg-{mode}",
                            {"rows": 400, "batch": 50, "delay_ms": 150},
                            {"table": f"public.chaos_{mode}", "mode": mode, "create": True},
                        ),
                        sink,
                        concurrency=2 if mode == "append" else 1,
                    )
                )
            # Incremental reads of a table that changes all campaign long, into an append
            # and an upsert sink (both may run twice at once: the second commit over a
            # moved cursor must fail and retry from the new one).
            for mode in ("append", "upsert"):
                sink_spec: dict[str, Any] = {
                    "table": f"public.chaos_inc_{mode}",
                    "mode": mode,
                    "create": True,
                }
                if mode == "upsert":
                    sink_spec["key"] = ["id"]
                b = binding(
                    f"chaos-inc-{mode}",
                    job(
                        f"chaos-inc-{mode}",
                        {"table": INCREMENTAL_TABLE, "incremental": INCREMENTAL_CURSOR},
                        sink_spec,
                    ),
                    sink,
                    source_ds=typed_source,
                )
                self.bindings.append(b)
                self.incremental_bindings.append(b)
            # A big table split into slices, each a run of its own, into an append sink (one
            # attempt each: a slice whose worker dies fails, and its run with it, for the
            # operator to retry) and a staged replace (retried by policy).
            for name, mode, count, attempts in (
                (SLICED[0], "append", 3, 1),
                (SLICED[1], "replace", 4, 3),
            ):
                self.bindings.append(
                    binding(
                        name,
                        job(
                            name,
                            {"table": SLICED_TABLE, "slices": {"key": "id", "count": count}},
                            {"table": f"public.chaos_sliced_{mode}", "mode": mode, "create": True},
                            max_attempts=attempts,
                            max_slices_in_flight=count - 1,
                        ),
                        sink,
                        concurrency=count,
                        source_ds=typed_source,
                    )
                )
            # One batch, then two seconds before the commit: a worker stopped in that
            # window wakes up with its data written and only the commit left, which is
            # where the sink fence (not the heartbeat) has to refuse it.
            self.bindings.append(
                binding(
                    SLOW_COMMIT,
                    job(
                        SLOW_COMMIT,
                        {"rows": 100, "batch": 100, "delay_ms": 2000},
                        {"table": "public.chaos_slow_commit", "mode": "append", "create": True},
                    ),
                    sink,
                )
            )
        if self._scheduling_available():
            from scheduling.models import OverlapPolicy, Schedule

            for b, overlap in (
                (self.bindings[0], OverlapPolicy.SKIP),
                (self.bindings[-1], OverlapPolicy.QUEUE),
            ):
                s = Schedule(binding=b, cron="* * * * *", timezone="UTC", overlap_policy=overlap)
                s.full_clean()
                s.save()
                self.schedule_ids.append(s.id)
            self.summary.schedules = len(self.schedule_ids)

    @staticmethod
    def _postgresql_available() -> bool:
        from dispatch.connectors import registry

        return "postgresql" in registry.kinds()

    @staticmethod
    def _scheduling_available() -> bool:
        return (
            apps.is_installed("scheduling")
            and "scheduling_schedule" in connection.introspection.table_names()
            and (
                ROOT / "scheduling" / "management" / "commands" / "reconcile_schedules.py"
            ).exists()
        )

    # --- processes ----------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            "DATABASE_URL": self.server.url(DATABASE),
            "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "project.settings"),
            "SECRET_KEY": settings.SECRET_KEY,
            "DISPATCH_ENCRYPTION_KEYS": ",".join(conf.encryption_keys()),
            "DISPATCH_CHANNEL": conf.channel(),
            "DISPATCH_POLL_INTERVAL": "1",
            "DISPATCH_RECOVERY_INTERVAL": "1",
            "DISPATCH_SHUTDOWN_GRACE_SECONDS": "3",
            "DISPATCH_CONNECTOR_PROBE_SECONDS": str(PROBE_SECONDS),
            "LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        }

    def _spawn(
        self, role: str, slot: str, args: list[str], env: dict[str, str] | None = None
    ) -> Proc:
        self.generation[slot] += 1
        name = f"chaos-{slot}.{self.generation[slot]}"
        log_path = self.o.out_dir / f"{name}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - the child owns it
        popen = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), *args],
            env={**self._env(), **(env or {})},
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # our Ctrl-C is not theirs; we stop them ourselves
        )
        log.close()
        proc = Proc(role, name, popen, log_path)
        self.procs.append(proc)
        return proc

    def _proxy(self, slot: str) -> BlackholeProxy:
        if slot not in self.proxies:
            self.proxies[slot] = BlackholeProxy("127.0.0.1", self.o.port).__enter__()
        return self.proxies[slot]

    def start_worker(self, slot: str) -> Proc:
        url = self.server.url(DATABASE).replace(
            f":{self.o.port}/", f":{self._proxy(slot).port}/", 1
        )
        return self._spawn(
            "worker",
            slot,
            [
                "runworker",
                # The campaign's own reconcilers fire the schedules (it kills and restarts
                # them, and stops them to quiesce): the workers run none.
                "--no-scheduler",
                "--concurrency",
                str(self.o.concurrency),
                "--worker-id",
                f"chaos-{slot}.{self.generation[slot] + 1}",
            ],
            env={"DATABASE_URL": url, "DISPATCH_LISTEN_URL": url},
        )

    def start_processes(self) -> None:
        for i in range(self.o.workers):
            self.start_worker(f"w{i}")
        if self.schedule_ids:
            for i in range(self.o.reconcilers):
                self._spawn("reconciler", f"r{i}", ["reconcile_schedules", "--loop"])

    def live(self, role: str | None = None) -> list[Proc]:
        return [
            p
            for p in self.procs
            if p.popen.poll() is None and not p.killed_by_us and (role is None or p.role == role)
        ]

    def _watch_processes(self) -> None:
        """A process that exited without our doing is a finding: record its last lines,
        then start a replacement so the campaign goes on."""
        for p in list(self.procs):
            code = p.popen.poll()
            if code is None or p.killed_by_us:
                continue
            p.killed_by_us = True  # handled
            tail = " | ".join(p.log_path.read_text(errors="replace").strip().splitlines()[-3:])
            self.summary.unexpected_exits.append(
                {"name": p.name, "code": code, "tail": tail[-600:]}
            )
            self.out(f"  ! {p.name} exited with {code}: {tail[-300:]}")
            slot = p.name.removeprefix("chaos-").split(".")[0]
            if p.role == "worker":
                self.start_worker(slot)
            else:
                self._spawn("reconciler", slot, ["reconcile_schedules", "--loop"])

    def stop_all(self, *, grace: float = 15.0) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.popen.pid, signal.SIGCONT)
                    p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.summary.notes.append(f"{p.name} did not stop within {grace:.0f}s of SIGTERM")
                p.popen.kill()
                p.popen.wait()

    # --- the harness's own database calls survive the faults it injects --------------------
    def db(self, fn: Callable[[], T], *, tries: int = 100) -> T:
        for attempt in range(tries):
            try:
                return fn()
            except DB_ERRORS:
                self.summary.harness_db_retries += 1
                with contextlib.suppress(*DB_ERRORS):
                    connection.close()
                if attempt == tries - 1:
                    raise
                time.sleep(min(0.1 * (attempt + 1), 1.0))  # back off while the server restarts
        raise AssertionError("unreachable")

    # --- triggers ------------------------------------------------------------------------------
    def trigger_one(self) -> None:
        self.triggers += 1
        key = f"{self.tag}-{self.triggers}"
        binding = self.rng.choice(self.bindings)
        # The idempotency key makes the retry of a trigger whose commit we did not see
        # (a killed connection, a restart) return the same run instead of a second one.
        run = self.db(
            lambda: services.trigger(
                binding, trigger="API", idempotency_key=key, requested_by=self.tag
            )
        )
        self.run_ids.add(run.id)

    # --- faults ----------------------------------------------------------------------------
    def plan(self) -> list[tuple[float, str]]:
        """(offset seconds, kind) for the whole campaign: every kind once in a seeded order,
        then weighted draws; exponential gaps with mean `fault_interval`."""
        kinds = list(FAULT_KINDS)
        self.rng.shuffle(kinds)
        plan: list[tuple[float, str]] = []
        t = 2.0
        while t < self.o.duration - 2:
            kind = (
                kinds.pop(0)
                if kinds
                else self.rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
            )
            plan.append((t, kind))
            t += self.rng.expovariate(1 / self.o.fault_interval)
        return plan

    def busy_workers(
        self, *, sink_kind: str | None = None, before_commit: bool = False, slices: bool = False
    ) -> list[Proc]:
        running = Attempt.objects.running()
        if slices:
            running = running.filter(run__parent__isnull=False)
        if sink_kind:
            running = running.filter(run__binding__sink__kind=sink_kind)
        if before_commit:
            # Its one batch is written (progress travels with the heartbeat): it now waits
            # two seconds before its commit.
            running = running.filter(run__binding__name=SLOW_COMMIT, rows_written__gt=0)
        held = self.db(lambda: set(running.values_list("worker_id", flat=True).distinct()))
        return [p for p in self.live("worker") if p.stopped_until is None and _worker_id(p) in held]

    def inject(self, kind: str) -> bool:
        handler = getattr(self, f"fault_{kind}")
        done = bool(handler())
        if done:
            self.summary.faults[kind] += 1
        return done

    def _slice_victims(self) -> list[Proc]:
        """Half the time, the workers holding a running slice (a SIGKILL or SIGSTOP then
        lands while it copies its range); none the other half."""
        return self.busy_workers(slices=True) if self.rng.random() < 0.5 else []

    def _note_slice_victim(self, kind: str, p: Proc) -> None:
        """Count a fault that hit a worker holding a slice, and whether its progress (sent
        with each heartbeat) showed rows already copied: mid-COPY."""
        copied: list[int] = self.db(
            lambda: list(
                Attempt.objects.running()
                .filter(worker_id=_worker_id(p), run__parent__isnull=False)
                .values_list("rows_read", flat=True)
            )
        )
        if copied:
            self.summary.slice_faults[kind] += 1
            if any(n > 0 for n in copied):
                self.summary.slice_faults[f"{kind}_mid_copy"] += 1

    def fault_kill(self) -> bool:
        victims = (
            self._slice_victims()
            or self.busy_workers()
            or [p for p in self.live("worker") if p.stopped_until is None]
        )
        if not victims:
            return False
        p = self.rng.choice(victims)
        self._note_slice_victim("kill", p)
        p.killed_by_us = True
        p.popen.send_signal(signal.SIGKILL)
        p.popen.wait()
        self.start_worker(p.name.removeprefix("chaos-").split(".")[0])
        return True

    def fault_stop(self) -> bool:
        # Prefer a worker writing to a fenced sink: its wake-up is what the fence is for.
        victims = (
            self.busy_workers(before_commit=True)
            or self._slice_victims()
            or self.busy_workers(sink_kind="postgresql")
            or self.busy_workers()
        )
        if not victims:
            return False
        p = self.rng.choice(victims)
        self._note_slice_victim("stop", p)
        os.kill(p.popen.pid, signal.SIGSTOP)
        # Long past its lease and a recovery pass, so a successor runs (and raises the sink
        # fence) before the stale worker wakes up and tries to commit.
        p.stopped_until = time.monotonic() + LEASE_SECONDS * 3 + 2
        return True

    def fault_partition(self) -> bool:
        # A worker holding an attempt, not paused and not already cut off.
        victims = [p for p in self.busy_workers() if _slot(p) not in self.partitioned_until]
        if not victims:
            return False
        slot = _slot(self.rng.choice(victims))
        self.proxies[slot].blackhole()
        self.partitioned_until[slot] = time.monotonic() + PARTITION_SECONDS
        return True

    def fault_stall(self) -> bool:
        victims = [p for p in self.busy_workers() if _slot(p) not in self.partitioned_until]
        if not victims:
            return False
        slot = _slot(self.rng.choice(victims))
        self.proxies[slot].stall()
        self.partitioned_until[slot] = time.monotonic() + STALL_SECONDS
        return True

    def fault_sink_partition(self) -> bool:
        # Worth it while a worker writes there; the sink's proxy, not a worker's.
        if SINK not in self.proxies or SINK in self.partitioned_until:
            return False
        if not self.busy_workers(sink_kind="postgresql"):
            return False
        self.proxies[SINK].blackhole()
        self.partitioned_until[SINK] = time.monotonic() + SINK_PARTITION_SECONDS
        return True

    def _heal(self, *, all_now: bool = False) -> None:
        for slot, until in list(self.partitioned_until.items()):
            if all_now or time.monotonic() >= until:
                self.proxies[slot].heal()
                del self.partitioned_until[slot]

    def _resume_stopped(self, *, all_now: bool = False) -> None:
        for p in self.procs:
            if p.stopped_until is not None and (all_now or time.monotonic() >= p.stopped_until):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.popen.pid, signal.SIGCONT)
                p.stopped_until = None

    def _terminate(self, where: str, *params: Any) -> int:
        with psycopg.connect(
            self.server.url(DATABASE), autocommit=True, application_name=APP_NAME
        ) as c:
            pids = [
                r[0] for r in c.execute(f"SELECT pid FROM pg_stat_activity WHERE {where}", params)
            ]
            if not pids:
                return 0
            chosen = self.rng.sample(pids, min(len(pids), 3))
            c.execute("SELECT pg_terminate_backend(p) FROM unnest(%s::int[]) p", [chosen])
            return len(chosen)

    def fault_listen_kill(self) -> bool:
        return self._terminate("application_name LIKE %s", "dispatch-listen %") > 0

    def fault_conn_kill(self) -> bool:
        # Workers' own connections (claims, heartbeats, settlements) and sink connections.
        return self._terminate("application_name = %s AND pid <> pg_backend_pid()", "dispatch") > 0

    def fault_pg_restart(self) -> bool:
        if time.monotonic() - self.last_restart < 15:
            return False
        self.last_restart = time.monotonic()
        with contextlib.suppress(*DB_ERRORS):
            connection.close()
        self.server.restart("immediate")
        return True

    def fault_notify_flood(self) -> bool:
        live = [
            str(r)
            for r in self.db(lambda: list(Run.objects.live().values_list("id", flat=True)[:50]))
        ]
        payloads = [
            "",
            "not-a-uuid",
            "x" * 200,
            "{'run': 1}",
            "00000000-0000-0000-0000-00000000000g",
        ]
        with psycopg.connect(
            self.server.url(DATABASE), autocommit=True, application_name=APP_NAME
        ) as c:
            for _ in range(300):
                roll = self.rng.random()
                if roll < 0.4 and live:
                    payload = self.rng.choice(live)  # duplicates of real wake-ups
                elif roll < 0.7:
                    payload = str(uuid.UUID(int=self.rng.getrandbits(128)))  # unknown ids
                else:
                    payload = self.rng.choice(payloads)  # garbage
                c.execute("SELECT pg_notify(%s, %s)", [conf.channel(), payload])
        return True

    def _pick_run(self, statuses: list[str], *, sliced: bool = False) -> Run | None:
        """A run of the campaign in `statuses`, never a slice run (an operator acts on
        its sliced run); `sliced`: only a sliced run (one with a plan)."""
        runs = Run.objects.filter(requested_by=self.tag, status__in=statuses, parent__isnull=True)
        if sliced:
            runs = runs.filter(slice_plan__isnull=False)
        candidates = self.db(lambda: list(runs.values_list("id", flat=True)[:200]))
        if not candidates:
            return None
        return self.db(lambda: Run.objects.get(pk=self.rng.choice(candidates)))

    def fault_cancel(self) -> bool:
        # A sliced run WAITING on its slices too (its queued slices at once, its running
        # ones at their next heartbeat).
        run = self._pick_run([Status.PENDING, Status.RUNNING, Status.WAITING])
        if run is None:
            return False
        try:
            self.db(lambda: services.cancel_run(run, by="chaos"))
        except services.ActionRefused as exc:
            self.summary.refusals[f"cancel:{exc.code}"] += 1
        return True

    def fault_retry(self) -> bool:
        # A sliced run that failed (one of its slices did) first: the retry redoes only
        # the slices that did not commit.
        run = self._pick_run([Status.FAILED, Status.CANCELLED], sliced=True)
        if run is not None:
            self.summary.slice_faults["retry_sliced"] += 1
        else:
            run = self._pick_run([Status.FAILED, Status.CANCELLED])
        if run is None:
            return False
        try:
            self.db(lambda: services.retry_run(run, by="chaos"))
        except services.ActionRefused as exc:
            self.summary.refusals[f"retry:{exc.code}"] += 1
        return True

    def fault_edit_datasource(self) -> bool:
        if not self.sink_datasources:
            return False
        ds = self.db(lambda: Datasource.objects.get(pk=self.sink_datasources[0].pk))
        config = ds.config
        # A harmless change that bumps the version: running attempts keep their snapshot,
        # the next claim takes the new one.
        config["sslmode"] = "prefer" if config.get("sslmode") == "disable" else "disable"
        ds.config = config
        self.db(lambda: ds.save())
        return True

    def _auto_disabled_ids(self) -> set[uuid.UUID]:
        """Bindings the product's health scan has disabled (dispatch.ops.alerts)."""
        return set(
            self.db(
                lambda: list(
                    JobBinding.objects.filter(health__state=HealthState.AUTO_DISABLED).values_list(
                        "pk", flat=True
                    )
                )
            )
        )

    def fault_disable_binding(self) -> bool:
        # Not one the product disabled: the campaign's re-enable would undo its decision.
        auto = self._auto_disabled_ids()
        choices = [b for b in self.bindings if b.pk not in self.reenable_at and b.pk not in auto]
        if not choices:
            return False
        b = self.rng.choice(choices)
        self.db(lambda: JobBinding.objects.filter(pk=b.pk).update(enabled=False))
        self.reenable_at[b.pk] = time.monotonic() + self.rng.uniform(2, 6)
        return True

    def _reenable(self, *, all_now: bool = False) -> None:
        """Undo the campaign's own disables. A binding the health scan auto-disabled in
        the meantime stays disabled: re-enabling it is an operator's decision (one the
        product answers by counting its failures afresh), not the end of a fault. A scan
        that disables it while this update runs may see it undone: that operator's case."""
        for pk, at in list(self.reenable_at.items()):
            if all_now or time.monotonic() >= at:
                self.db(
                    partial(
                        JobBinding.objects.filter(pk=pk)
                        .exclude(health__state=HealthState.AUTO_DISABLED)
                        .update,
                        enabled=True,
                    )
                )
                del self.reenable_at[pk]

    # --- the campaign ------------------------------------------------------------------------
    def run(self) -> Summary:
        self.setup()
        try:
            self.start_processes()
            self._fault_phase()
            self._quiesce()
            self._collect()
        finally:
            self._resume_stopped(all_now=True)
            self._heal(all_now=True)
            self.stop_all()
            self._count_proxy_bytes()
            for proxy in self.proxies.values():
                proxy.__exit__(None, None, None)
            if not self.o.keep_server:
                self.server.stop()
        return self.summary

    def _count_proxy_bytes(self) -> None:
        s = self.summary
        s.partition_dropped_bytes = sum(
            p.dropped_bytes for slot, p in self.proxies.items() if slot != SINK
        )
        s.sink_dropped_bytes = self.proxies[SINK].dropped_bytes if SINK in self.proxies else 0
        s.stall_held_bytes = sum(p.held_bytes for p in self.proxies.values())

    def _db_now(self) -> Any:
        return self.db(db_now)

    def _fault_phase(self) -> None:
        plan = self.plan()
        uncovered = set(FAULT_KINDS)
        self.out(f"fault plan (seed {self.o.seed}): {len(plan)} faults over {self.o.duration:.0f}s")
        started = time.monotonic()
        self.fault_start = self._db_now()
        if self.incremental_bindings:
            self.writer = threading.Thread(target=self._write_source, name="chaos-source")
            self.writer.start()
        next_trigger = started
        while (elapsed := time.monotonic() - started) < self.o.duration:
            if time.monotonic() >= next_trigger:
                self.trigger_one()
                next_trigger += self.rng.expovariate(self.o.trigger_rate)
            while plan and plan[0][0] <= elapsed:
                _, kind = plan.pop(0)
                done = self.inject(kind)
                self.out(f"  {elapsed:6.1f}s {kind}{'' if done else ' (nothing to hit)'}")
                if done:
                    uncovered.discard(kind)
                elif kind in uncovered and elapsed + 1 < self.o.duration - 1:
                    # Every kind is injected at least once: one that found nothing to hit
                    # (no busy worker yet, no finished run to retry) is tried again.
                    plan.append((elapsed + 1.0, kind))
                    plan.sort()
            self._resume_stopped()
            self._reenable()
            self._heal()
            self._watch_processes()
            time.sleep(0.02)
        self.writer_stop.set()
        if self.writer is not None:
            self.writer.join(30)
        self.fault_end = self._db_now()
        self.summary.trigger_rate = self.triggers / self.o.duration

    def _write_source(self) -> None:
        """The incremental source's one writer: inserts and updates (mostly of recent rows,
        so a row often changes again before a run reads it), one per transaction, until
        the faults stop. It reconnects across restarts and killed connections; a change
        whose commit it did not see is simply not counted (the history has it or not)."""
        rng = random.Random(self.o.seed * 7919 + 1)  # not the fault plan's generator
        s = self.summary
        last_id = 50
        conn: psycopg.Connection[Any] | None = None
        while not self.writer_stop.wait(rng.expovariate(MUTATIONS_PER_SECOND)):
            kind = "insert" if rng.random() < 0.4 else "update"
            row = rng.randint(max(1, last_id - 60), last_id)
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(
                        self.server.url(SOURCE_DATABASE), autocommit=True, connect_timeout=2
                    )
                done = mutate_source(conn, kind, row)
            except psycopg.Error:
                s.source_write_retries += 1
                if conn is not None:
                    conn.close()
                conn = None
                self.writer_stop.wait(0.2)
                continue
            if kind == "insert":
                s.source_inserts += 1
                last_id = max(last_id, done)
            elif done:
                s.source_updates += 1
        if conn is not None:
            conn.close()

    def _catch_up(self) -> None:
        """With the source still, one more run per incremental binding (again until one
        succeeds): its commit puts the sink's cursor at the source's last version, where
        the checker compares the whole table."""
        auto = self._auto_disabled_ids()
        for b in self.incremental_bindings:
            if b.pk in auto:
                # Its runs would wait for an operator; the checker compares what it committed.
                self.summary.notes.append(f"{b.name}: auto-disabled, no catch-up run")
                continue
            for i in range(5):
                key = f"{self.tag}-catch-up-{b.name}-{i}"
                run = self.db(
                    partial(
                        services.trigger,
                        b,
                        trigger="API",
                        idempotency_key=key,
                        requested_by=self.tag,
                    )
                )
                self.run_ids.add(run.id)
                self.summary.catch_up_runs += 1
                deadline = time.monotonic() + 60
                status = None
                while time.monotonic() < deadline:
                    status = self.db(
                        partial(Run.objects.values_list("status", flat=True).get, pk=run.pk)
                    )
                    if status in (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED):
                        break
                    time.sleep(0.1)
                if status == Status.SUCCEEDED:
                    break

    def _quiesce(self) -> None:
        """Faults off: resume, re-enable, stop the reconcilers (their slots are judged up
        to the next_fire_at they leave), then wait until every run is terminal."""
        self._resume_stopped(all_now=True)
        self._reenable(all_now=True)
        self._heal(all_now=True)
        for p in self.live("reconciler"):
            p.killed_by_us = True
            p.popen.send_signal(signal.SIGTERM)
        for p in self.procs:
            if p.role == "reconciler":
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(15)
        started = time.monotonic()
        scope = self._scope_filter()
        while time.monotonic() - started < self.o.quiesce_timeout:
            self._watch_processes()
            live = self.db(
                lambda: Run.objects.filter(scope).live().exclude(waiting_auto_disabled()).count()
            )
            if not live:
                break
            time.sleep(0.2)
        self.summary.quiesce_seconds = time.monotonic() - started
        self._catch_up()

    def _scope_filter(self) -> Any:
        return (
            Q(requested_by=self.tag) | Q(id__in=self.run_ids) | Q(schedule_id__in=self.schedule_ids)
        )

    def stale_sink_commits(self) -> list[str]:
        """Sink commits that a stale worker made after recovery had settled its attempt
        without a successor (CANCELLED or FAILED): nothing newer raised the run's sink
        fence, so the fence let the commit through. The database alone cannot tell this
        from a worker killed between its commit and its settlement; the worker's own log
        line ("attempt lost before its outcome was recorded outcome=SUCCEEDED", written
        after its commit) can."""
        found = []
        for p in self.procs:
            if p.role != "worker":
                continue
            for m in STALE_SUCCESS.finditer(p.log_path.read_text(errors="replace")):
                run = self.db(partial(Run.objects.filter(pk=m["run"]).first))
                if run is None or run.status == Status.SUCCEEDED:
                    continue  # a successor recorded ALREADY_COMMITTED: data once, run done
                if not self.sink_datasources or run.binding_id not in {
                    b.pk for b in self.bindings if b.sink_id == self.sink_datasources[0].pk
                }:
                    continue  # no fenced sink: nothing was written
                with psycopg.connect(
                    self.server.url(SINK_DATABASE), autocommit=True, application_name=APP_NAME
                ) as c:
                    fence = c.execute(
                        "SELECT token FROM public.dispatch_fence"
                        " WHERE run_id = %s AND committed_at IS NOT NULL",
                        [run.pk],
                    ).fetchone()
                if fence is not None and fence[0] == int(m["token"]):
                    found.append(
                        f"[stale_sink_commit] {run.pk}: {p.name} committed attempt "
                        f"{m['number']}'s data (token {m['token']}) to the sink after recovery "
                        f"had settled the attempt; the run is {run.status}"
                    )
        return found

    def _collect(self) -> None:
        from django.db.models import Count

        from dispatch.models import Worker

        s = self.summary
        scope = self._scope_filter()
        s.runs_created = len(self.run_ids)
        s.scheduled_runs = self.db(
            lambda: Run.objects.filter(schedule_id__in=self.schedule_ids).count()
        )
        s.statuses = dict(
            self.db(
                lambda: list(
                    Run.objects.filter(scope).values_list("status").annotate(n=Count("id"))
                )
            )
        )
        s.attempts_by_origin = dict(
            self.db(
                lambda: list(
                    Attempt.objects.filter(run__in=Run.objects.filter(scope))
                    .values_list("origin")
                    .annotate(n=Count("id"))
                )
            )
        )
        s.sliced_runs = dict(
            self.db(
                lambda: list(
                    Run.objects.filter(scope, binding__name__in=SLICED, parent__isnull=True)
                    .values_list("status")
                    .annotate(n=Count("id"))
                )
            )
        )
        s.slice_runs = dict(
            self.db(
                lambda: list(
                    Run.objects.filter(scope, parent__isnull=False)
                    .values_list("status")
                    .annotate(n=Count("id"))
                )
            )
        )
        s.throughput_during_faults = self.db(
            lambda: Run.objects.filter(
                scope,
                status=Status.SUCCEEDED,
                finished_at__gte=self.fault_start,
                finished_at__lte=self.fault_end,
            ).count()
        ) / max(1e-9, (self.fault_end - self.fault_start).total_seconds())
        # Stop the workers first so their final stats are written (SIGTERM drains).
        self.stop_all()
        for stats in self.db(lambda: list(Worker.objects.values_list("stats", flat=True))):
            for k, v in (stats or {}).items():
                if isinstance(v, int):
                    s.worker_stats[k] += v
        for p in self.procs:
            if p.role == "worker":
                s.fenced_commit_log_lines += p.log_path.read_text(errors="replace").count(
                    "stale commit refused by the sink fence"
                )
        report = self.db(
            lambda: invariants.check(
                invariants.Scope(
                    run_ids=frozenset(self.run_ids),
                    requested_by=self.tag,
                    schedule_ids=frozenset(self.schedule_ids),
                ),
                values=True,
                history={INCREMENTAL_TABLE: "public.events_history"},
                receipts=True,
            )
        )
        for item in report.incremental:
            b = next(b for b in self.incremental_bindings if b.pk == item.binding_id)
            unsucceeded = (
                Attempt.objects.filter(run__binding=b)
                .exclude(status=Status.SUCCEEDED)
                .values_list("reason")
                .annotate(n=Count("id"))
            )
            reasons: dict[str, int] = dict(self.db(partial(list, unsucceeded)))
            s.incremental[b.name] = (
                f"{item.versions} source versions, {item.sink_rows} sink rows, "
                f"{item.committed_attempts} committed attempts ({item.recorded} with their "
                f"cursors recorded, rows checked at {item.snapshots} committed snapshots), "
                f"attempts that did not succeed by reason {dict(sorted(reasons.items()))}"
            )
        s.auto_disabled = dict(
            self.db(
                lambda: list(
                    JobBinding.objects.filter(health__state=HealthState.AUTO_DISABLED)
                    .order_by("name")
                    .values_list("name", "health__reason")
                )
            )
        )
        s.waiting_auto_disabled = report.counts.get("waiting_auto_disabled", 0)
        s.violations = [str(v) for v in report.violations]
        stale = self.stale_sink_commits()
        s.stale_commits_accepted = len(stale)
        s.violations.extend(stale)
        s.notes.extend(report.notes)
        self._count_proxy_bytes()
        (self.o.out_dir / "run-ids.txt").write_text(
            "".join(f"{r}\n" for r in sorted(map(str, self.run_ids)))
        )
        (self.o.out_dir / "summary.json").write_text(
            json.dumps(
                {
                    **{
                        k: v
                        for k, v in vars(s).items()
                        if k not in ("faults", "refusals", "worker_stats")
                    },
                    "faults": dict(s.faults),
                    "refusals": dict(s.refusals),
                    "worker_stats": dict(s.worker_stats),
                    "invariants": report.render(),
                },
                indent=2,
                default=str,
            )
        )


def waiting_auto_disabled() -> Q:
    """Runs that wait, as the product promises, behind a binding its health scan disabled
    (the checker's `waits_behind_auto_disable`, as a filter): quiescence does not wait for
    them, the checker judges them."""
    blocked = Exists(
        Attempt.objects.filter(
            run_id=OuterRef("pk"),
            status=Status.PENDING,
            blocked_reason=BlockedReason.BINDING_DISABLED,
        )
    )
    return (
        Q(blocked)
        & Q(
            status=Status.PENDING,
            binding__enabled=False,
            binding__health__state=HealthState.AUTO_DISABLED,
        )
        & ~Q(binding__health__reason="")
    )


STALE_SUCCESS = re.compile(
    r"attempt lost before its outcome was recorded outcome=SUCCEEDED "
    r"run=(?P<run>[0-9a-f-]{36}) attempt=(?P<number>\d+) token=(?P<token>\d+)"
)


def _slot(p: Proc) -> str:
    return p.name.removeprefix("chaos-").split(".")[0]


def _worker_id(p: Proc) -> str:
    return p.name


def _datasource(name: str, kind: str, config: dict[str, Any]) -> Datasource:
    ds = Datasource(name=name, kind=kind)
    ds.config = config
    ds.full_clean()
    ds.save()
    return ds
