from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatch import services
from dispatch.management.commands._common import run_from_arg


class Command(BaseCommand):
    help = "Retry a FAILED or CANCELLED run with a fresh retry budget."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("run", help="the run's id")

    def handle(self, *args: Any, **options: Any) -> None:
        run = run_from_arg(options["run"])
        try:
            outcome = services.retry_run(run, by="manage.py retry")
        except services.ActionRefused as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"{run.id} {outcome}")
