"""Throughput: no-op runs drained by worker processes, against Procrastinate draining no-op
jobs with the same processes and concurrency, and against pgbench running dispatch's own
lifecycle statements (the ceiling of the database for this work).

All three are timed in database time: first claim (or start) to last finish.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench import common

# One lifecycle: the trigger's two inserts in one transaction, the claim function, the
# settle function. `:b` picks one of the bindings; `\gset` keeps the claim's output.
PGBENCH_SCRIPT = """\
\\set b random(0, {last})
BEGIN;
SELECT gen_random_uuid() AS run \\gset
INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at, requested_by)
  SELECT ':run'::uuid, id, 'API', 'PENDING', now(), '' FROM dispatch_jobbinding
   WHERE name = 'bench-' || :b;
INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at, available_at,
                              error, rows_read, rows_written)
  VALUES (gen_random_uuid(), ':run'::uuid, 1, 'TRIGGER', 'PENDING', now(), now(), '', 0, 0);
COMMIT;
SELECT attempt_id, lease_token FROM dispatch_claim_v1('pgbench', NULL, 1) \\gset
SELECT dispatch_settle_v1(':attempt_id'::uuid, :lease_token, 'SUCCEEDED', NULL, NULL, 0, 0);
"""


def dispatch_round(args: Any, env: dict[str, str]) -> dict[str, float]:
    with common.connect(args.server, common.DISPATCH_DB) as conn:
        common.reset_dispatch(conn)
        common.make_bindings(args.bindings, max_concurrency=args.max_concurrency)
        common.bulk_runs(conn, args.runs)
        conn.execute("ANALYZE dispatch_run, dispatch_attempt")
        procs = common.start_workers(
            args.workers, args.concurrency, env, burst=True, tag="throughput-dispatch"
        )
        common.wait_procs(procs, timeout=900)
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
            "coalesce(sum((stats->>'directed_misses')::int), 0) FROM dispatch_worker"
        ).fetchone()
    return {"rate": args.runs / span, "span": span, "generic": stats[0], "misses": stats[1]}


def peer_round(args: Any) -> dict[str, float]:
    common.reset_peer(args.server)
    common.peer_defer(args.server, args.runs)
    with common.connect(args.server, common.PEER_DB) as conn:
        conn.execute("ANALYZE procrastinate_jobs, procrastinate_events")
        procs = common.start_peer_workers(
            args.server, args.workers, args.concurrency, wait=False, tag="throughput-peer"
        )
        common.wait_procs(procs, timeout=900)
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
    return {"rate": args.runs / span, "span": span}


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
    report.add(
        f"{args.runs} no-op runs (`generate` 0 rows -> `null`) pre-enqueued over "
        f"{args.bindings} bindings (max_concurrency {args.max_concurrency}), drained by "
        f"{args.workers} `runworker --burst` processes with `--concurrency {args.concurrency}`; "
        f"Procrastinate {common._version('procrastinate')}: {args.runs} jobs of an async no-op "
        f"task, {args.workers} worker processes with concurrency {args.concurrency}, "
        f"`wait=False`; pgbench: {clients} clients, each script one lifecycle (the trigger's "
        "two inserts in a transaction, `dispatch_claim_v1` limit 1, `dispatch_settle_v1`). "
        f"Rates in database time (first claim or start to last finish); {args.rounds} "
        "alternated rounds."
    )
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
            ],
        )
    )
    misses = sum(r["misses"] for r in results["dispatch"])
    report.add(f"Directed-claim misses reported by the dispatch workers: {misses}.")
    report.emit(doc=not args.no_doc)
    return 0
