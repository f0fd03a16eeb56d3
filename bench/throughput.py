"""Throughput: no-op runs drained by worker processes, against Procrastinate draining no-op
jobs with the same processes and concurrency, and against pgbench running dispatch's own
lifecycle statements (the ceiling of the database for this work).

All three are timed in database time: first claim (or start) to last finish.
"""

from __future__ import annotations

import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common

# One lifecycle through the statements the product runs: the trigger (one call of
# `dispatch_trigger_v4`, without the wake-up: the workers here are pgbench's clients), the worker's claim (`dispatch_claim_v5`, limit 1) and its
# settlement (`dispatch_settle_v3`). `:b` picks one of the bindings; `\gset` keeps the
# claim's output.
PGBENCH_SCRIPT = """\
\\set b random(0, {last})
SELECT count(*) FROM dispatch_trigger_v4(ARRAY[gen_random_uuid()],
  ARRAY(SELECT id FROM dispatch_jobbinding WHERE name = 'bench-' || :b), 'API', '',
  NULL, NULL, NULL);
SELECT attempt_id, lease_token FROM dispatch_claim_v5('pgbench', NULL, 1) \\gset
SELECT dispatch_settle_v3(':attempt_id'::uuid, :lease_token, 'SUCCEEDED', NULL, NULL, 0, 0,
                         NULL, NULL, NULL);
"""


def dispatch_round(args: Any, env: dict[str, str]) -> dict[str, float]:
    """Warm workers, then `args.runs` runs released at once: one `trigger_many` call (one
    statement and transaction, a wake-up per run). With `--burst`: the runs queued first,
    then drained by `runworker --burst` processes."""
    from dispatch import services
    from dispatch.models import JobBinding, Worker

    with common.connect(args.server, common.DISPATCH_DB) as conn:
        common.reset_dispatch(conn)
        common.make_bindings(args.bindings, max_concurrency=args.max_concurrency)
        if args.burst:
            common.bulk_runs(conn, args.runs)
        conn.execute("ANALYZE dispatch_run, dispatch_attempt")
        procs = common.start_workers(
            args.workers, args.concurrency, env, burst=args.burst, tag="throughput-dispatch"
        )
        try:
            if not args.burst:
                common.wait_for(
                    lambda: Worker.objects.filter(stats__listen_healthy=1).count() == args.workers,
                    timeout=120,
                    what=f"{args.workers} dispatch workers listening",
                )
                bindings = list(JobBinding.objects.order_by("name"))
                release = [bindings[i % len(bindings)] for i in range(args.runs)]
                time.sleep(common.STATS_SETTLE)  # start-up's counters published first
            work0 = common.counters(args.server, common.DISPATCH_DB)
            cpu0 = common.cpu_seconds(procs)
            if not args.burst:
                services.trigger_many(release, requested_by="bench")
                common.wait_for(
                    lambda: (
                        conn.execute(
                            "SELECT count(*) FROM dispatch_attempt WHERE status = 'SUCCEEDED'"
                        ).fetchone()[0]
                        >= args.runs
                    ),
                    timeout=900,
                    what="every run to finish",
                    interval=0.5,
                )
                cpu1 = common.cpu_seconds(procs)
            else:
                cpu1 = common.wait_procs_cpu(procs, timeout=900)
        finally:
            common.stop_procs(procs, sig=signal.SIGTERM)
        time.sleep(common.STATS_SETTLE)
        work = common.delta(work0, common.counters(args.server, common.DISPATCH_DB))
        done, span = conn.execute(
            """
            SELECT count(*) FILTER (WHERE status = 'SUCCEEDED'),
                   EXTRACT(EPOCH FROM max(finished_at) - min(claimed_at))::float8
              FROM dispatch_attempt
            """
        ).fetchone()
        if done != args.runs:
            raise RuntimeError(f"dispatch: {done} of {args.runs} runs succeeded")
        stats = conn.execute(
            "SELECT coalesce(sum((stats->>'claims_generic')::int), 0), "
            "coalesce(sum((stats->>'directed_misses')::int), 0), "
            "coalesce(sum((stats->>'claims_at_settlement')::int), 0) FROM dispatch_worker"
        ).fetchone()
    return {
        "rate": args.runs / span,
        "span": span,
        "generic": stats[0],
        "misses": stats[1],
        "at_settlement": stats[2],
        "tx_per_run": work["xact"] / args.runs,
        "tup_per_run": work["tup"] / args.runs,
        **common.cpu_per_run(cpu0, cpu1, args.runs),
    }


def peer_round(args: Any) -> dict[str, float]:
    """Warm Procrastinate workers, then `args.runs` jobs released at once: one
    `batch_defer` (one INSERT, a notification per job). With `--burst`: queued first and
    drained by workers started with `wait=False`."""
    common.reset_peer(args.server)
    if args.burst:
        common.peer_defer(args.server, args.runs)
    with common.connect(args.server, common.PEER_DB) as conn:
        conn.execute("ANALYZE procrastinate_jobs, procrastinate_events")
        procs = common.start_peer_workers(
            args.server, args.workers, args.concurrency, wait=not args.burst,
            tag="throughput-peer",
        )  # fmt: skip
        try:
            if not args.burst:
                common.wait_for(
                    lambda: (
                        conn.execute(
                            "SELECT count(*) FROM pg_stat_activity"
                            " WHERE datname = %s AND query LIKE 'LISTEN%%'",
                            [common.PEER_DB],
                        ).fetchone()[0]
                        >= args.workers
                    ),
                    timeout=120,
                    what=f"{args.workers} Procrastinate workers listening",
                )
                time.sleep(common.STATS_SETTLE)
            work0 = common.counters(args.server, common.PEER_DB)
            cpu0 = common.cpu_seconds(procs)
            if not args.burst:
                common.peer_defer(args.server, args.runs, batch=args.runs)
                common.wait_for(
                    lambda: (
                        conn.execute(
                            "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
                        ).fetchone()[0]
                        >= args.runs
                    ),
                    timeout=900,
                    what="every job to finish",
                    interval=0.5,
                )
                cpu1 = common.cpu_seconds(procs)
            else:
                cpu1 = common.wait_procs_cpu(procs, timeout=900)
        finally:
            common.stop_procs(procs, sig=signal.SIGTERM)
        time.sleep(common.STATS_SETTLE)
        work = common.delta(work0, common.counters(args.server, common.PEER_DB))
        done, span = conn.execute(
            """
            SELECT count(*) FILTER (WHERE type = 'succeeded'),
                   EXTRACT(EPOCH FROM max(at) FILTER (WHERE type = 'succeeded')
                                    - min(at) FILTER (WHERE type = 'started'))::float8
              FROM procrastinate_events
            """
        ).fetchone()
    if done != args.runs:
        raise RuntimeError(f"procrastinate: {done} of {args.runs} jobs succeeded")
    return {
        "rate": args.runs / span,
        "span": span,
        "tx_per_run": work["xact"] / args.runs,
        "tup_per_run": work["tup"] / args.runs,
        **common.cpu_per_run(cpu0, cpu1, args.runs),
    }


def ceiling_round(args: Any) -> dict[str, float]:
    clients = args.workers * args.concurrency
    per_client = max(1, args.runs // clients)
    with common.connect(args.server, common.DISPATCH_DB) as conn:
        common.reset_dispatch(conn)
        common.make_bindings(args.bindings, max_concurrency=args.max_concurrency)
        # Slack: a claim always finds a pending attempt even when every client's own
        # insert was taken by another client (a claim that returns no row ends pgbench).
        common.bulk_runs(conn, 1000)
        conn.execute("ANALYZE dispatch_run, dispatch_attempt")
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(PGBENCH_SCRIPT.format(last=args.bindings - 1))
    try:
        out = subprocess.run(
            [
                "pgbench",
                "-n",
                "-M",
                "simple",
                "-c",
                str(clients),
                "-j",
                "2",
                "-t",
                str(per_client),
                "-f",
                f.name,
                common.db_url(args.server, common.DISPATCH_DB),
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        Path(f.name).unlink()
    if out.returncode != 0:
        raise RuntimeError(f"pgbench failed:\n{out.stdout}\n{out.stderr}")
    m = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out.stdout)
    if m is None:
        raise RuntimeError(f"no tps in pgbench output:\n{out.stdout}")
    failed = re.search(r"number of failed transactions: (\d+)", out.stdout)
    if failed and int(failed.group(1)):
        raise RuntimeError(f"pgbench had failed transactions:\n{out.stdout}")
    return {"rate": float(m.group(1)), "lifecycles": per_client * clients}


def main(argv: list[str]) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=common.positive, default=5000)
    p.add_argument("--workers", type=common.positive, default=2)
    p.add_argument("--concurrency", type=common.positive, default=4)
    p.add_argument("--bindings", type=common.positive, default=20)
    p.add_argument("--max-concurrency", type=common.positive, default=8)
    p.add_argument(
        "--burst",
        action="store_true",
        help="queue the runs first and drain them with --burst workers (the old shape)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.rounds = 400, 1
    report = common.Report("Throughput: no-op runs, end to end", ["throughput", *argv], args.server)
    env = common.setup_django(args.server)
    common.ensure_peer_schema(args.server)

    results = common.alternate(
        args.rounds,
        {
            "dispatch": lambda: dispatch_round(args, env),
            "procrastinate": lambda: peer_round(args),
            "pgbench": lambda: ceiling_round(args),
        },
    )
    d = [r["rate"] for r in results["dispatch"]]
    peer = [r["rate"] for r in results["procrastinate"]]
    ceil = [r["rate"] for r in results["pgbench"]]
    vs_peer = common.Spread([a / b for a, b in zip(d, peer, strict=True)])
    vs_ceil = common.Spread([a / b for a, b in zip(d, ceil, strict=True)])
    clients = args.workers * args.concurrency
    if args.burst:
        shape = (
            f"{args.runs} no-op runs queued first, then drained by {args.workers} "
            f"`runworker --burst` processes with `--concurrency {args.concurrency}`; "
            f"Procrastinate {common._version('procrastinate')}: {args.runs} jobs queued, "
            f"{args.workers} worker processes with concurrency {args.concurrency}, `wait=False`"
        )
    else:
        shape = (
            f"{args.workers} warm `runworker` processes with `--concurrency {args.concurrency}` "
            f"(listening, idle), then {args.runs} no-op runs released at once: one "
            "`trigger_many` call (one statement, a wake-up per run); Procrastinate "
            f"{common._version('procrastinate')}: {args.workers} warm worker processes with "
            f"concurrency {args.concurrency}, then {args.runs} jobs of an async no-op task in "
            "one `batch_defer` (one statement, a notification per job)"
        )
    report.add(
        f"{shape}. Runs are `generate` 0 rows -> `null` over {args.bindings} bindings "
        f"(max_concurrency {args.max_concurrency}). pgbench: {clients} clients, each script "
        "one lifecycle through the product's statements (`dispatch_trigger_v4`, "
        "`dispatch_claim_v5` limit 1, `dispatch_settle_v3`). Rates in database time (first "
        f"claim or start to last finish); {args.rounds} alternated rounds. CPU per run: the "
        "worker processes and the whole PostgreSQL server (every backend, the benchmark's "
        "own polling included) from the release to the last finish. Transactions and "
        "tuples read (`tup_returned + tup_fetched`) per run: the database's "
        "pg_stat_database counters from the release to after the workers stopped "
        "(published counters, read after an 11 s settle; the workers' stop and the "
        "benchmark's own completion poll included)."
    )

    def cpu(rows: list[dict[str, Any]], key: str) -> str:
        values = [r[key] for r in rows if r.get(key) is not None]
        return common.Spread(values).fmt(2) if values else "n/a"

    report.add(
        common.table(
            ["", "median (min-max)"],
            [
                ["dispatch runs/s", common.Spread(d).fmt(0)],
                ["Procrastinate jobs/s", common.Spread(peer).fmt(0)],
                ["pgbench ceiling lifecycles/s", common.Spread(ceil).fmt(0)],
                [
                    "**dispatch / Procrastinate** (goal >= 1.5)",
                    f"**{vs_peer.fmt()}** {common.verdict(vs_peer.median >= 1.5)}",
                ],
                [
                    "**dispatch / ceiling** (goal >= 0.5)",
                    f"**{vs_ceil.fmt()}** {common.verdict(vs_ceil.median >= 0.5)}",
                ],
                ["dispatch transactions per run", cpu(results["dispatch"], "tx_per_run")],
                [
                    "Procrastinate transactions per run",
                    cpu(results["procrastinate"], "tx_per_run"),
                ],
                ["dispatch tuples read per run", cpu(results["dispatch"], "tup_per_run")],
                [
                    "Procrastinate tuples read per run",
                    cpu(results["procrastinate"], "tup_per_run"),
                ],
                ["dispatch CPU ms per run: workers", cpu(results["dispatch"], "workers_ms")],
                ["dispatch CPU ms per run: server", cpu(results["dispatch"], "server_ms")],
                [
                    "Procrastinate CPU ms per run: workers",
                    cpu(results["procrastinate"], "workers_ms"),
                ],
                [
                    "Procrastinate CPU ms per run: server",
                    cpu(results["procrastinate"], "server_ms"),
                ],
            ],
        )
    )
    misses = sum(r["misses"] for r in results["dispatch"])
    refills = sum(r["at_settlement"] for r in results["dispatch"])
    total = args.runs * args.rounds
    report.add(
        f"Directed-claim misses reported by the dispatch workers: {misses}; runs claimed by "
        f"the settlement of the slot's previous run (one call, `dispatch_settle_claim_v6`): "
        f"{refills} of {total}."
    )
    report.emit(doc=not args.no_doc)
    return 0
