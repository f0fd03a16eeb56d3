from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any, TextIO

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatch import api, services
from dispatch.core import conf
from dispatch.core.states import Status, Trigger
from dispatch.management.commands._common import binding_from_arg
from dispatch.management.progress import WaitDisplay, summary_lines
from dispatch.models import Worker


class Command(BaseCommand):
    help = "Trigger a run of a binding (by id or name) and print the run id."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("binding", help="the binding's id or name")
        parser.add_argument(
            "--wait",
            action="store_true",
            help="wait for the run to finish, showing its progress; then print its status, "
            "reason, error, rows and duration; exit 0 only if it SUCCEEDED",
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
        if options["timeout"] is not None and options["timeout"] < 0:
            raise CommandError("--timeout must be at least 0 seconds.")
        run = services.trigger(
            binding,
            trigger=Trigger.MANUAL,
            idempotency_key=options["idempotency_key"],
            requested_by="manage.py trigger",
        )
        self.stdout.write(str(run.id))
        if not options["wait"]:
            return
        # The run id went to stdout (for scripts); what follows goes to stderr, written to
        # the stream itself: rich draws on it, and Django's wrapper would colour every
        # line (a success too) as an error.
        err: TextIO = options.get("stderr") or sys.stderr
        display = WaitDisplay(err, tty=err.isatty())
        self._next_worker_check = 0.0
        self._warned = False

        def on_progress(current: api.RunResult) -> None:
            self._check_workers(current, display)
            display.update(current)

        try:
            result = api.wait(run.id, timeout=options["timeout"], on_progress=on_progress)
        except api.WaitTimeout as exc:
            raise CommandError(
                f"Run {run.id} is still {exc.result.status} after {options['timeout']}s."
            ) from None
        except api.NotFound:  # retention cannot prune a live run; an operator's delete can
            raise CommandError(f"Run {run.id} no longer exists.") from None
        finally:
            display.close()
        err.write("".join(f"{line}\n" for line in summary_lines(result)))
        err.flush()
        if not result.succeeded:
            raise CommandError(f"Run {run.id} finished {result.status}.")

    def _check_workers(self, current: api.RunResult, display: WaitDisplay) -> None:
        """Say so when the run waits and no worker is live (and when one is again)."""
        if current.status != Status.PENDING or time.monotonic() < self._next_worker_check:
            return
        self._next_worker_check = time.monotonic() + conf.idle_heartbeat_seconds()
        live = live_workers()
        if not live and not self._warned:
            display.note(
                f"No live worker: no `runworker` has heartbeated in the last "
                f"{live_worker_seconds():.0f} s. Run {current.run_id} waits until one starts "
                "(manage.py runworker)."
            )
            self._warned = True
        elif live and self._warned:
            display.note(f"A worker is live again ({live} in all).")
            self._warned = False


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
