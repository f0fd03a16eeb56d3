"""The job form's help on specs: the fields each connector kind accepts, generated from the
connectors' declarations, which are the names their validators accept."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.test import Client
from django.urls import reverse

from dispatch.connectors import registry
from dispatch.connectors.base import Connector, SpecField, check_unknown, require_object
from tests.support.factories import BindingFactory, SinkFactory

pytestmark = pytest.mark.django_db

ADD = "admin:dispatch_job_add"


class GadgetConnector(Connector):
    """A site's own source kind, declaring its spec's fields."""

    kind = "gadgettest"
    label = "Gadgets"
    roles = frozenset({"source"})
    source_fields = (SpecField("widgets", "how many widgets"),)

    @classmethod
    def validate_source_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        spec = require_object(spec, "source_spec")
        check_unknown(spec, cls.spec_field_names("source"))
        return spec


class GadgetConnectorWithSprockets(GadgetConnector):
    """The same kind, one field more."""

    source_fields = (*GadgetConnector.source_fields, SpecField("sprockets", "and sprockets"))


def help_items(page: str, role: str) -> dict[str, str]:
    """{kind: text} of the help under the job form's `role` spec."""
    block = re.search(rf'<ul class="dsp-spec-help" data-role="{role}">(.*?)</ul>', page, re.S)
    assert block, f"no help on the {role} spec"
    return {
        kind: html.unescape(re.sub(r"<[^>]+>", "", text))
        for kind, text in re.findall(r'<li data-kind="([^"]+)">(.*?)</li>', block.group(1), re.S)
    }


def declared_names(text: str) -> list[str]:
    """The field names a help item lists, in order."""
    return re.findall(r"(?:: |; )(\w+)(?: — |;|$)", text)


def test_add_job__each_kind_lists_the_fields_its_connector_declares(admin_client: Client) -> None:
    page = admin_client.get(reverse(ADD)).content.decode()
    for role in ("source", "sink"):
        items = help_items(page, role)
        kinds = {k for k, c in registry.kinds().items() if role in c.roles}
        assert set(items) == kinds, role
        for kind in kinds:
            fields = registry.get(kind).spec_fields(role)
            assert fields is not None, f"{kind} declares no {role} fields"
            assert declared_names(items[kind]) == [f.name for f in fields], (kind, role)
            for f in fields:
                assert f"{f.name} — {f.help}" in items[kind]
    assert "none (leave the spec {})" in help_items(page, "sink")["null"]
    assert "table — name or schema.name to read" in help_items(page, "source")["postgresql"]


def test_add_job__a_field_added_to_a_connector_appears(admin_client: Client, settings: Any) -> None:
    settings.DISPATCH_CONNECTORS = [f"{__name__}.GadgetConnector"]
    page = admin_client.get(reverse(ADD)).content.decode()
    assert (
        help_items(page, "source")["gadgettest"]
        == "gadgettest (Gadgets): widgets — how many widgets"
    )
    assert "gadgettest" not in help_items(page, "sink")  # not a sink
    settings.DISPATCH_CONNECTORS = [f"{__name__}.GadgetConnectorWithSprockets"]
    page = admin_client.get(reverse(ADD)).content.decode()
    assert declared_names(help_items(page, "source")["gadgettest"]) == ["widgets", "sprockets"]


def test_change_job__marks_the_kinds_its_bindings_use(admin_client: Client) -> None:
    binding = BindingFactory(sink=SinkFactory())  # generate -> null
    url = reverse("admin:dispatch_job_change", args=[binding.job.pk])
    page = admin_client.get(url).content.decode()
    assert "this job's bindings use it" in help_items(page, "source")[binding.source.kind]
    assert "this job's bindings use it" in help_items(page, "sink")[binding.sink.kind]
    others = [k for k, t in help_items(page, "source").items() if k != binding.source.kind]
    assert others and all(
        "this job's bindings" not in help_items(page, "source")[k] for k in others
    )


def refused_as_unknown(validate: Callable[[dict[str, Any]], Any], name: str) -> bool:
    try:
        validate({name: object()})
    except ValidationError as exc:
        return any("unknown field" in m for m in exc.messages)
    return False


@pytest.mark.parametrize("role", ["source", "sink"])
def test_declared_fields__are_exactly_what_the_validator_accepts(role: str) -> None:
    for kind, connector in registry.kinds().items():
        if role not in connector.roles:
            continue
        validate = (
            connector.validate_source_spec if role == "source" else connector.validate_sink_spec
        )
        for name in connector.spec_field_names(role):
            assert not refused_as_unknown(validate, name), f"{kind} refuses its {role} field {name}"
        assert refused_as_unknown(validate, "no_such_field"), f"{kind} takes any {role} field"
