"""What installed apps add to dispatch, named by attributes of their `AppConfig`.

dispatch never imports the apps built on it (scheduling imports dispatch, not the
reverse); an app says what it adds with dotted paths that dispatch imports by name when it
needs them:

- `scheduler_loop`: a function taking two `threading.Event`s, run by `runworker` in a
  thread beside the engine (unless `--no-scheduler`) until the first is set; the second
  is set when a notification arrives on the channel `scheduler_channel` names;
- `scheduler_channel`: a function returning that channel's name: the worker's LISTEN
  connection listens on it too, so the loop opens no LISTEN connection of its own;
- `scheduler_pass`: a function run once by `runworker --burst` before it drains;
- `dispatch_subcommands`: `{"name": "command"}`, subcommands of `manage.py dispatch` that
  are that app's management commands;
- `overview_notices`: functions taking the admin site's name and returning notices for
  the console's overview, each a dict with `text`, and optionally `url` and `link` (the
  link's words);
- `invariant_checks` (read by `dispatch.verify.invariants.app_checks`).

scheduling sets the first four (scheduling/apps.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.apps import apps
from django.utils.module_loading import import_string


@dataclass(frozen=True)
class Scheduler:
    app_label: str
    loop: Callable[[threading.Event, threading.Event | None], None]
    once: Callable[[], Any] | None
    channel: str | None  # where its wake-ups are announced (None: it listens itself)

    def target(self, wake: threading.Event | None) -> Callable[[threading.Event], None]:
        """The loop as a background target of the worker (which passes the stop event)."""

        def scheduler(stop: threading.Event) -> None:
            self.loop(stop, wake)

        scheduler.__name__ = f"{self.app_label}-scheduler"  # the thread's name
        return scheduler


def schedulers() -> list[Scheduler]:
    """The installed apps' schedulers, in app order (scheduling's, when installed)."""
    found = []
    for config in apps.get_app_configs():
        loop = getattr(config, "scheduler_loop", None)
        if not loop:
            continue
        once = getattr(config, "scheduler_pass", None)
        channel = getattr(config, "scheduler_channel", None)
        found.append(
            Scheduler(
                config.label,
                import_string(loop),
                import_string(once) if once else None,
                str(import_string(channel)()) if channel else None,
            )
        )
    return found


def subcommands() -> dict[str, tuple[str, str]]:
    """The installed apps' subcommands of `manage.py dispatch`: name -> (app module, the
    app's management command)."""
    found: dict[str, tuple[str, str]] = {}
    for config in apps.get_app_configs():
        for name, command in getattr(config, "dispatch_subcommands", {}).items():
            found.setdefault(name, (config.name, command))
    return found


def overview_notices(site_name: str) -> list[dict[str, str]]:
    """Every installed app's notices for the overview, in app order."""
    notices: list[dict[str, str]] = []
    for config in apps.get_app_configs():
        for path in getattr(config, "overview_notices", ()):
            notices.extend(import_string(path)(site_name))
    return notices
