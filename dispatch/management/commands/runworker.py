from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import OperationalError

from dispatch import checks
from dispatch.core import conf, deadline, hooks
from dispatch.ops import maintenance, metrics
from dispatch.worker.coordinator import WorkerDispatchCoordinator
from dispatch.worker.log import ensure_worker_logging

log = logging.getLogger("dispatch.worker")


class Command(BaseCommand):
    help = (
        "Claim and execute runs, and fire due schedules, until SIGTERM/SIGINT (drains "
        "within the grace period)."
    )
    requires_system_checks = "__all__"  # type: ignore[assignment]

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--concurrency", type=int, default=1, help="executor slots (default 1)")
        parser.add_argument(
            "--poll-interval",
            type=float,
            default=None,
            help="seconds between polls (default DISPATCH_POLL_INTERVAL)",
        )
        parser.add_argument("--worker-id", default=None, help="default: host:pid:random")
        scheduler = parser.add_mutually_exclusive_group()
        scheduler.add_argument(
            "--no-scheduler",
            action="store_true",
            help="do not run the schedule reconciler in this process (default: it runs "
            "when the scheduling app is installed; one per fleet is enough)",
        )
        scheduler.add_argument(
            "--scheduler",
            action="store_true",
            help="accepted for compatibility: the reconciler runs by default",
        )
        parser.add_argument(
            "--burst",
            action="store_true",
            help="exit once nothing is claimable now and executions have finished",
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=None,
            help="serve this worker's Prometheus metrics on this port "
            "(default DISPATCH_WORKER_METRICS_PORT; 0: none)",
        )
        parser.add_argument(
            "--metrics-addr",
            default=None,
            help="the address the metrics port binds to (default "
            "DISPATCH_WORKER_METRICS_ADDR, 127.0.0.1)",
        )
        parser.add_argument(
            "--no-maintenance",
            action="store_true",
            help="do not run the maintenance loop (retention) in this "
            "process (default: DISPATCH_MAINTENANCE)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["concurrency"] < 1:
            raise CommandError("--concurrency must be at least 1.")
        if options["poll_interval"] is not None and options["poll_interval"] <= 0:
            raise CommandError("--poll-interval must be positive.")
        port = (
            conf.worker_metrics_port()
            if options["metrics_port"] is None
            else options["metrics_port"]
        )
        if not 0 <= port <= 65535:
            raise CommandError(f"--metrics-port must be from 0 to 65535, got {port}.")
        ensure_worker_logging()
        # Before the first connection: every one of this process is bounded.
        deadline.bound_worker_sessions(conf.coordination_timeout())
        self._preflight()
        background: list[Callable[[threading.Event], None]] = []
        # The schedule reconciler, found through the scheduling app's AppConfig (dispatch
        # never imports it): a loop beside the engine, or under --burst one pass before
        # the drain, so that what is due now is fired and run before the worker exits.
        schedulers = [] if options["no_scheduler"] else hooks.schedulers()
        if options["scheduler"] and not schedulers:
            raise CommandError("--scheduler needs the scheduling app in INSTALLED_APPS.")
        wake_on: dict[str, threading.Event] = {}
        for scheduler in schedulers:
            if options["burst"]:
                if scheduler.once is not None:
                    scheduler.once()
                continue
            wake = None
            # (A channel that is the worker's own would take the runs' wake-ups from it:
            # such a loop listens on a connection of its own.)
            if scheduler.channel and scheduler.channel != conf.channel():
                # Its wake-ups come through the worker's LISTEN connection: no second
                # LISTEN connection per process.
                wake = wake_on.setdefault(scheduler.channel, threading.Event())
            background.append(scheduler.target(wake))
        if conf.maintenance_enabled() and not options["no_maintenance"]:
            background.append(maintenance.run_loop)
        coordinator = WorkerDispatchCoordinator(
            concurrency=options["concurrency"],
            poll_interval=options["poll_interval"],
            worker_id=options["worker_id"],
            burst=options["burst"],
            background=background,
            wake_on=wake_on,
        )
        if port:
            addr = options["metrics_addr"] or conf.worker_metrics_addr()
            try:
                server = metrics.serve_worker_metrics(coordinator, port, addr)
            except OSError as exc:
                raise CommandError(
                    f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}"
                ) from None
            log.info(
                "worker metrics on http://%s:%d/metrics worker=%s",
                addr,
                server.server_address[1],
                coordinator.worker_id,
            )
        coordinator.run()

    def _preflight(self) -> None:
        """PostgreSQL new enough and every migration applied, or a clear error (never a
        retry loop on a missing table). An unreachable database is not an error here:
        the worker waits for it, saying so."""
        try:
            errors = checks.check_postgresql_version(databases=["default"])
            missing = checks.migrations_error()
        except OperationalError:
            return
        if missing is not None:
            errors.append(missing)
        if errors:
            raise CommandError(
                "\n".join(f"{e.id}: {e.msg}" + (f" {e.hint}" if e.hint else "") for e in errors)
            )
