"""`dispatch_apply`: create, change, no-op, invalid input, secrets, concurrent edits."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from dispatch import ascode
from dispatch.models import MANAGED_BY_FILES, Datasource, Job, JobBinding
from scheduling.models import Schedule
from tests.support.ascode import (
    DEFINITION_TABLES,
    SECRET,
    apply_text,
    plan_text,
    row_versions,
    run_command,
)
from tests.support.factories import BindingFactory, JobFactory

pytestmark = pytest.mark.django_db

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
        description: ten rows
        source_spec: {rows: 10, batch: 5}
        max_attempts: 5
        backoff_seconds: 1
        backoff_max_seconds: 60
    bindings:
      gen-to-void:
        job: copy
        source: gen
        sink: void
        max_concurrency: 2
    schedules:
      gen-hourly:
        binding: gen-to-void
        cron: "0 * * * *"
        timezone: Europe/Berlin
""").lstrip("\n")


def test_apply__creates_every_object_marked_as_managed(
    write: Callable[..., str], secret_env: str
) -> None:
    ran = run_command("dispatch_apply", write(PIPELINE))

    assert ran.error is None, ran.text
    assert "Plan: 6 to create, 0 to change, 0 to delete, 0 unchanged." in ran.out
    assert "Applied: 6 created" in ran.out
    job = Job.objects.get(name="copy")
    assert (job.description, job.max_attempts, job.backoff_seconds) == ("ten rows", 5, 1.0)
    assert job.source_spec == {"rows": 10, "batch": 5}
    assert job.lease_seconds == 30  # left out: the model's default
    binding = JobBinding.objects.select_related("job", "source", "sink").get(name="gen-to-void")
    assert (binding.job.name, binding.source.name, binding.sink.name) == ("copy", "gen", "void")
    assert binding.max_concurrency == 2
    schedule = Schedule.objects.get(name="gen-hourly")
    assert (schedule.binding_id, schedule.cron, schedule.timezone) == (
        binding.pk,
        "0 * * * *",
        "Europe/Berlin",
    )
    assert schedule.next_fire_at is not None  # registered by Schedule.save()
    for model in (Datasource, Job, JobBinding, Schedule):
        assert set(model.objects.values_list("managed_by", flat=True)) == {MANAGED_BY_FILES}


def test_apply__a_secret_reference_is_resolved_encrypted_and_never_printed(
    write: Callable[..., str], secret_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(PIPELINE)
    first = run_command("dispatch_apply", path)
    monkeypatch.setenv("DISPATCH_SECRET_WH_PASSWORD", "rotated-" + SECRET)
    second = run_command("dispatch_apply", path)
    exported = run_command("dispatch_export")

    warehouse = Datasource.objects.get(name="warehouse")
    assert warehouse.config["password"] == "rotated-" + SECRET
    assert warehouse.secret_refs == {"password": "env:DISPATCH_SECRET_WH_PASSWORD"}
    assert SECRET not in warehouse.config_ciphertext
    assert warehouse.redacted_config["password"] == "********"
    for ran in (first, second, exported):
        assert ran.error is None, ran.text
        assert SECRET not in ran.text
    assert "config.password: (from env:DISPATCH_SECRET_WH_PASSWORD)" in first.out
    assert (
        "config.password: (from env:DISPATCH_SECRET_WH_PASSWORD) → secret changed "
        "(from env:DISPATCH_SECRET_WH_PASSWORD)" in second.out
    )
    assert "password: env:DISPATCH_SECRET_WH_PASSWORD" in exported.out


def test_apply__changes_show_field_by_field_and_are_written(
    write: Callable[..., str], secret_env: str
) -> None:
    run_command("dispatch_apply", write(PIPELINE))
    changed = (
        PIPELINE.replace("max_attempts: 5", "max_attempts: 7")
        .replace("{rows: 10, batch: 5}", "{rows: 20, batch: 5}")
        .replace("host: db.example.com", "host: db2.example.com")
        .replace('cron: "0 * * * *"', 'cron: "30 2 * * *"')
    )
    ran = run_command("dispatch_apply", write(changed))

    assert ran.error is None, ran.text
    assert "~ job copy: change" in ran.out
    assert "    max_attempts: 5 → 7" in ran.out
    assert "    source_spec.rows: 10 → 20" in ran.out
    assert '    config.host: "db.example.com" → "db2.example.com"' in ran.out
    assert '    cron: "0 * * * *" → "30 2 * * *"' in ran.out
    assert "= binding gen-to-void: unchanged" in ran.out
    assert "Plan: 0 to create, 3 to change, 0 to delete, 3 unchanged." in ran.out
    job = Job.objects.get(name="copy")
    assert (job.max_attempts, job.source_spec["rows"]) == (7, 20)
    warehouse = Datasource.objects.get(name="warehouse")
    assert warehouse.config["host"] == "db2.example.com"
    assert warehouse.config["password"] == SECRET  # the same reference, the same value
    assert Schedule.objects.get(name="gen-hourly").cron == "30 2 * * *"


def test_apply__a_second_apply_of_the_same_files_writes_nothing(
    write: Callable[..., str], secret_env: str
) -> None:
    path = write(PIPELINE)
    run_command("dispatch_apply", path)
    before = row_versions(*DEFINITION_TABLES)

    with CaptureQueriesContext(connection) as queries:
        ran = run_command("dispatch_apply", path)

    assert ran.error is None, ran.text
    assert "Plan: 0 to create, 0 to change, 0 to delete, 6 unchanged." in ran.out
    assert row_versions(*DEFINITION_TABLES) == before
    writes = [
        q["sql"]
        for q in queries.captured_queries
        if re.match(r"\s*(INSERT|UPDATE|DELETE)\b", q["sql"]) or "FOR UPDATE" in q["sql"]
    ]
    assert writes == []


def test_apply__invalid_input_names_file_line_and_field_and_writes_nothing(
    write: Callable[..., str], secret_env: str
) -> None:
    path = write(
        PIPELINE.replace("max_attempts: 5", "max_attempts: 0").replace(
            "sink: void", "sink: nowhere"
        ),
        name="broken.yaml",
    )
    ran = run_command("dispatch_apply", path)

    assert ran.error == "1 problem(s) in the definitions; nothing was written."
    # The unknown reference is found before the model validation runs.
    assert f"{path}:24: bindings.gen-to-void.sink: no datasource named 'nowhere'" in ran.err
    assert Datasource.objects.count() == Job.objects.count() == 0

    ran = run_command(
        "dispatch_apply", write(PIPELINE.replace("max_attempts: 5", "max_attempts: 0"), "b2.yaml")
    )
    assert ran.error is not None
    assert re.search(
        r"b2\.yaml:17: jobs\.copy\.max_attempts: Ensure this value is greater than", ran.err
    )
    assert Datasource.objects.count() == Job.objects.count() == JobBinding.objects.count() == 0


@pytest.mark.parametrize(
    ("snippet", "line", "path", "message"),
    [
        ("    lease_seconds: 1\n", 20, "jobs.copy.lease_seconds", "greater than or equal to 2"),
        ("    colour: red\n", 20, "jobs.copy.colour", "unknown field of a job"),
        ("    timeout_seconds: soon\n", 20, "jobs.copy.timeout_seconds", "must be an integer"),
        (
            "    backoff_max_seconds: 0.5\n",
            20,
            "jobs.copy.backoff_max_seconds",
            "(first on line 19)",
        ),
    ],
)
def test_apply__each_kind_of_mistake_is_reported_where_it_was_written(
    secret_env: str, snippet: str, line: int, path: str, message: str
) -> None:
    text = PIPELINE.replace(
        "    backoff_max_seconds: 60\n", "    backoff_max_seconds: 60\n" + snippet
    )
    with pytest.raises(ascode.DefinitionError) as caught:
        plan_text(text, source="p.yaml")

    (problem,) = [p for p in caught.value.problems if p.path == path]
    assert problem.file == "p.yaml"
    assert message in problem.message
    assert problem.line == line


def test_apply__a_spec_the_source_kind_refuses_is_reported_at_the_binding(secret_env: str) -> None:
    text = PIPELINE.replace("sink: void", "sink: gen")  # generate cannot be a sink
    with pytest.raises(ascode.DefinitionError) as caught:
        plan_text(text, source="p.yaml")

    assert [str(p) for p in caught.value.problems] == [
        "p.yaml:24: bindings.gen-to-void.sink: a generate datasource cannot be a sink"
    ]


def test_apply__a_secret_written_as_a_value_is_refused_naming_file_line_and_field(
    write: Callable[..., str],
) -> None:
    path = write(PIPELINE.replace("env:DISPATCH_SECRET_WH_PASSWORD", "hunter2-literal"), "s.yaml")
    ran = run_command("dispatch_apply", path)

    assert (
        f"{path}:12: datasources.warehouse.config.password: password is a secret: must be a "
        in ran.err
    )
    assert "hunter2-literal" not in ran.text
    assert Datasource.objects.count() == 0


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("env:HOME", "must start with DISPATCH_SECRET_ (DISPATCH_APPLY_ENV_PREFIX)"),
        ("env:DISPATCH_ENCRYPTION_KEYS", "holds a secret of the site itself"),
        ("env:DISPATCH_SECRET_NOT_SET", "is not set in the environment of the apply"),
        ("file:/etc/passwd", "file: references are off"),
    ],
)
def test_apply__references_outside_the_allowed_prefix_or_directories_are_refused(
    reference: str, message: str
) -> None:
    text = PIPELINE.replace("env:DISPATCH_SECRET_WH_PASSWORD", reference)
    with pytest.raises(ascode.DefinitionError) as caught:
        plan_text(text, source="r.yaml")

    (problem,) = caught.value.problems
    assert (problem.file, problem.line, problem.path) == (
        "r.yaml",
        12,
        "datasources.warehouse.config.password",
    )
    assert message in problem.message


def test_apply__a_console_edit_after_the_plan_is_refused_and_nothing_is_written(
    secret_env: str,
) -> None:
    apply_text(PIPELINE)
    plan = plan_text(
        PIPELINE.replace("max_concurrency: 2", "max_concurrency: 3").replace(
            "description: ten rows", "description: new"
        )
    )
    admin = get_user_model().objects.create_superuser("op", "op@example.com", "pw")
    client = Client()
    client.force_login(admin)
    job = Job.objects.get(name="copy")
    # The operator edits the job in the console between the plan and its apply.
    response = client.post(
        reverse("admin:dispatch_job_change", args=[job.pk]),
        {
            "name": "copy",
            "description": "edited in the console",
            "enabled": "on",
            "source_spec": '{"rows": 10, "batch": 5}',
            "sink_spec": "{}",
            "max_attempts": 5,
            "backoff_seconds": 1,
            "backoff_max_seconds": 60,
            "lease_seconds": 30,
            "timeout_seconds": "",
            "bindings-TOTAL_FORMS": 1,
            "bindings-INITIAL_FORMS": 1,
            "bindings-0-id": str(JobBinding.objects.get().pk),
            "bindings-0-job": str(job.pk),
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    before = row_versions(*DEFINITION_TABLES)

    with pytest.raises(ascode.Conflict) as caught:
        ascode.apply(plan)

    assert str(caught.value).startswith("job 'copy' was changed since the plan was made")
    assert row_versions(*DEFINITION_TABLES) == before  # the binding's change was not written
    assert JobBinding.objects.get().max_concurrency == 2
    assert Job.objects.get().description == "edited in the console"


def test_apply__a_disable_action_after_the_plan_is_refused(secret_env: str) -> None:
    apply_text(PIPELINE)
    plan = plan_text(PIPELINE.replace("max_concurrency: 2", "max_concurrency: 3"))
    # The console's disable action is a conditional UPDATE, not a save(): it counts too.
    JobBinding.objects.filter(name="gen-to-void", enabled=True).update(enabled=False)

    with pytest.raises(ascode.Conflict, match="binding 'gen-to-void' was changed"):
        ascode.apply(plan)

    assert JobBinding.objects.get().max_concurrency == 2


def test_apply__the_reconciler_firing_a_schedule_is_no_conflict(secret_env: str) -> None:
    apply_text(PIPELINE)
    plan = plan_text(PIPELINE.replace("max_concurrency: 2", "max_concurrency: 3"))
    # What the reconciler writes when it fires: its own fields, not the definition.
    Schedule.objects.filter(name="gen-hourly").update(skip_count=1, next_fire_at=None)

    result = ascode.apply(plan)

    assert (result.changed, JobBinding.objects.get().max_concurrency) == (1, 3)


def test_apply__an_object_created_in_the_console_meanwhile_is_a_conflict(
    secret_env: str,
) -> None:
    plan = plan_text(PIPELINE)
    JobFactory(name="copy")

    with pytest.raises(ascode.Conflict, match="job 'copy' was created by someone else"):
        ascode.apply(plan)

    assert Datasource.objects.count() == 0
    assert Job.objects.get().managed_by == ""


def test_apply__files_take_over_an_object_made_in_the_console(secret_env: str) -> None:
    binding = BindingFactory(name="gen-to-void")
    text = f"""
        bindings:
          gen-to-void:
            job: {binding.job.name}
            source: {binding.source.name}
            sink: {binding.sink.name}
            max_concurrency: 4
    """
    plan = plan_text(text)

    (change,) = plan.changes
    assert [str(f) for f in change.fields] == [
        "max_concurrency: 1 → 4",
        "managed by: console → files",
    ]
    ascode.apply(plan)
    binding.refresh_from_db()
    assert (binding.max_concurrency, binding.managed_by) == (4, MANAGED_BY_FILES)
    assert binding.job.managed_by == ""  # named, not defined: left alone


def test_apply__a_datasource_keeps_its_kind(secret_env: str) -> None:
    apply_text(PIPELINE)
    with pytest.raises(ascode.DefinitionError) as caught:
        plan_text(PIPELINE.replace('kind: "null"', "kind: generate"), source="k.yaml")

    (problem,) = caught.value.problems
    assert (problem.line, problem.path) == (5, "datasources.void.kind")
    assert "cannot change from 'null' to 'generate'" in problem.message


def test_plan__reports_the_permissions_it_needs(secret_env: str) -> None:
    apply_text(PIPELINE)
    plan = plan_text(
        PIPELINE.replace("{rows: 10, batch: 5}", "{rows: 11}").replace("enabled", "enabled")
    )

    assert plan.permissions() == {"dispatch.change_job"}
    assert plan_text(PIPELINE.replace("gen-hourly", "gen-daily")).permissions() >= {
        "scheduling.add_schedule",
        "dispatch.trigger_binding",
    }


def test_plan__as_data_for_the_api(secret_env: str) -> None:
    plan = plan_text(PIPELINE)
    data = plan.as_dict()

    assert data["counts"]["create"] == 6
    warehouse = next(c for c in data["changes"] if c["name"] == "warehouse")
    assert {
        "field": "config.password",
        "old": None,
        "new": "(from env:DISPATCH_SECRET_WH_PASSWORD)",
    } in warehouse["fields"]
    assert SECRET not in repr(data) and SECRET not in repr(plan)


def test_plan__takes_data_parsed_elsewhere() -> None:
    """The HTTP API may hand over a parsed JSON body: same checks, paths without lines."""
    document = ascode.Document(
        source="request",
        data={"jobs": {"copy": {"max_attempts": 0}}, "bindings": {"b": {"job": "copy"}}},
    )
    with pytest.raises(ascode.DefinitionError) as caught:
        ascode.plan([document])

    assert [p.as_dict() for p in caught.value.problems] == [
        {
            "file": "request",
            "line": None,
            "path": "bindings.b.source",
            "message": "this field is required",
        },
        {
            "file": "request",
            "line": None,
            "path": "bindings.b.sink",
            "message": "this field is required",
        },
    ]


CHAIN = textwrap.dedent("""
    datasources:
      gen:
        kind: generate
      void:
        kind: "null"
    jobs:
      copy:
        source_spec: {rows: 1, batch: 1}
    bindings:
      dims:
        job: copy
        source: gen
        sink: void
      facts:
        job: copy
        source: gen
        sink: void
        after: [dims]
        on: completion
""").lstrip("\n")


def test_apply__after_writes_the_edges_and_a_cycle_is_refused_naming_it(
    write: Callable[..., str],
) -> None:
    from dispatch.models import BindingEdge

    ran = run_command("dispatch_apply", write(CHAIN, "chain.yaml"))
    assert ran.error is None, ran.err
    (edge,) = BindingEdge.objects.all()
    assert (edge.upstream.name, edge.downstream.name, edge.on) == ("dims", "facts", "COMPLETION")
    # The same files again: nothing to write.
    assert not plan_text(CHAIN).has_changes

    cyclic = CHAIN.replace(
        "    sink: void\n  facts:", "    sink: void\n    after: [facts]\n  facts:"
    )
    assert cyclic != CHAIN
    ran = run_command("dispatch_apply", write(cyclic, "cycle.yaml"))
    assert ran.error is not None
    assert re.search(
        r"these bindings would wait for each other: (dims|facts) -> \w+ -> \1", ran.err
    ), ran.err
    assert BindingEdge.objects.count() == 1

    ran = run_command("dispatch_export")
    assert re.search(
        r"facts:\n(    .*\n)*    after:\n    - dims\n(    .*\n)*    'on': completion", ran.out
    ), ran.out


def test_plan__drawing_an_edge_needs_the_trigger_permission() -> None:
    """An edge starts its binding whenever its upstream ends: the plan asks for
    dispatch.trigger_binding where a file draws one, not where it only removes them."""
    without = CHAIN.replace("    after: [dims]\n    on: completion\n", "")
    assert without != CHAIN
    assert "dispatch.trigger_binding" not in plan_text(without).permissions()
    apply_text(without)
    assert plan_text(CHAIN).permissions() == {
        "dispatch.change_jobbinding",
        "dispatch.trigger_binding",
    }
    apply_text(CHAIN)
    assert "dispatch.trigger_binding" not in plan_text(without).permissions()


def test_plan__a_cycle_through_a_binding_the_files_do_not_define_is_reported() -> None:
    """The files define facts (after dims); dims, already stored, waits for facts: the
    cycle is named at facts, the one binding of it the files define."""
    from dispatch import services
    from dispatch.models import JobBinding

    apply_text(CHAIN.replace("    after: [dims]\n    on: completion\n", ""))
    facts, dims = JobBinding.objects.get(name="facts"), JobBinding.objects.get(name="dims")
    services.set_upstreams(dims, [(facts, "SUCCESS")])
    only_facts = CHAIN.replace("  dims:\n    job: copy\n    source: gen\n    sink: void\n", "")
    assert only_facts != CHAIN
    from dispatch.ascode.errors import DefinitionError

    with pytest.raises(DefinitionError, match="these bindings would wait for each other"):
        plan_text(only_facts)
