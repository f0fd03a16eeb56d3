"""`python -m bench NAME [ARGS...]`: run `bench/NAME.py:main(argv)`; `all` runs each one
named in ALL, in order; no NAME lists what there is."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# What `python -m bench all` (and `make bench`) runs, in this order.
ALL: list[str] = [
    "throughput",
    "backlog",
    "herd",
    "latency",
    "wakesplit",
    "claimcost",
    "contention",
    "recovery",
    "copy_pg",
    "slices",
    "pgbouncer",
    "soak",
]
# Short names for modules whose own name says more (`python -m bench copy`).
ALIASES: dict[str, str] = {"copy": "copy_pg"}


def available() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.iter_modules([str(HERE)])
        if not m.name.startswith("_") and m.name != "common"
    )


def run(name: str, argv: list[str]) -> int:
    name = ALIASES.get(name, name)
    if name not in available():
        raise SystemExit(f"no benchmark named {name!r}; available: {', '.join(available())}")
    module = importlib.import_module(f"bench.{name}")
    return int(module.main(argv) or 0)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("available:", ", ".join(available()))
        return 0
    if argv[0] == "all":
        status = 0
        for name in ALL:
            print(f"\n=== bench {name} ===", flush=True)
            # Each in a process of its own: a benchmark configures Django for its own
            # database, and Django is configured once per process.
            status |= subprocess.run([sys.executable, "-m", "bench", name, *argv[1:]]).returncode
        return status
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
