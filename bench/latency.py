"""Wake-up latency: trigger commit to claim with an idle worker, in database time, against
Procrastinate's defer-to-start and the raw floor (NOTIFY to a LISTENing connection, then
one trivial UPDATE ... RETURNING)."""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from typing import Any

from bench import common


def spacing(n: int, seed: int) -> list[float]:
    """The same pseudo-random gaps (50-100 ms) for every side of a round."""
    rnd = random.Random(seed)
    return [rnd.uniform(0.05, 0.10) for _ in range(n)]


def dispatch_round(args: Any, env: dict[str, str], seed: int) -> dict[str, Any]:
    from dispatch import services
    from dispatch.models import Worker

    with common.connect(args.server, common.DISPATCH_DB) as conn:
        common.reset_dispatch(conn)
        (binding,) = common.make_bindings(1, max_concurrency=4)
        procs = common.start_workers(1, args.concurrency, env, burst=False, tag="latency-dispatch")
        try:
            # Idle and listening: its LISTEN connection heard its own probe.
            common.wait_for(
                lambda: Worker.objects.filter(stats__listen_healthy=1).exists(),
                timeout=60,
                what="the dispatch worker to listen",
            )
            called: dict[str, float] = {}
            for gap in spacing(args.triggers, seed):
                before = time.time()  # the wall clock just before the call
                called[str(services.trigger(binding).pk)] = before
                time.sleep(gap)
            common.wait_for(
                lambda: conn.execute(
                    "SELECT count(*) = %s FROM dispatch_attempt WHERE status = 'SUCCEEDED'",
                    [args.triggers],
                ).fetchone()[0],
                timeout=120,
                what="every run to finish",
            )
        finally:
            # SIGTERM: the worker drains and writes its final stats at stop.
            common.stop_procs(procs, sig=signal.SIGTERM)
        ms = [
            (claimed - called[str(run_id)]) * 1000
            for run_id, claimed in conn.execute(
                "SELECT run_id, EXTRACT(EPOCH FROM claimed_at)::float8 FROM dispatch_attempt"
            )
        ]
        stats = conn.execute("SELECT stats FROM dispatch_worker").fetchone()[0] or {}
    return {
        "ms": ms,
        "hits": int(stats.get("directed_hits", 0)),
        "misses": int(stats.get("directed_misses", 0)),
    }


def peer_round(args: Any, seed: int) -> dict[str, Any]:
    common.reset_peer(args.server)
    procs = common.start_peer_workers(
        args.server, 1, args.concurrency, wait=True, tag="latency-peer"
    )
    with common.connect(args.server, common.PEER_DB) as conn:
        try:
            common.wait_for(
                lambda: conn.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE datname = %s AND query LIKE 'LISTEN%%'",
                    [common.PEER_DB],
                ).fetchone(),
                timeout=60,
                what="the Procrastinate worker to listen",
            )
            app = common.peer_app(common.db_url(args.server, common.PEER_DB))

            called: dict[int, float] = {}
            calls: list[float] = []

            async def defer_all() -> None:
                async with app.open_async():
                    task = app.tasks["noop"]
                    for gap in spacing(args.triggers, seed):
                        before = time.time()  # the wall clock just before the call
                        called[await task.defer_async()] = before
                        calls.append((time.time() - before) * 1000)
                        await asyncio.sleep(gap)

            asyncio.run(defer_all())
            common.wait_for(
                lambda: conn.execute(
                    "SELECT count(*) = %s FROM procrastinate_events WHERE type = 'succeeded'",
                    [args.triggers],
                ).fetchone()[0],
                timeout=120,
                what="every job to finish",
            )
        finally:
            common.stop_procs(procs, sig=signal.SIGTERM)
        ms = [
            (started - called[job_id]) * 1000
            for job_id, started in conn.execute(
                "SELECT job_id, EXTRACT(EPOCH FROM at)::float8 FROM procrastinate_events"
                " WHERE type = 'started'"
            )
        ]
    return {"ms": ms, "call_ms": calls}


def floor_round(args: Any, seed: int, *, durable: bool = False) -> dict[str, Any]:
    """NOTIFY from one connection; a LISTENing connection hears it and a second connection
    of the same listener does one UPDATE ... RETURNING; both stamps are clock_timestamp().
    `durable`: the stamp is taken by an INSERT in a transaction that commits (and waits for
    its WAL flush, as a trigger does) before the NOTIFY is sent."""
    channel = "bench_floor"
    ms: list[float] = []
    with (
        common.connect(args.server, common.DISPATCH_DB) as listen,
        common.connect(args.server, common.DISPATCH_DB) as work,
        common.connect(args.server, common.DISPATCH_DB) as notifier,
    ):
        work.execute("CREATE TABLE IF NOT EXISTS bench_floor (id int PRIMARY KEY, n bigint)")
        work.execute("INSERT INTO bench_floor VALUES (1, 0) ON CONFLICT DO NOTHING")
        work.execute("CREATE TABLE IF NOT EXISTS bench_floor_log (at timestamptz)")
        listen.execute(f"LISTEN {channel}")  # a constant identifier
        ready = threading.Event()

        def listener() -> None:
            ready.set()
            for note in listen.notifies(stop_after=args.triggers, timeout=120):
                (lag,) = work.execute(
                    "UPDATE bench_floor SET n = n + 1 WHERE id = 1 "
                    "RETURNING EXTRACT(EPOCH FROM clock_timestamp() - %s::timestamptz)::float8",
                    [note.payload],
                ).fetchone()
                ms.append(lag * 1000)

        t = threading.Thread(target=listener, daemon=True)
        t.start()
        ready.wait()
        time.sleep(0.2)  # let the listener enter its wait (the first sample only)
        for gap in spacing(args.triggers, seed):
            if durable:
                with notifier.transaction():
                    (at,) = notifier.execute(
                        "INSERT INTO bench_floor_log VALUES (clock_timestamp()) RETURNING at::text"
                    ).fetchone()
                notifier.execute("SELECT pg_notify(%s, %s)", [channel, at])
            else:
                notifier.execute("SELECT pg_notify(%s, clock_timestamp()::text)", [channel])
            time.sleep(gap)
        t.join(130)
    if len(ms) != args.triggers:
        raise RuntimeError(f"floor: heard {len(ms)} of {args.triggers} notifications")
    return {"ms": ms}


def pcts(ms: list[float]) -> tuple[float, float, float]:
    return common.percentile(ms, 50), common.percentile(ms, 95), common.percentile(ms, 99)


def main(argv: list[str]) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--triggers", type=common.positive, default=300)
    p.add_argument("--concurrency", type=common.positive, default=1)
    args = p.parse_args(argv)
    if args.quick:
        args.triggers, args.rounds = 40, 1
    report = common.Report("Wake-up latency: idle worker", ["latency", *argv], args.server)
    env = common.setup_django(args.server)
    common.ensure_peer_schema(args.server)
    seeds = iter(range(1000))
    round_seed = {"seed": 0}

    def next_seed() -> int:
        round_seed["seed"] = next(seeds)
        return round_seed["seed"]

    results = common.alternate(
        args.rounds,
        {
            "dispatch": lambda: dispatch_round(args, env, next_seed() // 5),
            "procrastinate": lambda: peer_round(args, next_seed() // 5),
            "floor": lambda: floor_round(args, next_seed() // 5),
            "floor+commit": lambda: floor_round(args, next_seed() // 5, durable=True),
        },
    )
    rows = []
    per = {name: [pcts(r["ms"]) for r in rs] for name, rs in results.items()}
    for name, label in (
        ("dispatch", "dispatch (trigger -> claim)"),
        ("procrastinate", "Procrastinate (defer -> start)"),
        ("floor", "floor (NOTIFY -> LISTEN -> UPDATE)"),
        ("floor+commit", "floor after a committed INSERT (not a goal; for reading)"),
    ):
        rows.append([label] + [common.Spread([x[i] for x in per[name]]).fmt(1) for i in range(3)])
    d, peer, floor = per["dispatch"], per["procrastinate"], per["floor"]
    med_peer = common.Spread([a[0] / b[0] for a, b in zip(d, peer, strict=True)])
    med_floor = common.Spread([a[0] / b[0] for a, b in zip(d, floor, strict=True)])
    p99_peer = common.Spread([a[2] / b[2] for a, b in zip(d, peer, strict=True)])
    hits = sum(r["hits"] for r in results["dispatch"])
    misses = sum(r["misses"] for r in results["dispatch"])
    ratio = hits / (hits + misses) if hits + misses else float("nan")
    report.add(
        f"One idle worker (`--concurrency {args.concurrency}`, production poll interval) per "
        f"side; {args.triggers} triggers per round through `dispatch.services.trigger` (the "
        "real path: run + attempt in one transaction, NOTIFY after the commit), 50-100 ms "
        "apart (the same seeded gaps for every side). Latency from the wall clock just "
        "before the call (`trigger()`, `defer_async()`; server and benchmark share the "
        "machine's clock) to the database's stamp of the start: dispatch `claimed_at`, "
        "Procrastinate's `started` event; the floor's two `clock_timestamp()` stamps. "
        "Milliseconds, "
        f"median (min-max) over {args.rounds} alternated rounds of each round's percentile. "
        "One side is for reading, not a goal: the floor after a committed INSERT (a "
        "durable enqueue costs a WAL flush before its NOTIFY, for dispatch and "
        "Procrastinate alike)."
    )
    report.add(common.table(["", "p50 ms", "p95 ms", "p99 ms"], rows))
    report.add(
        common.table(
            ["ratio", "median (min-max)", "goal"],
            [
                [
                    "dispatch p50 / Procrastinate p50",
                    med_peer.fmt(),
                    f"<= 0.75 {common.verdict(med_peer.median <= 0.75)}",
                ],
                [
                    "dispatch p50 / floor p50",
                    med_floor.fmt(),
                    f"<= 1.5 {common.verdict(med_floor.median <= 1.5)}",
                ],
                [
                    "dispatch p50 / floor-after-commit p50",
                    common.Spread(
                        [a[0] / b[0] for a, b in zip(d, per["floor+commit"], strict=True)]
                    ).fmt(),
                    "for reading",
                ],
                [
                    "dispatch p99 / Procrastinate p99",
                    p99_peer.fmt(),
                    f"<= 1.0 {common.verdict(p99_peer.median <= 1.0)}",
                ],
                [
                    "directed-claim hit ratio (hits / (hits + misses))",
                    f"{ratio:.3f} ({hits} / {hits + misses})",
                    f">= 0.95 {common.verdict(ratio >= 0.95)}",
                ],
            ],
        )
    )
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, label in (
        ("dispatch", "dispatch"),
        ("procrastinate", "Procrastinate"),
        ("floor", "NOTIFY floor"),
        ("floor+commit", "NOTIFY floor after a commit"),
    ):
        xs = sorted(x for r in results[name] for x in r["ms"])
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("wake-up latency, ms (database time, log scale)")
    ax.set_ylabel("fraction of wake-ups")
    ax.set_title("Idle worker: trigger commit to claim")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    path = common.plot_path("latency-cdf.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    report.add(f"![latency CDF](benchmarks/{path.name})")
    report.emit(doc=not args.no_doc)
    return 0
