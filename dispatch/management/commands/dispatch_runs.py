from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatch.core.db import one_line
from dispatch.core.states import Status
from dispatch.http import reads
from dispatch.http.problems import Problem
from dispatch.http.schemas import RunDetail, RunOut, run_detail, run_out

# The most runs one `runs list` prints (it reads them MAX_PAGE at a time).
MAX_LIMIT = 10_000


def _when(value: Any) -> str:
    return value.isoformat(timespec="seconds") if value is not None else "-"


class Command(BaseCommand):
    help = (
        "Read runs: `runs list [--binding B] [--status S] [--limit N] [--json]`, newest "
        "first, and `runs show RUN [--json]`, a run with its attempts. The JSON is the HTTP "
        "API's (docs/api.md)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="list|show")
        listing = actions.add_parser("list", help="runs, newest first")
        listing.add_argument("--binding", help="only this binding's runs (its name or id)")
        listing.add_argument("--status", choices=Status.values, help="only runs in this status")
        listing.add_argument("--limit", type=int, default=20, help="at most this many (20)")
        listing.add_argument("--json", action="store_true", help="a JSON array of runs")
        show = actions.add_parser("show", help="one run with its attempts")
        show.add_argument("run", help="the run's id")
        show.add_argument("--json", action="store_true", help="the run as JSON")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            if options["action"] == "list":
                self.list(options)
            else:
                self.show(options)
        except Problem as problem:
            raise CommandError(problem.detail) from None

    def list(self, options: dict[str, Any]) -> None:
        limit = options["limit"]
        if not 1 <= limit <= MAX_LIMIT:
            raise CommandError(f"--limit must be between 1 and {MAX_LIMIT}, not {limit}.")
        binding = reads.find_binding(options["binding"]) if options["binding"] else None
        runs: list[RunOut] = []
        cursor = None
        while len(runs) < limit:
            page = reads.runs_page(
                limit=min(reads.MAX_PAGE, limit - len(runs)),
                cursor=cursor,
                binding=binding,
                status=options["status"],
            )
            runs += [run_out(r) for r in page.items]
            cursor = page.next_cursor
            if cursor is None:
                break
        if options["json"]:
            self.stdout.write(json.dumps([r.model_dump(mode="json") for r in runs], indent=1))
            return
        if not runs:
            self.stdout.write("No runs.")
            return
        self.stdout.write(f"{'RUN':<36}  {'BINDING':<24}  {'STATUS':<9}  {'TRIGGER':<8}  CREATED")
        for r in runs:
            self.stdout.write(
                f"{r.id!s:<36}  {r.binding[:24]:<24}  {r.status:<9}  {r.trigger:<8}  "
                f"{_when(r.created_at)}"
                + (f"  slice {r.slice_number} of {r.parent_id}" if r.parent_id else "")
            )

    def show(self, options: dict[str, Any]) -> None:
        run = reads.find_run(options["run"])
        detail: RunDetail = run_detail(run, reads.attempts_of(run))
        if options["json"]:
            self.stdout.write(detail.model_dump_json(indent=1))
            return
        self.stdout.write(f"run        {detail.id}")
        self.stdout.write(f"binding    {detail.binding}")
        self.stdout.write(f"status     {detail.status}")
        if detail.parent_id:
            self.stdout.write(f"slice      {detail.slice_number} of run {detail.parent_id}")
        self.stdout.write(f"trigger    {detail.trigger}")
        self.stdout.write(f"created    {_when(detail.created_at)}")
        self.stdout.write(f"finished   {_when(detail.finished_at)}")
        if detail.idempotency_key:
            self.stdout.write(f"key        {detail.idempotency_key}")
        if detail.requested_by:
            self.stdout.write(f"requested  {detail.requested_by}")
        for a in detail.attempts:
            line = f"attempt {a.number}: {a.status} ({a.origin})"
            if a.reason:
                line += f" {a.reason}"
            line += f", rows {a.rows_read} read / {a.rows_written} written"
            self.stdout.write(line)
            first = next((x.strip() for x in a.error.splitlines() if x.strip()), "")
            if first:
                self.stdout.write(f"  error: {first}")
            for e in a.events:
                # One line each (the message is stored sanitized; escaped for a terminal).
                self.stdout.write(f"  {_when(e.at)}  {e.kind:<12}  {one_line(e.message)}")
            if a.events_dropped:
                self.stdout.write(f"  {a.events_dropped} events dropped")
