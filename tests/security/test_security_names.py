"""Names of datasources, jobs and bindings hold no control characters: a line break in a
binding's name split every alert email's subject (`narrow\\r\\nBcc: ...`), which failed
them all, and forged log lines."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, transaction

from tests.support.factories import BindingFactory

pytestmark = pytest.mark.django_db

HOSTILE = ["narrow\r\nBcc: outside@example.com", "tab\there", "bell\x07", "del\x7f"]


@pytest.mark.parametrize("name", HOSTILE)
def test_names__the_validator_refuses_control_characters(name):
    binding = BindingFactory()
    for obj in (binding, binding.job, binding.source):
        obj.name = name
        with pytest.raises(ValidationError) as caught:
            obj.full_clean()
        assert "name" in caught.value.message_dict
        assert "control characters" in caught.value.message_dict["name"][0]


@pytest.mark.parametrize("table", ["dispatch_datasource", "dispatch_job", "dispatch_jobbinding"])
def test_names__the_database_refuses_them_past_the_model(table):
    BindingFactory()
    with (
        pytest.raises(IntegrityError, match=f"{table}_name_printable"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(f"UPDATE {table} SET name = name || E'\\r\\nBcc: x'")


def test_names__printable_text_stays_allowed():
    name = "Ventes — ÉTÉ 2026 (eu/west) ✓"
    binding = BindingFactory()
    for obj in (binding, binding.job, binding.source):
        obj._meta.get_field("name").clean(name, obj)  # the field's validators pass
        type(obj).objects.filter(pk=obj.pk).update(name=name)  # and the CHECK
        obj.refresh_from_db()
        assert obj.name == name


def test_names__the_console_says_so_and_keeps_the_old_name(client):
    binding = BindingFactory(name="narrow")
    client.force_login(User.objects.create_superuser("root-names", password="x"))
    url = f"/admin/dispatch/jobbinding/{binding.pk}/change/"
    page = client.get(url)
    assert page.status_code == 200
    form = page.context["adminform"].form
    data = {
        k: (v.pk if hasattr(v, "pk") else v)
        for k, v in form.initial.items()
        if v is not None and k in form.fields
    }
    data["name"] = "narrow\r\nBcc: outside@example.com"
    # The inline's management form (alert settings), empty.
    for prefix in {f.prefix for f in page.context["inline_admin_formsets"] for f in [f.formset]}:
        data.update({f"{prefix}-TOTAL_FORMS": 0, f"{prefix}-INITIAL_FORMS": 0})
    response = client.post(url, data)
    assert response.status_code == 200  # the form again, with its error
    assert "control characters" in response.content.decode()
    binding.refresh_from_db()
    assert binding.name == "narrow"
