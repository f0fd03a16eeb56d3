"""`dispatch_export`: YAML that applies back to the same state; secrets as references."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import yaml

from dispatch import ascode
from dispatch.models import Datasource, Job
from scheduling.models import Schedule
from tests.support.ascode import SECRET, apply_text, plan_text, run_command
from tests.support.factories import BindingFactory, DatasourceFactory

pytestmark = pytest.mark.django_db

FILES = """
datasources:
  gen: {kind: generate}
  void: {kind: "null"}
  warehouse:
    kind: postgresql
    enabled: false
    config:
      host: db.example.com
      port: 6432
      dbname: warehouse
      user: loader
      password: env:DISPATCH_SECRET_WH_PASSWORD
jobs:
  "2024":
    description: "yes"
    source_spec: {rows: 3, seed: 7}
    backoff_seconds: 2.5
    timeout_seconds: 600
bindings:
  nightly:
    job: "2024"
    source: gen
    sink: void
schedules:
  nightly-at-two:
    binding: nightly
    cron: "0 2 * * MON-FRI"
    timezone: America/New_York
    overlap_policy: QUEUE
"""


def test_export__applies_back_with_no_change(write: Callable[..., str], secret_env: str) -> None:
    apply_text(FILES)
    exported = run_command("dispatch_export", "--managed-only")

    assert exported.error is None and exported.err == ""
    assert SECRET not in exported.out
    data = yaml.safe_load(exported.out)
    assert data["datasources"]["warehouse"]["config"]["password"] == (
        "env:DISPATCH_SECRET_WH_PASSWORD"
    )
    assert data["schedules"]["nightly-at-two"]["cron"] == "0 2 * * MON-FRI"
    again = run_command("dispatch_apply", write(exported.out, "exported.yaml"))
    assert again.error is None, again.text
    assert "Plan: 0 to create, 0 to change, 0 to delete, 6 unchanged." in again.out


def test_export__console_objects_get_references_to_set_and_then_round_trip(
    write: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = DatasourceFactory(name="app db", kind="postgresql")
    source.config = {"host": "db.example.com", "dbname": "app", "password": "typed-in"}
    source.save()
    BindingFactory(name="app-copy", source=source, job__source_spec={"table": "public.t"})

    exported = run_command("dispatch_export")
    assert "typed-in" not in exported.text
    assert "set DISPATCH_SECRET_APP_DB_PASSWORD to it before applying" in exported.err
    assert "#   - datasource app db: password was entered in the console" in exported.out
    path = write(exported.out, "all.yaml")

    refused = run_command("dispatch_apply", path)
    assert "env:DISPATCH_SECRET_APP_DB_PASSWORD is not set" in refused.err

    monkeypatch.setenv("DISPATCH_SECRET_APP_DB_PASSWORD", "typed-in")
    taken = run_command("dispatch_apply", path)
    assert taken.error is None, taken.text
    # Only the marker moves: the files now manage what the console made.
    assert "managed by: console → files" in taken.out
    assert (
        "config.password: (entered in the console) → (from env:DISPATCH_SECRET_APP_DB_PASSWORD, the same value)"
        in taken.out
    )
    assert Datasource.objects.get(name="app db").config["password"] == "typed-in"
    assert (
        "Plan: 0 to create, 0 to change, 0 to delete, 4 unchanged."
        in run_command("dispatch_apply", path).out
    )
    second = run_command("dispatch_export")
    assert second.err == ""  # every secret has its reference now
    assert yaml.safe_load(second.out) == yaml.safe_load(exported.out)


def test_export__only_managed_objects_with_managed_only(secret_env: str) -> None:
    apply_text(FILES)
    BindingFactory(name="console-binding")

    managed = yaml.safe_load(ascode.export(managed_only=True).text)
    everything = yaml.safe_load(ascode.export().text)

    assert "console-binding" not in managed["bindings"]
    assert "console-binding" in everything["bindings"]
    assert set(managed["jobs"]) == {"2024"}


def test_export__the_values_survive_yaml_quoting(secret_env: str) -> None:
    apply_text(FILES)
    text = ascode.export(managed_only=True).text

    assert not plan_text(text).has_changes
    assert Job.objects.get(name="2024").description == "yes"
    assert Schedule.objects.get().overlap_policy == "QUEUE"
