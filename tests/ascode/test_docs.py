"""docs/as-code.md and the JSON Schema: the published schema is the shipped one, agrees
with the kinds, and every YAML example of the page is valid by it and applies."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from django.core.validators import MaxValueValidator, MinValueValidator

from dispatch import ascode
from dispatch.ascode.kinds import all_kinds
from tests.support.ascode import run_command

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "as-code.md").read_text()
SCHEMA_TEXT = (ROOT / "docs" / "as-code.schema.json").read_text()
SCHEMA = json.loads(SCHEMA_TEXT)
EXAMPLES = re.findall(r"```yaml\n(.*?)```", PAGE, flags=re.S)


def test_schema__the_published_file_is_the_shipped_one() -> None:
    assert (ROOT / "dispatch" / "ascode" / "schema.json").read_text() == SCHEMA_TEXT
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_schema__agrees_with_the_kinds_fields_defaults_and_bounds() -> None:
    kinds = all_kinds()
    assert set(SCHEMA["properties"]) == {"version", *(k.key for k in kinds)}
    for kind in kinds:
        definition = SCHEMA["$defs"][kind.label]
        assert set(definition["properties"]) == {f.key for f in kind.fields}, kind.key
        assert set(definition.get("required", [])) == {f.key for f in kind.fields if f.required}
        for f in kind.fields:
            prop = definition["properties"][f.key]
            if not f.required:
                assert prop["default"] == kind.default(f), (kind.key, f.key)
            if f.choices:
                assert prop["enum"] == list(f.choices)
            if f.ref or f.key == "config" or f.key in getattr(kind, "edge_fields", ()):
                continue
            validators = kind.model._meta.get_field(f.key).validators
            lows = [v.limit_value for v in validators if isinstance(v, MinValueValidator)]
            highs = [v.limit_value for v in validators if isinstance(v, MaxValueValidator)]
            if lows:
                assert prop["minimum"] == max(lows), (kind.key, f.key)
            if highs:
                assert prop["maximum"] == min(highs), (kind.key, f.key)


def test_schema__refuses_a_secret_written_as_a_value() -> None:
    validator = jsonschema.Draft202012Validator(SCHEMA)
    data = {"datasources": {"w": {"kind": "postgresql", "config": {"password": "hunter2"}}}}
    assert list(validator.iter_errors(data))
    data["datasources"]["w"]["config"]["password"] = "env:DISPATCH_SECRET_W"
    assert not list(validator.iter_errors(data))


def test_page__has_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.split("\n")[0][:30])
def test_page__every_example_is_valid_by_the_schema(example: str) -> None:
    jsonschema.Draft202012Validator(SCHEMA).validate(yaml.safe_load(example))


@pytest.mark.django_db
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.split("\n")[0][:30])
def test_page__every_example_applies_and_then_is_unchanged(
    example: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in set(re.findall(r"env:(DISPATCH_SECRET_\w+)", example)):
        monkeypatch.setenv(name, f"value-of-{name}")

    plan = ascode.plan(ascode.load_text(example, source="example.yaml"))
    ascode.apply(plan)

    again = ascode.plan(ascode.load_text(example, source="example.yaml"))
    assert not again.has_changes
    assert len(again.changes) == len(plan.changes) > 0


@pytest.mark.django_db
def test_page__the_first_example_prints_what_the_page_shows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DISPATCH_SECRET_APP_DB_PASSWORD", "a")
    monkeypatch.setenv("DISPATCH_SECRET_WAREHOUSE_PASSWORD", "b")
    monkeypatch.chdir(tmp_path)
    Path("pipelines.yaml").write_text(EXAMPLES[0])
    shown = re.search(r"```\n(\$ DISPATCH_SECRET.*?)```", PAGE, flags=re.S)
    assert shown is not None

    ran = run_command("dispatch", "apply", "pipelines.yaml")  # as the page shows it

    assert ran.error is None, ran.text
    expected = [
        line
        for line in shown.group(1).splitlines()
        if not line.startswith(("$", "    python manage.py")) and line != "..."
    ]
    printed = ran.out.splitlines()
    assert [line for line in expected if line not in printed] == []
