from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatch import services
from dispatch.management.commands._common import run_from_arg


class Command(BaseCommand):
    help = "Cancel a run: a pending one at once, a running one at its next heartbeat."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("run", help="the run's id")

    def handle(self, *args: Any, **options: Any) -> None:
        run = run_from_arg(options["run"])
        try:
            outcome = services.cancel_run(run, by="manage.py cancel")
        except services.ActionRefused as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"{run.id} {outcome}")
