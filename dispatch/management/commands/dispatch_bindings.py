from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from dispatch.http import reads
from dispatch.http.schemas import BindingOut, binding_out


class Command(BaseCommand):
    help = (
        "Read bindings: `bindings list [--json]`, by name, with their health and committed "
        "cursor. The JSON is the HTTP API's (docs/api.md)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="list")
        listing = actions.add_parser("list", help="every binding, by name")
        listing.add_argument("--json", action="store_true", help="a JSON array of bindings")

    def handle(self, *args: Any, **options: Any) -> None:
        bindings: list[BindingOut] = []
        cursor = None
        while True:
            page = reads.bindings_page(limit=reads.MAX_PAGE, cursor=cursor, scope=None)
            bindings += [binding_out(b) for b in page.items]
            cursor = page.next_cursor
            if cursor is None:
                break
        if options["json"]:
            self.stdout.write(json.dumps([b.model_dump(mode="json") for b in bindings], indent=1))
            return
        if not bindings:
            self.stdout.write("No bindings.")
            return
        self.stdout.write(f"{'BINDING':<28}  {'ENABLED':<7}  {'HEALTH':<13}  SOURCE -> SINK")
        for b in bindings:
            health = b.health.state if b.health is not None else "-"
            self.stdout.write(
                f"{b.name[:28]:<28}  {'yes' if b.enabled else 'no':<7}  {health:<13}  "
                f"{b.source} -> {b.sink}"
            )
