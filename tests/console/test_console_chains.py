"""The console and chains: the binding form edits a binding's upstreams and refuses a
cycle naming it; the binding page lists its upstreams and downstreams; the run page
shows the runs it was caused by and those it caused."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from dispatch.console.forms import BindingForm
from dispatch.core.states import ChainOn
from dispatch.models import BindingEdge, JobBinding, Run
from dispatch.worker import claims
from tests.support import factories

pytestmark = pytest.mark.django_db


def form_data(b: JobBinding, after: list[JobBinding], on: str = ChainOn.SUCCESS) -> dict[str, Any]:
    return {
        "name": b.name,
        "job": b.job_id,
        "source": b.source_id,
        "sink": b.sink_id,
        "enabled": "on",
        "max_concurrency": b.max_concurrency,
        "after": [x.pk for x in after],
        "on": on,
    }


def test_form__saves_upstreams_and_refuses_a_cycle_naming_it() -> None:
    a, b, c = (factories.BindingFactory(name=n) for n in ("f-a", "f-b", "f-c"))
    for down, ups, on in ((b, [a], ChainOn.SUCCESS), (c, [b], ChainOn.COMPLETION)):
        form = BindingForm(data=form_data(down, ups, on), instance=down)
        assert form.is_valid(), form.errors
        form.save()
    assert set(BindingEdge.objects.values_list("upstream__name", "downstream__name", "on")) == {
        ("f-a", "f-b", "SUCCESS"),
        ("f-b", "f-c", "COMPLETION"),
    }
    form = BindingForm(data=form_data(a, [c]), instance=a)
    assert not form.is_valid()
    assert form.errors["after"] == ["these upstreams would form a cycle: f-a -> f-b -> f-c -> f-a"]
    assert not BindingEdge.objects.filter(downstream=a).exists()
    # The form shows the stored upstreams; clearing them deletes the edges.
    form = BindingForm(instance=c)
    assert form.initial["after"] == [b.pk] and form.initial["on"] == ChainOn.COMPLETION
    form = BindingForm(data=form_data(c, []), instance=c)
    assert form.is_valid(), form.errors
    form.save()
    assert not BindingEdge.objects.filter(downstream=c).exists()


def test_pages__binding_lists_its_edges_and_run_its_chain(admin_client: Client) -> None:
    a, b = factories.BindingFactory(name="p-a"), factories.BindingFactory(name="p-b")
    BindingEdge.objects.create(upstream=a, downstream=b)
    root = factories.trigger(a)
    (c,) = claims.claim("w", run_id=root.pk, limit=1, generic=False)
    claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED")
    down = Run.objects.get(binding=b, chain_root_id=root.pk)

    page = admin_client.get(f"/admin/dispatch/jobbinding/{a.pk}/change/").content.decode()
    assert 'class="dsp-chain-downstreams">downstreams: <a href=' in page and "p-b" in page
    page = admin_client.get(f"/admin/dispatch/run/{root.pk}/change/").content.decode()
    assert f"/admin/dispatch/run/{down.pk}/change/" in page
    page = admin_client.get(f"/admin/dispatch/run/{down.pk}/change/").content.decode()
    assert f"/admin/dispatch/run/{root.pk}/change/" in page  # caused by, and its root
    assert "chain begun by" in page


def test_admin__the_binding_page_saves_its_upstreams_and_shows_a_cycle(
    admin_client: Client,
) -> None:
    from tests.ops.test_alerts import binding_post

    a, b = factories.BindingFactory(name="adm-a"), factories.BindingFactory(name="adm-b")
    url = f"/admin/dispatch/jobbinding/{b.pk}/change/"
    data = {**binding_post(b), "after": [str(a.pk)], "on": ChainOn.COMPLETION}
    response = admin_client.post(url, data)
    assert response.status_code == 302, response.content.decode()[-3000:]
    assert list(BindingEdge.objects.values_list("upstream", "downstream", "on")) == [
        (a.pk, b.pk, "COMPLETION")
    ]
    data = {**binding_post(a), "after": [str(b.pk)]}
    response = admin_client.post(f"/admin/dispatch/jobbinding/{a.pk}/change/", data)
    assert response.status_code == 200
    assert "these upstreams would form a cycle: adm-a -&gt; adm-b -&gt; adm-a" in (
        response.content.decode()
    )
    assert BindingEdge.objects.count() == 1


def test_admin__without_the_trigger_permission_the_upstreams_are_shown_not_edited(
    client: Client,
) -> None:
    """An edge starts its binding whenever its upstream ends: a user who may change
    bindings but not trigger runs cannot draw one (the posted upstreams are ignored)."""
    from django.contrib.auth.models import Permission, User

    from tests.ops.test_alerts import binding_post

    a, b = factories.BindingFactory(name="np-a"), factories.BindingFactory(name="np-b")
    editor = User.objects.create_user("editor", is_staff=True)
    editor.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_jobbinding", "change_jobbinding"])
    )
    client.force_login(editor)
    url = f"/admin/dispatch/jobbinding/{b.pk}/change/"
    page = client.get(url).content.decode()
    assert "Editing what this binding waits for needs the permission to trigger runs" in page
    response = client.post(url, {**binding_post(b), "after": [str(a.pk)], "name": "np-b2"})
    assert response.status_code == 302, response.content.decode()[-3000:]
    assert JobBinding.objects.get(pk=b.pk).name == "np-b2"  # the rest of the form saved
    assert not BindingEdge.objects.exists()
    editor.user_permissions.add(Permission.objects.get(codename="trigger_binding"))
    editor = User.objects.get(pk=editor.pk)  # a fresh permission cache
    client.force_login(editor)
    response = client.post(url, {**binding_post(b), "after": [str(a.pk)]})
    assert response.status_code == 302, response.content.decode()[-3000:]
    assert list(BindingEdge.objects.values_list("upstream", "downstream")) == [(a.pk, b.pk)]


def test_form__a_binding_waits_for_and_starts_at_most_max_edges() -> None:
    from dispatch import services

    hub = factories.BindingFactory(name="hub")
    downs = [factories.BindingFactory(name=f"d-{i:02}") for i in range(services.MAX_EDGES)]
    BindingEdge.objects.bulk_create(BindingEdge(upstream=hub, downstream=d) for d in downs)
    one_more = factories.BindingFactory(name="one-more")
    form = BindingForm(data=form_data(one_more, [hub]), instance=one_more)
    assert not form.is_valid()
    assert form.errors["after"] == [
        f"hub already starts {services.MAX_EDGES} bindings, the most one may start"
    ]
    with pytest.raises(services.ChainCycle, match="already starts"):
        services.set_upstreams(one_more, [(hub, ChainOn.SUCCESS)])
    form = BindingForm(data=form_data(hub, [*downs[:0], one_more]), instance=hub)
    assert form.is_valid(), form.errors  # waiting for one is within bounds
    many = [factories.BindingFactory(name=f"u-{i:02}") for i in range(services.MAX_EDGES + 1)]
    form = BindingForm(data=form_data(one_more, many), instance=one_more)
    assert not form.is_valid()
    assert form.errors["after"][0].startswith(f"a binding waits for at most {services.MAX_EDGES}")
    assert not BindingEdge.objects.filter(downstream=one_more).exists()
