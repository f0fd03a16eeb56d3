from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from dispatch.worker.listen import UNHEALTHY_STATES, probe_report


class Command(BaseCommand):
    help = (
        "Health of one worker for an orchestrator's probe: exit 0 when its row is "
        "registered, not stopped and heartbeated within --max-age seconds (database time); "
        "exit 1 otherwise. Prints the verdict as JSON, with its LISTEN probe's state."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--worker-id", required=True, help="the id given to runworker")
        parser.add_argument(
            "--max-age",
            type=float,
            default=30.0,
            help="seconds of heartbeat silence that count as unhealthy (default 30; a worker "
            "heartbeats every 5 s when idle, every lease/3 when busy)",
        )
        parser.add_argument(
            "--require-listen",
            action="store_true",
            help="also fail when the LISTEN self-probe reports its wake-ups stopped arriving",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["max_age"] <= 0:
            raise CommandError("--max-age must be positive.")
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT stopped_at IS NOT NULL,"
                "       EXTRACT(EPOCH FROM (clock_timestamp() - heartbeat_at))::float8, stats"
                "  FROM dispatch_worker WHERE id = %s",
                [options["worker_id"]],
            )
            row = cursor.fetchone()
        if row is None:
            verdict: dict[str, Any] = {"healthy": False, "problem": "no such worker registered"}
        else:
            stopped, age, stats = row
            stats = json.loads(stats) if isinstance(stats, str) else (stats or {})
            probe = probe_report(stats)
            problem = ""
            if stopped:
                problem = "stopped"
            elif age > options["max_age"]:
                problem = f"no heartbeat for {age:.1f} s"
            elif options["require_listen"] and probe.state in UNHEALTHY_STATES:
                problem = f"LISTEN connection {probe.state}"
            verdict = {
                "healthy": not problem,
                "problem": problem,
                "heartbeat_age_seconds": round(age, 3),
                "listen": probe.state,
            }
        self.stdout.write(json.dumps({"worker": options["worker_id"], **verdict}))
        if not verdict["healthy"]:
            raise SystemExit(1)
