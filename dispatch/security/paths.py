"""Where a file a datasource names may never be (docs/security.md, "CSV files").

A user who may edit a CSV datasource and a job decides which files the worker reads and
writes, with the worker's own permissions. A file written where something executes or
trusts it is code execution: a `.pth` file in site-packages runs at the next Python
start, `~/.ssh/authorized_keys` opens a login, a cron spool or a systemd unit runs a
command, `postgresql.auto.conf` sets `archive_command`. Read access is as bad where keys
live (`.env`, `~/.pgpass`). So these locations are protected, and a directory is refused
when it is one, lies in one, or contains one:

- the system's trees (SYSTEM_TREES);
- the directories Python imports code from: every `sys.path` entry (site-packages, the
  standard library, the project when it is on the path) and the directory of every
  imported top-level module or package (an editable install's checkout);
- the interpreter's own installation: `sys.prefix`, `sys.exec_prefix` (the virtualenv),
  `sys.base_prefix`;
- every absolute directory on `PATH` (a file replaced there keeps its execute bit);
- the home directory of the user this process runs as (`$HOME` and the password file's).

`/` as a protected location (a process started in `/` puts it on `sys.path`; some service
users have `/` as their home) protects `/` itself only: taken as a tree it would refuse
every directory.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

# The system's own trees: configuration, devices, kernel interfaces, boot files,
# programs and libraries (/opt holds add-on software, /snap snaps), root's home, runtime
# state, and the parts of /var where services keep state that something executes or
# trusts: /var/lib (the PostgreSQL cluster, package databases), /var/spool (cron and at
# jobs), /var/www (web roots), /var/log, /var/mail, ... /var/tmp stays usable, like /tmp,
# /srv, /mnt, /home of other users and any mount of its own. Each is also protected
# through its real path (/lib -> /usr/lib on a merged /usr, /var/run -> /run).
SYSTEM_TREES = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/opt",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/snap",
    "/sys",
    "/usr",
    "/var/backups",
    "/var/cache",
    "/var/db",
    "/var/lib",
    "/var/local",
    "/var/lock",
    "/var/log",
    "/var/mail",
    "/var/opt",
    "/var/run",
    "/var/spool",
    "/var/www",
)

SYSTEM = "a system directory"
PYTHON = "a directory Python imports code from"
INTERPRETER = "the Python installation"
ON_PATH = "a directory on PATH"
HOME = "the home directory of the user this process runs as"


@dataclass(frozen=True)
class Protected:
    """One protected location: its real path and what it is (for messages)."""

    path: str
    what: str


def _real(path: str) -> str | None:
    return os.path.realpath(path) if path and os.path.isabs(path) else None


def _homes() -> list[str]:
    homes = [os.path.expanduser("~")]
    try:
        import pwd

        homes.append(pwd.getpwuid(os.geteuid()).pw_dir)
    except (ImportError, KeyError):  # no pwd module, or no entry for this uid
        pass
    return homes


def _module_dirs() -> list[str]:
    """The directories imported top-level modules and packages came from."""
    dirs: list[str] = []
    for name, module in list(sys.modules.items()):
        if "." in name or module is None:
            continue
        search = getattr(module, "__path__", None)
        if search is not None:  # a package: its own directories
            with contextlib.suppress(TypeError):  # an unusual __path__ that does not iterate
                dirs.extend(p for p in search if isinstance(p, str))
            continue
        file = getattr(module, "__file__", None)
        if isinstance(file, str):
            dirs.append(os.path.dirname(file))
    return dirs


def protected() -> list[Protected]:
    """Every protected location, as this process sees it now (sys.path and the loaded
    modules change while it runs, so nothing is cached)."""
    candidates: list[tuple[str, str]] = []
    for tree in SYSTEM_TREES:
        candidates += [(tree, SYSTEM), (os.path.realpath(tree), SYSTEM)]
    # "" on sys.path is the current directory.
    candidates += [(entry or os.getcwd(), PYTHON) for entry in sys.path]
    candidates += [(d, PYTHON) for d in _module_dirs()]
    candidates += [(p, INTERPRETER) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix)]
    candidates += [(d, ON_PATH) for d in os.environ.get("PATH", "").split(os.pathsep)]
    candidates += [(h, HOME) for h in _homes()]
    given: set[str] = set()
    seen: set[str] = set()
    found = []
    for path, what in candidates:
        if path in given:  # many modules share a directory: resolve each once
            continue
        given.add(path)
        real = _real(path)
        if real is not None and real not in seen:
            seen.add(real)
            found.append(Protected(real, what))
    return found


def within(path: str, root: str) -> bool:
    """Whether the real path `path` is `root` or lies in it."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def conflict(
    path: str, *, contains: bool = True, places: list[Protected] | None = None
) -> str | None:
    """How the absolute `path` (resolved here) meets a protected location, as a phrase
    ("lies in a system directory (/usr)"), or None. With `contains=False` only `path`
    being or lying in one counts (for a file). `places`: `protected()`, when the caller
    already has it."""
    real = os.path.realpath(path)
    for place in protected() if places is None else places:
        if real == place.path:
            return f"is {place.what} ({place.path})"
        if place.path == "/":
            continue  # "/" protects itself only (see the module's docstring)
        if within(real, place.path):
            return f"lies in {place.what} ({place.path})"
        if contains and within(place.path, real):
            return f"contains {place.what} ({place.path})"
    return None
