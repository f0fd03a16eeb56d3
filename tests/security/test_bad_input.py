"""Bad input: each answered with a clear error that names what is wrong, and nothing lost
or half-written (the row counts before and after are asserted)."""

from __future__ import annotations

import io
import signal
import string
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from dispatch.checks import check_encryption_keys
from dispatch.connectors import registry
from dispatch.core.states import Origin, Reason, Status
from dispatch.models import Attempt, Datasource, Job, JobBinding, Run
from dispatch.worker import claims
from dispatch.worker.runner import ExecutionControl, Runner
from tests.support.factories import (
    BindingFactory,
    DatasourceFactory,
    JobFactory,
    SinkFactory,
    trigger,
)
from tests.support.processes import Processes, wait_until, worker_env

HYPOTHESIS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
spec_keys = st.sampled_from(["rows", "batch", "delay_ms", "fail_after", "seed", "bogus", ""])
specs = st.dictionaries(spec_keys | st.text(max_size=6), json_values, max_size=5)


def counts() -> dict[str, int]:
    return {
        model.__name__: model.objects.count()
        for model in (Datasource, Job, JobBinding, Run, Attempt)
    }


@pytest.fixture
def unchanged(db: Any) -> Iterator[None]:
    """Asserts at the end of the test that no row was added or lost."""
    before = counts()
    yield
    assert counts() == before


# --- connector kinds, configs and specs -----------------------------------------------------
@pytest.mark.django_db
def test_unknown_connector_kind__named_on_clean_and_nothing_saved(unchanged: None) -> None:
    ds = Datasource(name="mystery", kind="nosuchkind", config={})
    with pytest.raises(ValidationError) as exc_info:
        ds.full_clean()
    message = exc_info.value.message_dict["kind"][0]
    assert message.startswith("unknown connector kind 'nosuchkind' (known: ")
    assert "generate" in message


@pytest.mark.django_db
def test_binding_to_an_unknown_kind__named_per_role() -> None:
    ghost = DatasourceFactory(kind="nosuchkind")
    binding = JobBinding(name="b", job=JobFactory(), source=ghost, sink=SinkFactory())
    with pytest.raises(ValidationError) as exc_info:
        binding.full_clean()
    assert "unknown connector kind 'nosuchkind'" in exc_info.value.message_dict["source"][0]
    assert not JobBinding.objects.exists()


@pytest.mark.django_db
@HYPOTHESIS
@given(config=st.dictionaries(st.text(max_size=10), json_values, max_size=4))
def test_generate_config__only_the_empty_config_is_valid(config: dict[str, Any]) -> None:
    ds = Datasource(name="g", kind="generate", config=config)
    if not config:
        ds.clean()
        return
    with pytest.raises(ValidationError) as exc_info:
        ds.clean()
    # Every unknown field is named.
    assert set(exc_info.value.message_dict) == set(config)
    assert not Datasource.objects.filter(name="g").exists()


@pytest.mark.django_db
@HYPOTHESIS
@given(spec=specs)
def test_generate_spec__validates_or_names_the_problem(spec: dict[str, Any]) -> None:
    try:
        registry.get("generate").validate_source_spec(spec)
    except ValidationError as exc:
        text = " ".join(exc.messages)
        assert any(name in text for name in [*spec, "unknown field"]), text
        return
    # Accepted: only the documented fields, each a non-negative integer.
    assert set(spec) <= {"rows", "batch", "delay_ms", "fail_after", "seed"}
    for name, value in spec.items():
        if value is None:
            assert name == "fail_after"  # the one integer field whose default is "none"
        else:
            assert isinstance(value, int) and not isinstance(value, bool) and value >= 0


@pytest.mark.django_db(transaction=True)
@HYPOTHESIS
@given(spec=specs)
def test_binding_with_a_bad_spec__refused_before_anything_is_written(spec: dict[str, Any]) -> None:
    binding = BindingFactory()
    before = counts()
    binding.job.source_spec = spec
    try:
        binding.job.full_clean()
    except ValidationError as exc:
        # Refused: the message names the binding's role, and nothing was written.
        assert "source" in exc.message_dict
        assert Job.objects.get(pk=binding.job.pk).source_spec == {"rows": 10, "batch": 5}
    assert counts() == before


@pytest.mark.parametrize("name", ["rows", "batch", "delay_ms", "seed"])
def test_generate_spec__null_integer_refused_at_validation(name: str) -> None:
    """A null would pass validation and fail every attempt at run time (a TypeError,
    retried as transient) if it were not refused here."""
    with pytest.raises(ValidationError) as exc_info:
        registry.get("generate").validate_source_spec({name: None})
    minimum = 1 if name == "batch" else 0
    assert exc_info.value.messages == [f"{name}: must be an integer >= {minimum}, not null"]


@pytest.mark.django_db
def test_postgresql_config__bad_fields_named(unchanged: None) -> None:
    ds = Datasource(
        name="pg",
        kind="postgresql",
        config={"host": "h", "dbname": "d", "port": 70000, "sslmode": "maybe"},
    )
    with pytest.raises(ValidationError) as exc_info:
        ds.clean()
    errors = exc_info.value.message_dict
    assert errors["port"] == ["must be between 1 and 65535"]
    assert errors["sslmode"][0].startswith("must be one of disable, allow, prefer")


@pytest.mark.parametrize(
    ("kind", "config", "expected"),
    [
        (
            "postgresql",
            {"url": "postgresql://h/d", "host": "h", "port": 0, "sslmode": "maybe"},
            {
                "url": [
                    "give either url or the separate fields, not both (host, port, sslmode set"
                    " as well)"
                ],
                "port": ["must be between 1 and 65535"],
            },
        ),
        ("postgresql", {"port": 5432}, {
            "host": ["this field is required (or give url)"],
            "dbname": ["this field is required (or give url)"],
        }),
        ("mysql", {"host": "h", "user": "u", "port": 0, "tls": "maybe", "x": 1}, {
            "x": ["unknown field for a mysql datasource"],
            "port": ["must be between 1 and 65535"],
        }),
    ],
)  # fmt: skip
def test_server_configs__every_field_error_reported_together(
    kind: str, config: dict[str, Any], expected: dict[str, list[str]]
) -> None:
    # base.server_config: the declared fields' errors, the connector's own and the port's,
    # together; the target policy only once those pass (a wrong port is not also refused
    # as a target).
    with pytest.raises(ValidationError) as exc_info:
        registry.get(kind).validate_config(config)
    errors = exc_info.value.message_dict
    assert {k: errors[k] for k in expected} == expected
    assert set(errors) - set(expected) <= {"sslmode", "tls"}  # their choices' messages


# Configs and specs are limited to 64 KiB of compact JSON (the models' clean()).
LIMIT = 64 * 1024
# json.dumps({"pad": "x" * n}, separators=(",", ":")) is n + 10 bytes.
PAD_OVERHEAD = len('{"pad":""}')


@pytest.mark.django_db
def test_spec_at_the_size_limit__accepted_one_byte_more_refused(unchanged: None) -> None:
    at_limit = Job(name="big", source_spec={"pad": "x" * (LIMIT - PAD_OVERHEAD)})
    at_limit.full_clean()  # no binding yet: only the size is checked
    over = Job(name="huge", source_spec={"pad": "x" * (LIMIT - PAD_OVERHEAD + 1)})
    with pytest.raises(ValidationError) as exc_info:
        over.full_clean()
    assert exc_info.value.message_dict["source_spec"] == [
        "is 65,537 bytes of JSON; the limit is 64 KiB (65,536 bytes)"
    ]


@pytest.mark.django_db
def test_oversized_sink_spec__refused_with_its_size(unchanged: None) -> None:
    job = Job(name="huge", sink_spec={"pad": "x" * LIMIT})
    with pytest.raises(ValidationError) as exc_info:
        job.full_clean()
    assert "the limit is 64 KiB" in exc_info.value.message_dict["sink_spec"][0]


@pytest.mark.django_db
def test_oversized_config__refused_with_its_size(unchanged: None) -> None:
    ds = Datasource(name="huge", kind="postgresql", config={"host": "h" * LIMIT, "dbname": "d"})
    with pytest.raises(ValidationError) as exc_info:
        ds.full_clean()
    message = exc_info.value.message_dict["config"][0]
    assert message.endswith("bytes of JSON; the limit is 64 KiB (65,536 bytes)")
    assert "hhhh" not in message  # the size, never the content (a config may hold secrets)


# --- identifiers and paths ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ('orders"; DROP TABLE x; --', "write names without quotes"),
        ("a.b.c", "is not 'name' or 'schema.name'"),
        ("public.", "no empty parts"),
        ("", "table: this field is required"),
    ],
)
def test_postgresql_table_names__quotes_and_extra_dots_refused(table: str, expected: str) -> None:
    with pytest.raises(ValidationError) as exc_info:
        registry.get("postgresql").validate_sink_spec({"table": table})
    assert expected in " ".join(exc_info.value.messages)


@pytest.mark.django_db(transaction=True)
@override_settings(DISPATCH_ALLOW_SITE_DATABASE=True)  # the sink is this database
def test_postgresql_sink__semicolons_are_part_of_a_quoted_name(tmp_path: Path) -> None:
    """A name with a semicolon is an identifier, never SQL: the run creates a table with
    exactly that name and the dispatch tables are untouched."""
    s = connection.settings_dict
    config: dict[str, Any] = {
        "host": s["HOST"] or "127.0.0.1",
        "dbname": s["NAME"],
        "user": s["USER"],
    }
    if s.get("PORT"):
        config["port"] = int(s["PORT"])
    if s.get("PASSWORD"):
        config["password"] = s["PASSWORD"]
    evil = "evil; DROP TABLE dispatch_run; --"
    sink = DatasourceFactory(kind="postgresql", config=config)
    job = JobFactory(
        source_spec={"rows": 7, "batch": 3},
        sink_spec={"table": f"public.{evil}", "mode": "append", "create": True},
    )
    binding = BindingFactory(job=job, sink=sink)
    binding.full_clean()
    run = trigger(binding)
    (claimed,) = claims.claim("w-bad", run_id=run.id)
    try:
        assert Runner(claimed, ExecutionControl(claimed)).execute() == Status.SUCCEEDED
        with connection.cursor() as cursor:
            cursor.execute(
                sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier("public", evil))
            )
            assert cursor.fetchone()[0] == 7
        assert Run.objects.filter(pk=run.pk).exists()
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                sql.SQL("DROP TABLE IF EXISTS {}, public.dispatch_fence").format(
                    sql.Identifier("public", evil)
                )
            )


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("../outside.csv", "contains '..'"),
        ("a/../../outside.csv", "contains '..'"),
        ("/etc/passwd", "is absolute"),
        ("", "must be a file path relative to the base directory"),
    ],
)
def test_csv_paths__escaping_base_dir_refused_at_validation(path: str, expected: str) -> None:
    with pytest.raises(ValidationError) as exc_info:
        registry.get("csv").validate_sink_spec({"path": path})
    assert expected in " ".join(exc_info.value.messages)


def test_csv_paths__a_symlink_out_of_base_dir_refused_at_run_time(tmp_path: Path) -> None:
    from dispatch.connectors import csv as csv_connector
    from dispatch.connectors.base import PermanentError

    base = tmp_path / "base"
    base.mkdir()
    (base / "link").symlink_to(tmp_path)
    with pytest.raises(PermanentError, match="leaves base_dir"):
        csv_connector.resolve(str(base), "link/secret.csv")
    assert csv_connector.resolve(str(base), "inside.csv") == str(base / "inside.csv")


# --- schedules ------------------------------------------------------------------------------
@pytest.mark.django_db
@pytest.mark.parametrize(
    ("cron", "tz", "field"),
    [
        ("61 * * * *", "UTC", "cron"),
        ("* * * *", "UTC", "cron"),
        ("every day", "UTC", "cron"),
        ("* * * * *", "Mars/Olympus_Mons", "timezone"),
        ("* * * * *", "", "timezone"),
    ],
)
def test_schedule__malformed_cron_or_timezone_named_and_not_saved(
    cron: str, tz: str, field: str
) -> None:
    from scheduling.models import Schedule

    binding = BindingFactory()
    with pytest.raises(ValidationError) as exc_info:
        Schedule(binding=binding, cron=cron, timezone=tz).save()
    assert field in exc_info.value.message_dict
    assert exc_info.value.message_dict[field][0]
    assert not Schedule.objects.exists()


@pytest.mark.django_db
@HYPOTHESIS
@given(cron=st.text(alphabet=string.digits + " */,-LW#?ABCDEFJMNOSTUY", max_size=24))
def test_schedule__any_cron_text_saves_or_is_named(cron: str) -> None:
    from scheduling.models import Schedule

    binding = BindingFactory()
    try:
        Schedule(binding=binding, cron=cron, timezone="UTC").save()
    except ValidationError as exc:
        assert list(exc.message_dict) == ["cron"]
        assert not Schedule.objects.filter(binding=binding).exists()
    else:
        assert Schedule.objects.get(binding=binding).next_fire_at is not None


# --- encryption keys ------------------------------------------------------------------------
def test_system_check__missing_and_invalid_keys() -> None:
    with override_settings(DISPATCH_ENCRYPTION_KEYS=[]):
        errors = check_encryption_keys()
    assert [e.id for e in errors] == ["dispatch.E001"]
    assert "DISPATCH_ENCRYPTION_KEYS is empty" in errors[0].msg
    with override_settings(DISPATCH_ENCRYPTION_KEYS=[Fernet.generate_key().decode(), "nope"]):
        errors = check_encryption_keys()
    assert [e.id for e in errors] == ["dispatch.E002"]
    assert "entry 2 is not a valid Fernet key" in errors[0].msg
    assert "nope" not in errors[0].msg + (errors[0].hint or "")


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_worker_with_a_wrong_key_format__refuses_to_start(processes: Processes) -> None:
    proc = processes.worker(env=worker_env(DISPATCH_ENCRYPTION_KEYS="not-a-fernet-key"))
    assert proc.wait(60) != 0
    output = processes.output(proc)
    assert "dispatch.E002" in output
    assert "not-a-fernet-key" not in output


@pytest.mark.django_db(transaction=True)
def test_snapshot_under_an_unknown_key__is_released_not_failed() -> None:
    run = trigger(BindingFactory(job__max_attempts=1))
    (claimed,) = claims.claim("w-bad", run_id=run.id)
    events: list[str] = []
    # The worker holds only a key the snapshot was not encrypted with: the worker is at
    # fault, not the run (docs/security.md).
    with override_settings(DISPATCH_ENCRYPTION_KEYS=[Fernet.generate_key().decode()]):
        status = Runner(claimed, ExecutionControl(claimed), on_event=events.append).execute()
    assert "keys_unusable" in events  # the coordinator stops on this event
    first, successor = Attempt.objects.filter(run=run).order_by("number")
    assert (first.reason, first.source_snapshot) == (Reason.SHUTDOWN_RELEASED, None)
    assert status == first.status != Status.FAILED
    assert "open no snapshot" in first.error
    assert (successor.status, successor.origin) == (Status.PENDING, Origin.RELEASE)
    run.refresh_from_db()
    assert run.status == Status.PENDING


# --- a database that is down when a worker starts ---------------------------------------------
@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_worker_start_with_database_down__retries_then_exits_0_on_sigterm(
    processes: Processes,
) -> None:
    secret = "pw-" + uuid.uuid4().hex[:10]
    # Port 9 (discard) on loopback: nothing listens there.
    env = worker_env(DATABASE_URL=f"postgres://dispatch:{secret}@127.0.0.1:9/nowhere")
    proc = processes.worker(env=env)
    wait_until(
        lambda: processes.output(proc).count("database unavailable, retrying") >= 2,
        timeout=30,
        message="two 'database unavailable, retrying' lines",
    )
    assert proc.poll() is None  # still waiting, not a crash loop
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    assert secret not in processes.output(proc)


# --- management commands with unknown ids ----------------------------------------------------
@pytest.mark.django_db
@pytest.mark.parametrize("command", ["cancel", "retry"])
def test_run_commands__unknown_or_malformed_ids(command: str, unchanged: None) -> None:
    with pytest.raises(CommandError, match=r"^'12; DROP' is not a run id \(a UUID\)\.$"):
        call_command(command, "12; DROP", stdout=io.StringIO())
    missing = uuid.uuid4()
    with pytest.raises(CommandError, match=f"^No run with id {missing}.$"):
        call_command(command, str(missing), stdout=io.StringIO())


@pytest.mark.django_db
def test_trigger_command__unknown_binding(unchanged: None) -> None:
    with pytest.raises(CommandError, match=r"^No binding with id or name 'ghost'\.$"):
        call_command("trigger", "ghost", stdout=io.StringIO())
