from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from django.apps import apps
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import OperationalError
from django.utils.module_loading import import_string

from dispatch import checks, conf, deadline
from dispatch.ops import maintenance, metrics
from dispatch.worker.coordinator import WorkerDispatchCoordinator
from dispatch.worker.log import ensure_worker_logging

log = logging.getLogger("dispatch.worker")


class Command(BaseCommand):
    help = "Claim and execute runs until SIGTERM/SIGINT (drains within the grace period)."
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
        parser.add_argument(
            "--scheduler",
            action="store_true",
            help="also run the schedule reconciler loop in this process",
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
        if options["scheduler"]:
            if not apps.is_installed("scheduling"):
                raise CommandError("--scheduler needs the scheduling app in INSTALLED_APPS.")
            background.append(import_string("scheduling.reconciler.run_loop"))
        if conf.maintenance_enabled() and not options["no_maintenance"]:
            background.append(maintenance.run_loop)
        coordinator = WorkerDispatchCoordinator(
            concurrency=options["concurrency"],
            poll_interval=options["poll_interval"],
            worker_id=options["worker_id"],
            burst=options["burst"],
            background=background,
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
