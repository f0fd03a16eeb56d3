"""Where an idle worker's wake-up goes, stage by stage, beside Procrastinate's.

The wake-up benchmark (`bench latency`) measures from the wall clock before `trigger()`
to `claimed_at`. This one splits that interval with timestamps taken inside a real
`runworker` process (the stock worker, with two methods wrapped from outside to note the
wall clock: when its wait ends with the notification, and when it calls the claim), and
measures what the chain costs when nothing else runs: the trigger's own call with the
benchmark's gaps and back to back, and a bare round trip the same two ways.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench import common
from bench.latency import peer_round, spacing

TRACE_DIR = common.RESULTS / "wakesplit"


def worker_main(argv: list[str]) -> int:
    """`python -m bench wakesplit --worker TRACE runworker-args...`: the stock worker,
    noting per directed claim (run, notification read, claim called, claim answered)."""
    trace = Path(argv[0])
    import django

    django.setup()
    from django.core.management import execute_from_command_line

    from dispatch.worker import claims, coordinator

    cls = coordinator.WorkerDispatchCoordinator
    wait, admit = cls._wait, cls._claim_notified
    claim = claims.claim
    noted: dict[str, float] = {}

    def traced_wait(self: Any, timeout: float) -> None:
        wait(self, timeout)
        noted["woke"] = time.time()

    def traced_claim(*args: Any, **kwargs: Any) -> Any:
        noted["called"] = time.time()
        return claim(*args, **kwargs)

    def traced_admit(self: Any, run_id: uuid.UUID, *args: Any) -> int:
        got = admit(self, run_id, *args)
        answered = time.time()
        with trace.open("a") as f:
            f.write(f"{run_id} {noted['woke']} {noted['called']} {answered}\n")
        return got

    cls._wait = traced_wait  # type: ignore[method-assign]
    cls._claim_notified = traced_admit  # type: ignore[method-assign]
    claims.claim = traced_claim
    execute_from_command_line(["manage.py", "runworker", *argv[1:]])
    return 0


def dispatch_round(args: Any, env: dict[str, str], seed: int) -> dict[str, list[float]]:
    from dispatch import services
    from dispatch.models import Worker

    TRACE_DIR.mkdir(parents=True, exist_ok=True)
    trace = TRACE_DIR / f"trace-{seed}.txt"
    trace.unlink(missing_ok=True)
    with common.connect(args.server, common.DISPATCH_DB) as conn:
        common.reset_dispatch(conn)
        (binding,) = common.make_bindings(1, max_concurrency=4)
        argv = [sys.executable, "-m", "bench", "wakesplit", "--worker", str(trace)]
        argv += ["--worker-id", "wakesplit", "--concurrency", "1"]
        procs = [common.start(argv, env, "wakesplit-worker.log")]
        try:
            common.wait_for(
                lambda: Worker.objects.filter(stats__listen_healthy=1).exists(),
                timeout=60,
                what="the dispatch worker to listen",
            )
            called: dict[str, tuple[float, float]] = {}
            for gap in spacing(args.triggers, seed):
                before = time.time()
                run_id = str(services.trigger(binding).pk)
                called[run_id] = (before, time.time())
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
            common.stop_procs(procs, sig=signal.SIGTERM)
        claimed = {
            str(run_id): at
            for run_id, at in conn.execute(
                "SELECT run_id, EXTRACT(EPOCH FROM claimed_at)::float8 FROM dispatch_attempt"
            )
        }
    out: dict[str, list[float]] = {k: [] for k in STAGES}
    for line in trace.read_text().splitlines():
        run_id, woke, call, answered = line.split()
        if run_id not in called:
            continue
        before, after = called[run_id]
        at = claimed[run_id]
        for key, ms in (
            ("call", after - before),
            ("notified", float(woke) - before),
            ("python", float(call) - float(woke)),
            ("claim", at - float(call)),
            ("answer", float(answered) - at),
            ("total", at - before),
        ):
            out[key].append(ms * 1000)
    return out


def peer(args: Any, seed: int) -> dict[str, list[float]]:
    """The wake-up benchmark's Procrastinate round: defer call and wake-up, milliseconds."""
    got = peer_round(args, seed)
    return {"call": got["call_ms"], "total": got["ms"]}


def idle_round(args: Any, seed: int) -> dict[str, list[float]]:
    """The same statements with the benchmark's gaps and back to back, on one connection:
    what an idle machine adds to each."""
    with common.connect(args.server, common.DISPATCH_DB) as conn:
        common.reset_dispatch(conn)
        (binding,) = common.make_bindings(1, max_concurrency=4)
        binding_id = binding.pk

        def call() -> None:
            conn.execute(
                "CALL dispatch_trigger_notify_v4('wakesplit_nobody', %s::uuid[], %s::uuid[],"
                " 'API', 'bench', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
                [[uuid.uuid4()], [binding_id]],
            ).fetchone()

        def select_one() -> None:
            conn.execute("SELECT 1").fetchone()

        out: dict[str, list[float]] = {}
        for name, fn in (("trigger", call), ("select", select_one)):
            for spaced in (True, False):
                ms = []
                for gap in spacing(args.triggers, seed):
                    t = time.perf_counter()
                    fn()
                    ms.append((time.perf_counter() - t) * 1000)
                    if spaced:
                        time.sleep(gap)
                out[f"{name}-{'spaced' if spaced else 'busy'}"] = ms
        common.reset_dispatch(conn)
    return out


STAGES = ("call", "notified", "python", "claim", "answer", "total")


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--worker":
        return worker_main(argv[1:])
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--triggers", type=common.positive, default=200)
    args = p.parse_args(argv)
    args.concurrency = 1  # one idle worker per side, as the wake-up benchmark's default
    if args.quick:
        args.triggers, args.rounds = 30, 1
    report = common.Report("Wake-up: where it goes", ["wakesplit", *argv], args.server)
    env = common.setup_django(args.server)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.ROOT), env.get("PYTHONPATH")]))
    common.ensure_peer_schema(args.server)
    seeds = iter(range(1000))
    results = common.alternate(
        args.rounds,
        {
            "dispatch": lambda: dispatch_round(args, env, next(seeds)),
            "procrastinate": lambda: peer(args, next(seeds)),
            "idle": lambda: idle_round(args, next(seeds)),
        },
    )

    def cell(name: str, key: str, p: float) -> str:
        return common.Spread([common.percentile(r[key], p) for r in results[name] if r[key]]).fmt(2)

    rows = [
        ["dispatch: `trigger()` call, client side", cell("dispatch", "call", 50), cell("dispatch", "call", 90)],
        ["dispatch: call start -> the worker has the notification", cell("dispatch", "notified", 50), cell("dispatch", "notified", 90)],
        ["dispatch: notification -> claim called (the worker's Python: read, rank, admit)", cell("dispatch", "python", 50), cell("dispatch", "python", 90)],
        ["dispatch: claim called -> `claimed_at` (deadline, cursor, send, the server up to the stamp)", cell("dispatch", "claim", 50), cell("dispatch", "claim", 90)],
        ["dispatch: `claimed_at` -> the claim's answer (snapshot, commit, reply)", cell("dispatch", "answer", 50), cell("dispatch", "answer", 90)],
        ["**dispatch: call start -> `claimed_at` (the wake-up)**", cell("dispatch", "total", 50), cell("dispatch", "total", 90)],
        ["Procrastinate: `defer_async()` call, client side", cell("procrastinate", "call", 50), cell("procrastinate", "call", 90)],
        ["**Procrastinate: call start -> `started` (the wake-up)**", cell("procrastinate", "total", 50), cell("procrastinate", "total", 90)],
    ]  # fmt: skip
    idle = [
        ["`CALL dispatch_trigger_notify_v4` (the trigger's one round trip)", cell("idle", "trigger-spaced", 50), cell("idle", "trigger-busy", 50)],
        ["`SELECT 1`", cell("idle", "select-spaced", 50), cell("idle", "select-busy", 50)],
    ]  # fmt: skip
    report.add(
        f"One idle worker per side (`--concurrency 1`), {args.triggers} triggers per round "
        "with the wake-up benchmark's seeded gaps (50-100 ms); "
        f"{args.rounds} alternated rounds, median (min-max) of each round's percentile, "
        "milliseconds. The dispatch worker is the stock `runworker` started through "
        "`python -m bench wakesplit --worker`, which wraps two of its methods to note the "
        "wall clock when its wait ends and when it calls the claim (`time.time()`, the "
        "clock `claimed_at` is compared with). Stages overlap nothing: each starts where "
        "the one above ends, except the first (the trigger's return comes after the "
        "worker already has the notification, which the second row shows)."
    )
    report.add(common.table(["stage", "p50 ms", "p90 ms"], rows))
    report.add(
        "The same statement on one connection, with the gaps and back to back (p50 ms): "
        "what an idle machine adds to each round trip."
    )
    report.add(common.table(["statement", "with the gaps", "back to back"], idle))
    report.emit(doc=not args.no_doc)
    return 0
