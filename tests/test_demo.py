"""The demo `make run` seeds: its definitions are project/demo/*.yaml, applied by `dispatch
apply` through the same function `make run` calls (project/dev.py), into the test database."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import psycopg
import pytest
import yaml
from django.core.management import call_command
from django.db import connection
from psycopg import sql
from pyarrow.dataset import dataset as pq_dataset

from dispatch import api
from dispatch.connectors.mysql import MySQLConnector
from dispatch.connectors.postgresql import PostgreSQLConnector
from dispatch.core.states import Status
from dispatch.models import MANAGED_BY_FILES, Datasource, Job, JobBinding
from project import dev
from project.management.commands.seed_demo import MYSQL_DEMO_ROWS
from scheduling.models import Schedule
from tests.support.ascode import DEFINITION_TABLES, row_versions
from tests.support.connectors import run_transfer
from tests.support.processes import Processes, test_database_url, worker_env
from tools.mariadb import MariaDB

BINDINGS = {
    "demo-generate-to-null": ("demo-generate-100k", "demo-generator", "demo-discard"),
    "demo-orders-pg-to-pg": ("demo-orders-copy", "demo-pg-source", "demo-pg-sink"),
    "demo-orders-csv-to-pg": ("demo-orders-csv-load", "demo-csv-files", "demo-pg-sink"),
    "demo-orders-pg-to-parquet": (
        "demo-orders-parquet-export",
        "demo-pg-source",
        "demo-parquet-files",
    ),
}


@pytest.fixture
def demo_databases() -> Iterator[tuple[str, str]]:
    """The demo's source and sink databases, named after the test database (never the
    ones a `make run` on the same server uses), dropped afterwards."""
    name = connection.settings_dict["NAME"]
    names = (f"{name}_demo_source", f"{name}_demo_sink")
    yield names
    with psycopg.connect(test_database_url(), autocommit=True) as admin:
        for db in names:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db))
            )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_demo__applied_from_its_files_a_second_time_unchanged_and_its_bindings_run(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    demo_databases: tuple[str, str],
    processes: Processes,
) -> None:
    env = worker_env()
    password_file = tmp_path / "password"
    password_file.write_text("demo-login-pw")
    # Under pytest's temporary root, which tests.settings allows for CSV files.
    csv_dir = tmp_path / "csv" / "demo"
    parquet_dir = tmp_path / "parquet" / "demo"  # allowed for Parquet files likewise

    def seed() -> str:
        dev.seed_demo(
            env,
            password_file=password_file,
            csv_dir=csv_dir,
            parquet_dir=parquet_dir,
            databases=demo_databases,
        )
        return capfd.readouterr().out

    first = seed()
    assert "Plan: 15 to create, 0 to change, 0 to delete, 0 unchanged." in first, first
    found = {
        b.name: (b.job.name, b.source.name, b.sink.name)
        for b in JobBinding.objects.select_related("job", "source", "sink")
    }
    assert found == BINDINGS
    for model in (Datasource, Job, JobBinding, Schedule):
        assert set(model.objects.values_list("managed_by", flat=True)) == {MANAGED_BY_FILES}
    schedule = Schedule.objects.get(name="demo-generate-every-minute")
    assert (schedule.binding.name, schedule.cron) == ("demo-generate-to-null", "* * * * *")
    # The per-machine values came from the environment dev.py set: kept as references.
    source = Datasource.objects.get(name="demo-pg-source")
    assert source.secret_refs == {"url": "env:DISPATCH_SECRET_DEMO_SOURCE_URL"}
    assert source.config["url"].endswith(f"/{demo_databases[0]}")
    assert Datasource.objects.get(name="demo-csv-files").config == {"base_dir": str(csv_dir)}
    assert "postgresql://" not in first  # the URLs (DATABASE_URL's password) never printed

    versions = row_versions(*DEFINITION_TABLES)
    second = seed()
    assert "Plan: 0 to create, 0 to change, 0 to delete, 15 unchanged." in second, second
    assert row_versions(*DEFINITION_TABLES) == versions  # nothing written

    runs = [api.trigger(name) for name in BINDINGS]
    worker = processes.worker("--burst", "--no-scheduler", "--concurrency", "3")
    assert worker.wait(120) == 0, processes.output(worker)
    for run in runs:
        run.refresh_from_db()
        assert run.status == Status.SUCCEEDED, (run.binding.name, processes.output(worker))
    with psycopg.connect(
        dev.demo_url(test_database_url(), demo_databases[1]), autocommit=True
    ) as sink:
        assert sink.execute("SELECT count(*) FROM public.orders_copy").fetchone() == (100_000,)
        assert sink.execute("SELECT count(*) FROM public.orders_csv").fetchone() == (3,)
    orders = pq_dataset(str(parquet_dir / "orders"), format="parquet")
    assert orders.count_rows() == 100_000


def test_demo_csv_dir__only_where_the_site_allows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dev.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(dev, "ENV_FILE", tmp_path / ".env")
    chosen = dev.csv_env({})["DISPATCH_CSV_BASE_DIRS"]
    assert dev.demo_csv_dir({"DISPATCH_CSV_BASE_DIRS": chosen}) == Path(chosen) / "demo"
    assert dev.demo_csv_dir({"DISPATCH_CSV_BASE_DIRS": "/srv/csv"}) is None
    (tmp_path / ".env").write_text(f"DISPATCH_CSV_BASE_DIRS='/srv/csv,{tmp_path}'\n")
    assert dev.demo_csv_dir({}) == Path(chosen) / "demo"


def test_demo_url__the_site_server_and_role_with_another_database() -> None:
    url = dev.demo_url("postgres://loader:p%40ss@db.local:6543/site?sslmode=require", "demo x")
    assert url == "postgresql://loader:p%40ss@db.local:6543/demo%20x"


@pytest.mark.parametrize("name", ["pipelines.yaml", "csv.yaml", "parquet.yaml"])
def test_demo_files__valid_by_the_published_schema(name: str) -> None:
    schema = json.loads((dev.ROOT / "docs" / "as-code.schema.json").read_text())
    data = yaml.safe_load((dev.DEMO_DIR / name).read_text())
    jsonschema.Draft202012Validator(schema).validate(data)


@pytest.mark.django_db(transaction=True)
def test_demo_mysql__seeded_only_with_a_server_and_its_binding_copies(
    tmp_path: Path,
    demo_databases: tuple[str, str],
    mariadb: MariaDB,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    password_file = tmp_path / "password"
    password_file.write_text("demo-login-pw")
    args = ["--admin-password-file", str(password_file), "--source-db", demo_databases[0],
            "--sink-db", demo_databases[1]]  # fmt: skip
    sink = Datasource.objects.create(
        name="demo-pg-sink",
        kind="postgresql",
        config={"url": dev.demo_url(test_database_url(), demo_databases[1])},
    )
    monkeypatch.delenv("DISPATCH_DEMO_MYSQL_URL", raising=False)
    call_command("seed_demo", *args)
    assert not JobBinding.objects.filter(name="demo-orders-mariadb-to-pg").exists()
    url = (
        f"mysql://{mariadb.admin_user}:{mariadb.admin_password}@127.0.0.1:{mariadb.port}"
        "/dispatch_demo_test"
    )
    out = io.StringIO()
    monkeypatch.setenv("DISPATCH_DEMO_MYSQL_URL", url)
    call_command("seed_demo", *args, stdout=out)
    call_command("seed_demo", *args, stdout=out)  # idempotent
    assert mariadb.admin_password not in out.getvalue()
    binding = JobBinding.objects.select_related("job", "source").get(
        name="demo-orders-mariadb-to-pg"
    )
    assert binding.source.kind == "mysql" and binding.sink == sink
    result = run_transfer(
        MySQLConnector, binding.source.config, binding.job.source_spec,
        PostgreSQLConnector, sink.config, binding.job.sink_spec,
    )  # fmt: skip
    assert result.rows_written == MYSQL_DEMO_ROWS
    with psycopg.connect(dev.demo_url(test_database_url(), demo_databases[1])) as conn:
        assert conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE 'vip' = ANY(tags)) FROM orders_from_mariadb"
        ).fetchone() == (MYSQL_DEMO_ROWS, MYSQL_DEMO_ROWS // 5)
    root = mariadb.root()
    with root.cursor() as cur:
        cur.execute("DROP DATABASE dispatch_demo_test")
    root.close()
