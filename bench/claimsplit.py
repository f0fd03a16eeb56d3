"""Where a directed claim's time goes: from the claim statement's start to `claimed_at`
(the stamp the wake-up benchmark measures to), to the end of the claim function, and the
whole round trip with its commit; one connection, no contention."""

from __future__ import annotations

import time
from typing import Any

from bench import common

CLAIM = (
    "SELECT EXTRACT(EPOCH FROM statement_timestamp())::float8,"
    " EXTRACT(EPOCH FROM clock_timestamp())::float8, c.attempt_id"
    " FROM dispatch_claim_v5(%s, %s, 1, false) c"
)


def sample(args: Any) -> dict[str, list[float]]:
    from dispatch import services
    from dispatch.worker import claims

    out: dict[str, list[float]] = {"stamp": [], "function": [], "round trip": [], "trigger": []}
    with common.connect(args.server, common.DISPATCH_DB) as conn:
        common.reset_dispatch(conn)
        (binding,) = common.make_bindings(1, max_concurrency=4)
        for _ in range(args.samples):
            called = time.perf_counter()
            run = services.trigger(binding)
            out["trigger"].append((time.perf_counter() - called) * 1000)
            before = time.perf_counter()
            started, ended, attempt_id = conn.execute(CLAIM, ["bench-split", run.pk]).fetchone()
            trip = time.perf_counter() - before
            claimed, token = conn.execute(
                "SELECT EXTRACT(EPOCH FROM claimed_at)::float8, lease_token"
                " FROM dispatch_attempt WHERE id = %s",
                [attempt_id],
            ).fetchone()
            out["stamp"].append((claimed - started) * 1000)
            out["function"].append((ended - started) * 1000)
            out["round trip"].append(trip * 1000)
            claims.settle(attempt_id, token, "SUCCEEDED")
    return out


def main(argv: list[str]) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--samples", type=common.positive, default=300)
    args = p.parse_args(argv)
    if args.quick:
        args.samples, args.rounds = 30, 1
    report = common.Report(
        "Directed claim: where its time goes", ["claimsplit", *argv], args.server
    )
    common.setup_django(args.server)
    rounds = common.alternate(args.rounds, {"claim": lambda: sample(args)})["claim"]
    labels = {
        "stamp": "`claimed_at` (the wake-up's stamp)",
        "function": "the claim function's end",
        "round trip": "the client's answer (commit included)",
    }
    labels_trigger = {"trigger": "`services.trigger()` (run, attempt 1, commit, NOTIFY)"}

    def percentiles(parts: dict[str, str]) -> list[list[str]]:
        return [
            [
                label,
                common.Spread([common.percentile(r[part], 50) for r in rounds]).fmt(2),
                common.Spread([common.percentile(r[part], 99) for r in rounds]).fmt(2),
            ]
            for part, label in parts.items()
        ]

    rows = percentiles(labels)
    report.add(
        f"One run triggered, then claimed by `dispatch_claim_v5(worker, run, 1, false)` (the "
        f"directed claim a woken worker makes) on one autocommit connection, then settled; "
        f"{args.samples} claims per round, {args.rounds} rounds, median (min-max) of each "
        "round's percentile, milliseconds. *stamp*: `claimed_at` minus the claim statement's "
        "`statement_timestamp()`; *function*: `clock_timestamp()` after the function returned "
        "minus the same start; *round trip*: the client's time for the statement, commit "
        "included."
    )
    report.add(common.table(["from the claim statement's start to", "p50 ms", "p99 ms"], rows))
    trigger_rows = percentiles(labels_trigger)
    report.add(
        "And the trigger before each claim, timed by the client from the call to its "
        "return (the wake-up benchmark's clock starts just before that call):"
    )
    report.add(common.table(["call", "p50 ms", "p99 ms"], trigger_rows))
    report.emit(doc=not args.no_doc)
    return 0
