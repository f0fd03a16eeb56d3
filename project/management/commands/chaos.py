from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tools.chaos import Campaign, Options


class Command(BaseCommand):
    help = (
        "Fault-injection campaign against an embedded PostgreSQL this command owns: N "
        "workers, triggers and schedules, seeded faults, then quiescence and the invariant "
        "check. Exit 1 on any violation."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        d = Options()
        parser.add_argument("--duration", type=float, default=d.duration, help="fault phase, s")
        parser.add_argument("--workers", type=int, default=d.workers)
        parser.add_argument("--seed", type=int, default=d.seed)
        parser.add_argument("--concurrency", type=int, default=d.concurrency, help="per worker")
        parser.add_argument("--fault-interval", type=float, default=d.fault_interval)
        parser.add_argument("--trigger-rate", type=float, default=d.trigger_rate, help="per s")
        parser.add_argument("--reconcilers", type=int, default=d.reconcilers)
        parser.add_argument("--quiesce-timeout", type=float, default=d.quiesce_timeout)
        parser.add_argument("--data-dir", type=Path, default=d.data_dir, help="the server's data")
        parser.add_argument("--port", type=int, default=d.port)
        parser.add_argument("--out", type=Path, default=d.out_dir, help="logs and summary.json")
        parser.add_argument("--keep-server", action="store_true", help="leave PostgreSQL up")

    def _line(self, text: str) -> None:
        self.stdout.write(text)
        self.stdout.flush()

    def handle(self, *args: Any, **options: Any) -> None:
        for name in ("duration", "fault_interval", "trigger_rate", "quiesce_timeout"):
            if options[name] <= 0:
                raise CommandError(f"--{name.replace('_', '-')} must be positive.")
        for name in ("workers", "concurrency"):
            if options[name] < 1:
                raise CommandError(f"--{name} must be at least 1.")
        if options["reconcilers"] < 0:
            raise CommandError("--reconcilers must not be negative.")
        campaign = Campaign(
            Options(
                duration=options["duration"],
                workers=options["workers"],
                seed=options["seed"],
                concurrency=options["concurrency"],
                data_dir=options["data_dir"],
                port=options["port"],
                out_dir=options["out"],
                fault_interval=options["fault_interval"],
                trigger_rate=options["trigger_rate"],
                reconcilers=options["reconcilers"],
                quiesce_timeout=options["quiesce_timeout"],
                keep_server=options["keep_server"],
            ),
            out=self._line,
        )
        summary = campaign.run()
        self.stdout.write(summary.render())
        if summary.violations:
            sys.exit(1)
