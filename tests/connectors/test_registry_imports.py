"""The registry lists the optional kinds without importing their drivers: a worker that
never moves Parquet or MySQL data never imports pyarrow or PyMySQL (pyarrow alone is
about 60 MiB of a worker's resident memory)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dispatch.services import trigger
from tests.support.factories import BindingFactory
from tests.support.processes import ROOT, worker_env

DRIVERS = ("pyarrow", "pymysql")

# A fresh interpreter: what the console's forms and a worker do with the kinds, then a
# burst worker that runs the pending generate -> null run; the driver modules imported at
# each step. Last, the first use of a MySQL writer class, which must import its driver.
SCRIPT = """
import json, sys
import django
django.setup()
from django.core.management import call_command
from dispatch.connectors import registry
from dispatch.connectors.base import spec_errors
from dispatch.console import forms

DRIVERS = %r
seen = {}
def note(step):
    seen[step] = sorted(m for m in DRIVERS if m in sys.modules)

kinds = registry.kinds()
note("listed")
fields = {k: [f.name for f in c.config_fields] for k, c in kinds.items()}
help = {role: str(forms.spec_help(role)) for role in ("source", "sink")}
valid = {
    "parquet": ({"path": "in.parquet"}, {"path": "out"}),
    "mysql": ({"table": "t"}, {"table": "t", "mode": "upsert", "key": ["id"]}),
}
errors = {
    k: spec_errors(registry.get(k), "source", s) + spec_errors(registry.get(k), "sink", t)
    for k, (s, t) in valid.items()
}
call_command("check")
note("validated")
call_command("runworker", "--burst", "--no-scheduler", "--no-maintenance")
note("worker")
from dispatch.connectors.mysql import Writer
note("first use")
print(json.dumps({"seen": seen, "fields": fields, "errors": errors, "help": help}))
"""


@pytest.mark.django_db(transaction=True)
def test_registry__lists_validates_and_runs_without_importing_drivers() -> None:
    run = trigger(BindingFactory(job__source_spec={"rows": 10}))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT % (DRIVERS,)],
        env=worker_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    run.refresh_from_db()
    assert run.status == "SUCCEEDED", proc.stderr
    # The kinds are all there, with their declared fields and validators.
    assert out["fields"]["mysql"] == ["host", "port", "database", "user", "password", "tls"]
    assert out["fields"]["parquet"] == ["base_dir"]
    assert out["errors"] == {"parquet": [], "mysql": []}
    assert "row_group_rows" in out["help"]["sink"] and "lock_timeout_seconds" in out["help"]["sink"]
    # ... and no driver was imported until a MySQL class was used.
    assert out["seen"] == {
        "listed": [],
        "validated": [],
        "worker": [],
        "first use": ["pymysql"],
    }
