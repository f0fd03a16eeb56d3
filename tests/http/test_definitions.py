"""Definition files over HTTP against a live server: the diff and the apply run the
command's code (`dispatch.ascode`), check the console's permissions, never print a
secret, name file, line and field of each problem, and refuse what changed since."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from dispatch.models import Datasource, Job, JobBinding
from tests.http.conftest import make_token, make_user
from tests.http.test_auth import assert_problem
from tests.support.factories import BindingFactory

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "pw-http-4c1e-never-shown"
PIPELINE = textwrap.dedent("""
    datasources:
      gen:
        kind: generate
      void:
        kind: "null"
      warehouse:
        kind: postgresql
        config:
          host: db.example.com
          dbname: warehouse
          user: loader
          password: env:DISPATCH_SECRET_WH_PASSWORD
    jobs:
      copy:
        source_spec: {rows: 10}
    bindings:
      gen-to-void:
        job: copy
        source: gen
        sink: void
""").lstrip("\n")
VIEW = ("dispatch.view_datasource", "dispatch.view_job", "dispatch.view_jobbinding")
WRITE = (
    "dispatch.add_datasource",
    "dispatch.add_job",
    "dispatch.add_jobbinding",
    "dispatch.change_datasource",
    "dispatch.change_job",
    "dispatch.change_jobbinding",
)


@pytest.fixture(autouse=True)
def secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISPATCH_SECRET_WH_PASSWORD", SECRET)


def body(text: str = PIPELINE, **extra: Any) -> dict[str, Any]:
    return {"files": [{"name": "pipelines.yaml", "text": text}], **extra}


def test_plan_then_apply__creates_then_the_same_files_change_nothing(http: Any) -> None:
    token = make_token(make_user("deployer", *VIEW, *WRITE))[1]
    planned = http("POST", "/definitions/plan", token=token, body=body())
    assert planned.status == 200, planned.text
    assert planned.json["counts"]["create"] == 5
    assert "warehouse" in planned.json["text"]
    assert not Datasource.objects.exists()  # a plan writes nothing

    applied = http("POST", "/definitions/apply", token=token, body=body())
    assert applied.status == 200, applied.text
    assert applied.json["created"] == 5
    binding = JobBinding.objects.get(name="gen-to-void")
    assert binding.managed_by == "files"
    assert Datasource.objects.get(name="warehouse").config["password"] == SECRET
    again = http("POST", "/definitions/apply", token=token, body=body())
    assert again.json["created"] == 0 and again.json["unchanged"] == 5
    for answer in (planned, applied, again):
        assert SECRET not in answer.text
        assert "env:DISPATCH_SECRET_WH_PASSWORD" in answer.text or "unchanged" in answer.text


def test_plan__problems_name_file_line_and_field_and_nothing_is_written(http: Any) -> None:
    token = make_token(make_user("deployer", *VIEW, *WRITE))[1]
    broken = PIPELINE.replace(
        "source_spec: {rows: 10}", "source_spec: {rows: 10}\n    max_attempts: 0"
    )
    answer = http("POST", "/definitions/apply", token=token, body=body(broken))
    assert_problem(answer, 422)
    line = broken.splitlines().index("    max_attempts: 0") + 1
    fields = [e["field"] for e in answer.json["errors"]]
    assert f"pipelines.yaml:{line}: jobs.copy.max_attempts" in fields, fields
    assert not Job.objects.exists() and not Datasource.objects.exists()


def test_apply__needs_the_console_permissions_of_its_changes(http: Any) -> None:
    viewer = make_token(make_user("viewer", *VIEW))[1]
    # May see the diff ...
    assert http("POST", "/definitions/plan", token=viewer, body=body()).status == 200
    # ... not write it.
    refused = http("POST", "/definitions/apply", token=viewer, body=body())
    assert_problem(refused, 403)
    assert "dispatch.add_" in refused.json["detail"]
    assert not Datasource.objects.exists()
    # Without the view permissions, not even the diff.
    blind = make_token(make_user("blind", *WRITE))[1]
    assert_problem(http("POST", "/definitions/plan", token=blind, body=body()), 403)


def test_definitions__a_token_narrowed_to_bindings_may_not_use_them(http: Any) -> None:
    user = make_user("narrow", *VIEW, *WRITE)
    token = make_token(user, bindings=[BindingFactory(name="one")])[1]
    answer = http("POST", "/definitions/apply", token=token, body=body())
    assert_problem(answer, 403)
    assert not Datasource.objects.filter(name="warehouse").exists()


def test_apply__a_reference_outside_the_allowed_prefix_is_refused(http: Any) -> None:
    token = make_token(make_user("deployer", *VIEW, *WRITE))[1]
    stolen = PIPELINE.replace("env:DISPATCH_SECRET_WH_PASSWORD", "env:SECRET_KEY")
    answer = http("POST", "/definitions/apply", token=token, body=body(stolen))
    assert_problem(answer, 422)
    assert "SECRET_KEY" in answer.text and not Datasource.objects.exists()


def test_plan__shows_a_console_edit_that_the_apply_would_overwrite(http: Any) -> None:
    """(An edit that commits between an apply's read and its write is a 409: the apply
    checks under row locks; tests/ascode/test_concurrency.py holds that race.)"""
    token = make_token(make_user("deployer", *VIEW, *WRITE))[1]
    assert http("POST", "/definitions/apply", token=token, body=body()).status == 200
    job = Job.objects.get(name="copy")
    job.source_spec = {"rows": 99}
    job.save()
    planned = http("POST", "/definitions/plan", token=token, body=body()).json
    (change,) = [c for c in planned["changes"] if c["action"] == "change"]
    assert change["name"] == "copy"
    assert "99" in planned["text"]


def test_definitions__bad_bodies_are_problems_never_500(http: Any) -> None:
    token = make_token(make_user("deployer", *VIEW, *WRITE))[1]
    assert_problem(http("POST", "/definitions/apply", token=token, body={"files": []}), 422)
    not_yaml = http("POST", "/definitions/plan", token=token, body=body("a: [unclosed"))
    assert_problem(not_yaml, 422)
    assert not_yaml.json["errors"][0]["field"].startswith("pipelines.yaml:")
    bomb = "a: &x [1, 1]\nb: [*x, *x]\n"
    assert_problem(http("POST", "/definitions/plan", token=token, body=body(bomb)), 422)


def test_client__plans_and_applies_definition_files(live_server: Any) -> None:
    from dispatch.client import DispatchAPIError, DispatchClient

    token = make_token(make_user("deployer", *VIEW, *WRITE))[1]
    client = DispatchClient(live_server.url, token)
    assert client.plan_definitions({"pipelines.yaml": PIPELINE})["counts"]["create"] == 5
    assert client.apply_definitions({"pipelines.yaml": PIPELINE})["created"] == 5
    with pytest.raises(DispatchAPIError) as refused:
        client.apply_definitions({"bad.yaml": "jobs: [1, 2]"})
    assert refused.value.status == 422
