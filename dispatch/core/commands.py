"""The `manage.py dispatch <subcommand>` namespace: every management command of dispatch
(and of the apps built on it) under one name a host site's other apps cannot take.

`runworker`, `trigger`, `cancel`, `retry`, `recover` and `prune` are generic names: when an
app listed before dispatch in INSTALLED_APPS has a command of the same name (Django
Channels' `runworker`), Django runs that app's. `manage.py dispatch worker` always runs
dispatch's; the system check `dispatch.W003` names the app that wins otherwise.
"""

from __future__ import annotations

from dispatch.core import hooks

# Subcommand -> dispatch's management command it runs.
BUILTIN: dict[str, str] = {
    "worker": "runworker",
    "trigger": "trigger",
    "cancel": "cancel",
    "retry": "retry",
    "recover": "recover",
    "prune": "prune",
    "workerhealth": "workerhealth",
    "rotate_keys": "rotate_keys",
    "check_invariants": "check_invariants",
    "apply": "dispatch_apply",
    "export": "dispatch_export",
    "runs": "dispatch_runs",
    "bindings": "dispatch_bindings",
}


def subcommands() -> dict[str, tuple[str, str]]:
    """Subcommand -> (the app module that owns it, its management command): dispatch's,
    then the installed apps' (`dispatch_subcommands`, e.g. scheduling's `schedules`)."""
    table = {name: ("dispatch", command) for name, command in BUILTIN.items()}
    for name, owner in hooks.subcommands().items():
        table.setdefault(name, owner)
    return table
