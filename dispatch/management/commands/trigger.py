from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatch import conf, services
from dispatch.management.commands._common import binding_from_arg
from dispatch.models import Run, Worker
from dispatch.states import TERMINAL_RUN_STATUSES, Status, Trigger


class Command(BaseCommand):
    help = "Trigger a run of a binding (by id or name) and print the run id."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("binding", help="the binding's id or name")
        parser.add_argument(
            "--wait",
            action="store_true",
            help="wait for the run to finish; exit 0 only if it SUCCEEDED",
        )
        parser.add_argument(
            "--timeout",
            type=float,
            default=None,
            help="with --wait: give up after this many seconds (exit 1)",
        )
        parser.add_argument("--idempotency-key", default=None)

    def handle(self, *args: Any, **options: Any) -> None:
        binding = binding_from_arg(options["binding"])
        run = services.trigger(
            binding,
            trigger=Trigger.MANUAL,
            idempotency_key=options["idempotency_key"],
            requested_by="manage.py trigger",
        )
        self.stdout.write(str(run.id))
        if not options["wait"]:
            return
        deadline = None if options["timeout"] is None else time.monotonic() + options["timeout"]
        next_worker_check = 0.0
        warned = False
        while True:
            status = Run.objects.values_list("status", flat=True).get(pk=run.pk)
            if status in TERMINAL_RUN_STATUSES:
                break
            if status == Status.PENDING and time.monotonic() >= next_worker_check:
                next_worker_check = time.monotonic() + conf.idle_heartbeat_seconds()
                live = live_workers()
                if not live and not warned:
                    self.stderr.write(
                        f"No live worker: no `runworker` has heartbeated in the last "
                        f"{live_worker_seconds():.0f} s. Run {run.id} waits until one starts "
                        "(manage.py runworker)."
                    )
                    warned = True
                elif live and warned:
                    self.stderr.write(f"A worker is live again ({live} in all).")
                    warned = False
            if deadline is not None and time.monotonic() > deadline:
                raise CommandError(f"Run {run.id} is still {status} after {options['timeout']}s.")
            time.sleep(0.2)
        if status != Status.SUCCEEDED:
            raise CommandError(f"Run {run.id} finished {status}.")
        self.stderr.write(f"Run {run.id} SUCCEEDED.")


def live_worker_seconds() -> float:
    """A worker heartbeats its row at least every DISPATCH_IDLE_HEARTBEAT_SECONDS: three
    missed heartbeats and it no longer counts as live."""
    return 3 * conf.idle_heartbeat_seconds()


def live_workers() -> int:
    """Workers not stopped whose row heartbeated recently (database time)."""
    from django.db.models.functions import Now

    return Worker.objects.filter(
        stopped_at__isnull=True,
        heartbeat_at__gte=Now() - timedelta(seconds=live_worker_seconds()),
    ).count()
