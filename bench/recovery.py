"""Recovery: 10,000 attempts whose lease has expired, settled by one `manage.py recover`
and by two running at once (side by side); attempts/s, and no duplicate: afterwards every
run has exactly one live attempt (asserted)."""

from __future__ import annotations

import re
import sys
import time
from typing import Any

from bench import common


def one_round(args: Any, env: dict[str, str], procs_n: int) -> dict[str, Any]:
    with common.connect(args.server, common.DISPATCH_DB) as conn:
        common.reset_dispatch(conn)
        # max_attempts 3, no backoff: each expired attempt 1 becomes RETRY_SCHEDULED with
        # a successor PENDING attempt 2 due at once.
        common.make_bindings(20, max_concurrency=8)
        common.bulk_runs(conn, args.attempts, status="RUNNING")
        conn.execute("ANALYZE dispatch_run, dispatch_attempt")
        t0 = time.monotonic()
        procs = [
            common.start(
                [sys.executable, str(common.ROOT / "manage.py"), "recover"],
                env,
                f"recovery-{procs_n}-{i}.log",
            )
            for i in range(procs_n)
        ]
        common.wait_procs(procs, timeout=900)
        wall = time.monotonic() - t0
        settled_lines = sum(
            int(m.group(1))
            for p in procs
            for m in re.finditer(r"settled (\d+) expired", p.output())
        )
        (span,) = conn.execute(
            "SELECT EXTRACT(EPOCH FROM max(finished_at) - min(finished_at))::float8 "
            "FROM dispatch_attempt WHERE number = 1"
        ).fetchone()
        check = conn.execute(
            """
            SELECT
              (SELECT count(*) FROM dispatch_attempt
                WHERE number = 1 AND status = 'RETRY_SCHEDULED' AND reason = 'LEASE_EXPIRED'),
              (SELECT count(*) FROM dispatch_attempt WHERE number = 2 AND status = 'PENDING'),
              (SELECT count(*) FROM dispatch_attempt WHERE number > 2),
              (SELECT count(*) FROM dispatch_run r WHERE (
                  SELECT count(*) FROM dispatch_attempt a
                   WHERE a.run_id = r.id AND a.status IN ('PENDING', 'RUNNING')) <> 1),
              (SELECT count(*) FROM dispatch_run WHERE status <> 'PENDING')
            """
        ).fetchone()
    expired, successors, beyond, not_one_live, runs_not_pending = check
    n = args.attempts
    # Zero duplicates: every run settled once, with exactly one live successor.
    assert expired == n, f"{expired} of {n} expired attempts settled"
    assert successors == n, f"{successors} successors for {n} runs"
    assert beyond == 0, f"{beyond} attempts beyond number 2 (a run settled twice)"
    assert not_one_live == 0, f"{not_one_live} runs without exactly one live attempt"
    assert runs_not_pending == 0, f"{runs_not_pending} runs whose status is not PENDING"
    assert settled_lines == n, f"the commands reported {settled_lines} settlements for {n}"
    return {"rate": n / span, "wall_rate": n / wall, "span": span, "wall": wall}


def main(argv: list[str]) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--attempts", type=common.positive, default=10_000)
    args = p.parse_args(argv)
    if args.quick:
        args.attempts, args.rounds = 1000, 1
    report = common.Report(
        "Recovery: expired leases settled in bulk", ["recovery", *argv], args.server
    )
    env = common.setup_django(args.server)
    results = common.alternate(
        args.rounds,
        {
            "one recover": lambda: one_round(args, env, 1),
            "two at once": lambda: one_round(args, env, 2),
        },
    )
    one, two = results["one recover"], results["two at once"]
    ratio = common.Spread([b["rate"] / a["rate"] for a, b in zip(one, two, strict=True)])
    wall_ratio = common.Spread(
        [b["wall_rate"] / a["wall_rate"] for a, b in zip(one, two, strict=True)]
    )
    report.add(
        f"{args.attempts:,} RUNNING attempts (lease_until one minute in the past, tokens from "
        "the real sequence) spread over 20 bindings, job `max_attempts` 3 with no backoff; "
        "settled by `manage.py recover` (one process, or two started together). Attempts/s "
        "in database time (first to last settlement) and in wall time (process start to "
        f"exit, Django start-up included); {args.rounds} alternated rounds. After every "
        "round the benchmark asserts: every attempt 1 is RETRY_SCHEDULED / LEASE_EXPIRED, "
        "every run has exactly one live attempt (its attempt 2, PENDING), no attempt 3 "
        "exists, and the commands' own counts add up to the attempts."
    )
    report.add(
        common.table(
            ["", "attempts/s (database time)", "attempts/s (wall)"],
            [
                [
                    "one `recover`",
                    common.Spread([r["rate"] for r in one]).fmt(0),
                    common.Spread([r["wall_rate"] for r in one]).fmt(0),
                ],
                [
                    "two at once",
                    common.Spread([r["rate"] for r in two]).fmt(0),
                    common.Spread([r["wall_rate"] for r in two]).fmt(0),
                ],
                ["two / one", ratio.fmt(), wall_ratio.fmt()],
            ],
        )
    )
    report.add(
        f"Duplicates: 0 in {2 * args.rounds} rounds ({2 * args.rounds * args.attempts:,} "
        "settlements checked); a round with any would have failed the run."
    )
    report.emit(doc=not args.no_doc)
    return 0
