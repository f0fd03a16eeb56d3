"""`manage.py dispatch <subcommand> [args]`: dispatch's commands under one namespace.

Each subcommand is an existing management command (`dispatch worker` is `runworker`,
`dispatch schedules` is scheduling's `reconcile_schedules`; the table is
`dispatch.core.commands`), run by its own class: its own arguments, help, system checks and
errors, nothing parsed twice.
"""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management import call_command, load_command_class
from django.core.management.base import (
    BaseCommand,
    CommandError,
    CommandParser,
    DjangoHelpFormatter,
)

from dispatch.core import commands


class _HelpFormatter(DjangoHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Django's order of arguments, and the subcommand table's lines kept as written."""


def _load(name: str) -> BaseCommand:
    table = commands.subcommands()
    if name not in table:
        raise CommandError(
            f"Unknown subcommand {name!r}; one of: {', '.join(sorted(table))} "
            "(manage.py dispatch --help)."
        )
    app, command = table[name]
    return load_command_class(app, command)


class Command(BaseCommand):
    help = (
        "Run one of dispatch's commands under a namespace no other app takes: "
        "`manage.py dispatch worker` is `manage.py runworker`, and so on."
    )
    # The subcommand runs its own checks (runworker: all of them); none here, or twice.
    requires_system_checks: list[str] = []  # type: ignore[assignment]

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.formatter_class = _HelpFormatter
        parser.epilog = self.table_text()
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "subcommand",
            nargs="?",
            help="one of the subcommands below; `manage.py dispatch SUBCOMMAND --help` "
            "for its own arguments",
        )
        parser.add_argument("args", nargs=argparse.REMAINDER, help="the subcommand's arguments")

    @staticmethod
    def table_text() -> str:
        lines = ["subcommands (each is also a command of its own):"]
        for name, (_app, command) in commands.subcommands().items():
            first = " ".join((_load(name).help or "").split()).split(". ")[0].rstrip(".")
            lines.append(f"  {name:<17} manage.py {command}: {first}")
        return "\n".join(lines)

    def run_from_argv(self, argv: list[str]) -> None:
        """`manage.py dispatch NAME ...`: NAME's own command runs from the command line
        with the rest (its --help, --traceback, exit status); anything else (no name, a
        name that is not a subcommand, --help) is this command's."""
        if len(argv) > 2 and not argv[2].startswith("-") and argv[2] in commands.subcommands():
            command = _load(argv[2])
            command.run_from_argv([argv[0], f"{argv[1]} {argv[2]}", *argv[3:]])
            return
        super().run_from_argv(argv)

    def handle(self, *args: str, **options: Any) -> None:
        # Reached from call_command("dispatch", NAME, ...), or with no name or one that
        # is not a subcommand (refused, naming the subcommands).
        if not options["subcommand"]:
            raise CommandError(
                "Name a subcommand: one of "
                f"{', '.join(sorted(commands.subcommands()))} (manage.py dispatch --help)."
            )
        command = _load(options["subcommand"])
        call_command(
            command,
            *args,
            verbosity=options["verbosity"],
            # From the command line (`manage.py dispatch -v 2 worker ...`), the
            # subcommand's own system checks run, as they do when it is run by name.
            skip_checks=not getattr(self, "_called_from_command_line", False),
            stdout=self.stdout._out,
            stderr=self.stderr._out,
        )
