"""The console in a real Chromium: log in, add a datasource (secret masked), trigger a
binding and watch its run succeed with a worker subprocess, cancel a running run.

Runs whenever a Chromium is installed (/usr/bin/chromium, or `chromium` on PATH); skipped
with a loud reason otherwise, and failed when the CI variable is set (CI must run it).
Regenerates the screenshots under docs/screenshots/.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db.models import F

from dispatch import services
from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, Datasource, Job, JobBinding, Run
from dispatch.worker import claims
from tests.console.test_admin import PASSWORD, vault_kind  # noqa: F401 - fixture
from tests.support.factories import DatasourceFactory, SinkFactory
from tests.support.processes import ROOT, Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser, pytest.mark.slow]

SCREENSHOTS = ROOT / "docs" / "screenshots"
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def find_chromium() -> str | None:
    if Path("/usr/bin/chromium").exists():
        return "/usr/bin/chromium"
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser(django_db_setup: Any) -> Iterator[Any]:
    executable = find_chromium()
    if executable is None:
        message = (
            "NO CHROMIUM FOUND: the browser tests of the admin console did not run "
            "(install it with `apt-get install -y chromium`)"
        )
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must run them")
        pytest.skip(message)
    sync_api = pytest.importorskip("playwright.sync_api")
    # Playwright's sync API keeps an event loop in this thread; the tests' own ORM calls
    # are still synchronous, one at a time, so Django's guard against async use is lifted
    # while the browser is open (and only then).
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_api.sync_playwright() as pw:
            chromium = pw.chromium.launch(executable_path=executable, args=LAUNCH_ARGS)
            try:
                yield chromium
            finally:
                chromium.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(browser: Any, live_server: Any) -> Iterator[Any]:
    User.objects.create_superuser("admin", "admin@example.com", "console-pw")
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(15_000)
    p = context.new_page()
    p.goto(f"{live_server.url}/admin/login/")
    p.fill("#id_username", "admin")
    p.fill("#id_password", "console-pw")
    p.click("input[type=submit]")
    p.wait_for_selector("#site-name")
    p.base = live_server.url  # type: ignore[attr-defined]
    try:
        yield p
    finally:
        context.close()


def binding(name: str, source_spec: dict[str, Any], lease: int = 30) -> JobBinding:
    job = Job.objects.create(
        name=f"{name}-job",
        source_spec=source_spec,
        sink_spec={},
        lease_seconds=lease,
        backoff_seconds=0,
        backoff_max_seconds=0,
    )
    return JobBinding.objects.create(
        name=name, job=job, source=DatasourceFactory(), sink=SinkFactory()
    )


def run_state(page: Any) -> str:
    return str(page.get_attribute("#dsp-run-state", "data-status"))


def test_browser__login_and_add_a_datasource_with_the_secret_masked(page: Any) -> None:
    page.goto(f"{page.base}/admin/dispatch/datasource/add/")
    page.fill("#id_name", "warehouse")
    # Choosing a kind reloads the form with that kind's settings (the name is kept).
    page.select_option("#id_kind", "vaulttest")
    page.wait_for_selector("input[name=config__host]")
    assert page.input_value("#id_name") == "warehouse"
    page.fill("input[name=config__host]", "db.internal")
    page.fill("input[name=config__port]", "5432")
    page.fill("input[name=config__password]", PASSWORD)
    assert page.get_attribute("input[name=config__password]", "type") == "password"
    page.click("input[name=_continue]")
    page.wait_for_selector(".messagelist .success")
    ds = Datasource.objects.get(name="warehouse")
    assert ds.config["password"] == PASSWORD
    assert page.input_value("input[name=config__password]") == ""
    assert PASSWORD not in page.content()
    assert "********" in page.inner_text(".field-stored_settings")


def test_browser__trigger_and_watch_the_run_succeed(page: Any, processes: Processes) -> None:
    b = binding("orders-to-archive", {"rows": 3000, "batch": 100, "delay_ms": 40, "seed": 7})
    # Some history for the overview, through the real path: a run whose attempt failed.
    failed = services.trigger(b)
    [claimed] = claims.claim("browser-history", run_id=failed.id, limit=1, generic=False)
    claims.settle(
        claimed.attempt_id,
        claimed.lease_token,
        "PERMANENT",
        reason=Reason.PERMANENT_ERROR,
        error="sink table orders_archive is missing",
    )
    processes.worker("--concurrency", "2", "--worker-id", "browser-worker-1")
    page.goto(f"{page.base}/admin/dispatch/jobbinding/{b.pk}/change/")
    page.click("button:has-text('Trigger now')")
    page.wait_for_selector("#dsp-run-state")
    assert "Trigger now: 1 binding triggered" in page.inner_text(".messagelist")
    run = Run.objects.get(binding=b, status__in=[Status.PENDING, Status.RUNNING, Status.SUCCEEDED])
    assert page.url.endswith(f"/admin/dispatch/run/{run.pk}/change/")
    # The page refreshes itself while the run is live: no reload from the test.
    page.wait_for_selector('#dsp-run-state[data-status="SUCCEEDED"]', timeout=60_000)
    assert page.get_attribute("#attempt-1", "data-status") == "SUCCEEDED"
    progress = page.inner_text("#attempt-1")
    assert "3,000 rows" in progress and "3,000 written" in progress and "rows/s" in progress
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "run-detail.png"), full_page=True)
    page.goto(f"{page.base}/admin/dispatch/run/overview/")
    page.wait_for_selector("#overview-chart svg rect")
    assert "browser-worker-1" in page.inner_text("#overview-workers")
    page.screenshot(path=str(SCREENSHOTS / "overview.png"), full_page=True)
    # Dark mode and a narrow screen: the same page, still readable.
    page.emulate_media(color_scheme="dark")
    page.set_viewport_size({"width": 390, "height": 844})
    page.reload()
    page.wait_for_selector("#overview-chart svg")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 400, f"the overview overflows a narrow screen ({width}px)"
    page.screenshot(path=str(SCREENSHOTS / "overview-narrow-dark.png"), full_page=True)


def test_browser__cancel_a_running_run(page: Any, processes: Processes) -> None:
    b = binding("slow-export", {"rows": 200_000, "batch": 100, "delay_ms": 50}, lease=3)
    run = services.trigger(b)
    processes.worker("--concurrency", "1")
    wait_until(
        lambda: Attempt.objects.filter(run=run, status=Status.RUNNING).exists(),
        message="the worker to claim the run",
    )
    page.goto(f"{page.base}/admin/dispatch/run/{run.pk}/change/")
    assert run_state(page) == "RUNNING"
    page.click("button:has-text('Cancel')")
    assert "are you sure" in page.inner_text("#content")
    page.click("input[type=submit][value='Yes, cancel']")
    page.wait_for_selector("#dsp-run-state")
    assert "cancel requested" in page.inner_text(".messagelist")
    page.wait_for_selector('#dsp-run-state[data-status="CANCELLED"]', timeout=30_000)
    run.refresh_from_db()
    assert run.status == Status.CANCELLED
    assert Attempt.objects.get(run=run).reason == "CANCELLED_BY_OPERATOR"


def test_browser__add_forms_show_no_database_default_placeholder(page: Any) -> None:
    # "Created at" is filled by the database (db_default): before the row exists there is
    # nothing to show, and Django 5.2 would print its DatabaseDefault placeholder.
    for model in ("job", "jobbinding"):
        page.goto(f"{page.base}/admin/dispatch/{model}/add/")
        page.wait_for_selector("#content-main form")
        shown = "DatabaseDefault" in page.content()
        assert not shown, f"the {model} add page shows a DatabaseDefault placeholder"


def test_browser__the_run_list_fits_1280_px_beside_the_menu_and_the_filters(page: Any) -> None:
    # Long names, with and without hyphens, and every kind of row: blocked at capacity,
    # running with progress and a cancel requested, retry scheduled, failed, succeeded.
    hyphens = binding("orders-to-archive-with-a-rather-long-binding-name", {"rows": 10})
    plain = binding("warehouse_orders_nightly_full_reload_into_the_archive", {"rows": 10})
    for b in (hyphens, plain):
        done, retried, failed, running, blocked = (services.trigger(b) for _ in range(5))
        for run, outcome in ((done, "SUCCEEDED"), (retried, "ERROR"), (failed, "PERMANENT")):
            [c] = claims.claim("browser-list", run_id=run.id, limit=1, generic=False)
            claims.settle(
                c.attempt_id,
                c.lease_token,
                outcome,
                reason=None if outcome == "SUCCEEDED" else Reason.PERMANENT_ERROR,
                error=None if outcome == "SUCCEEDED" else "sink table orders_archive is missing",
                rows_read=1_234_567,
                rows_written=1_234_567,
            )
        claims.claim("browser-list", run_id=running.id, limit=1, generic=False)
        Attempt.objects.filter(run=running, status=Status.RUNNING).update(
            rows_read=987_654, rows_written=900_000
        )
        services.cancel_run(running)
        assert Attempt.objects.get(run=blocked).blocked_reason
    page.goto(f"{page.base}/admin/dispatch/run/")
    page.wait_for_selector("#result_list")
    assert page.viewport_size["width"] == 1280
    assert page.is_visible("#nav-sidebar") and page.is_visible("#changelist-filter")
    widths = page.evaluate(
        """() => {
            const results = document.querySelector('#changelist .results');
            return {document: document.documentElement.scrollWidth,
                    table: results.scrollWidth, room: results.clientWidth};
        }"""
    )
    assert widths["document"] <= 1280, widths
    assert widths["table"] <= widths["room"], f"the run list overflows its room: {widths}"


def test_browser__a_sliced_runs_page_shows_its_slices(page: Any) -> None:
    """A sliced run caught half-way: one slice done, one running with progress, one
    failed, one queued, two not started; its page shows them all and their sum."""
    job = Job.objects.create(
        name="orders-sliced-job",
        source_spec={"table": "orders", "slices": {"key": "id", "count": 6}},
        sink_spec={"table": "orders_copy"},
        max_slices_in_flight=4,
        max_attempts=1,
    )
    b = JobBinding.objects.create(
        name="orders-sliced",
        job=job,
        source=DatasourceFactory(),
        sink=SinkFactory(),
        max_concurrency=8,
    )
    run = services.trigger(b)
    [c] = claims.claim("browser-slices", run_id=run.id, limit=1, generic=False)
    edges: list[str | None] = [None, *[str(i * 250_000) for i in range(1, 6)], None]
    claims.plan_slices(
        c.attempt_id, c.lease_token, key="id", key_type="bigint", method="count",
        basis="count 6: equal widths of [1, 1500000]",
        bounds=[(edges[i], edges[i + 1]) for i in range(6)],
        source_spec=job.source_spec, sink_spec=job.sink_spec,
    )  # fmt: skip

    def slice_claim(number: int) -> claims.ClaimedAttempt:
        child = Run.objects.get(parent=run, slice_number=number)
        [got] = claims.claim("browser-slices", run_id=child.id, limit=1, generic=False)
        return got

    done = slice_claim(1)
    claims.settle(
        done.attempt_id, done.lease_token, "SUCCEEDED", rows_read=250_000, rows_written=250_000
    )
    running = slice_claim(2)
    # Database times as a real copy leaves them: 9 s for slice 1, 4 s so far for 2.
    Attempt.objects.filter(pk=done.attempt_id).update(
        finished_at=F("claimed_at") + timedelta(seconds=9)
    )
    Attempt.objects.filter(pk=running.attempt_id).update(
        rows_read=120_000,
        rows_written=110_000,
        rows_estimated=250_000,
        heartbeat_at=F("claimed_at") + timedelta(seconds=4),
    )
    failed = slice_claim(3)
    claims.settle(
        failed.attempt_id, failed.lease_token, "PERMANENT", reason=Reason.PERMANENT_ERROR,
        error='duplicate key value violates unique constraint "orders_copy_pkey"',
    )  # fmt: skip
    page.goto(f"{page.base}/admin/dispatch/run/{run.id}/change/")
    page.wait_for_selector("#dsp-slice-table")
    states = page.eval_on_selector_all(
        "#dsp-slice-table tbody tr", "rows => rows.map(r => r.dataset.state)"
    )
    assert states == ["done", "running", "failed", "waiting", "waiting", "waiting"]
    assert "1 of 6 slices done" in page.inner_text("#dsp-slices-progress")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    SCREENSHOTS.mkdir(exist_ok=True)
    page.locator("#slices").screenshot(path=str(SCREENSHOTS / "run-slices.png"))


def _events(*events: tuple[float, str, str, dict[str, Any]]) -> claims.Events:
    """Events as a worker's buffer hands them over: (seconds before the write, kind,
    message, data)."""
    return (
        json.dumps([{"ago": ago, "kind": k, "message": m, "data": d} for ago, k, m, d in events]),
        0,
    )


def test_browser__a_runs_page_shows_each_attempts_events_beside_it(page: Any) -> None:
    """A run whose first attempt failed on a lock and a broken connection and whose
    retry succeeded: each attempt's events beside it, in order, within 1,280 px."""
    b = binding("orders-events", {"rows": 10}, lease=30)
    run = services.trigger(b)
    [first] = claims.claim("worker-a", run_id=run.id, limit=1, generic=False)
    claims.heartbeat(
        "worker-a",
        [
            (first.attempt_id, first.lease_token, 48_000, 48_000, _events(
                (14.2, "claimed", f"claimed by worker worker-a with lease token {first.lease_token} (directed)", {}),
                (14.1, "connected", "connected to the source (postgresql, server 16.4)", {}),
                (14.1, "connected", "connected to the sink (postgresql, server 15.8)", {}),
                (12.6, "lock_wait", "waited 1.5s for a lock: the sink's fence row", {"seconds": 1.5}),
                (12.6, "fence_raised", f"the sink's fence raised to token {first.lease_token}", {}),
                (12.5, "read_started", "the read began (COPY text)", {}),
                (2.5, "progress", "48000 rows read, 48000 written, 3145728 bytes", {}),
            )),
        ],
        {},
    )  # fmt: skip
    claims.settle(
        first.attempt_id, first.lease_token, "ERROR", reason=Reason.ERROR,
        error="OperationalError: server closed the connection unexpectedly",
        events=_events((0.2, "error", "OperationalError: server closed the connection unexpectedly",
                        {"error_class": "OperationalError"})),
    )  # fmt: skip
    [second] = claims.claim("worker-b", run_id=run.id, limit=1, generic=False)
    claims.settle(
        second.attempt_id, second.lease_token, "SUCCEEDED", rows_read=100_000,
        rows_written=100_000,
        events=_events(
            (6.1, "claimed", f"claimed by worker worker-b with lease token {second.lease_token}", {}),
            (6.0, "connected", "connected to the source (postgresql, server 16.4)", {}),
            (6.0, "connected", "connected to the sink (postgresql, server 15.8)", {}),
            (5.9, "fence_raised", f"the sink's fence raised to token {second.lease_token}", {}),
            (5.9, "read_started", "the read began (COPY text)", {}),
            (0.1, "committed", "the sink committed 100000 rows", {}),
        ),
    )  # fmt: skip
    page.goto(f"{page.base}/admin/dispatch/run/{run.id}/change/")
    page.wait_for_selector("#attempts-timeline")
    kinds = page.eval_on_selector_all(
        "#attempt-1 .dsp-event-list li", "items => items.map(i => i.dataset.kind)"
    )
    assert kinds[0] == "claimed" and kinds[-2:] == ["error", "settled"]
    assert "lock_wait" in kinds
    assert "committed" in page.inner_text("#attempt-2 .dsp-events")
    # Beside the attempt's facts, not under them: the events start level with them.
    facts = page.locator("#attempt-1 .dsp-t-facts").bounding_box()
    events = page.locator("#attempt-1 .dsp-events").bounding_box()
    assert events["x"] > facts["x"] + facts["width"] - 1 and abs(events["y"] - facts["y"]) < 40
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    SCREENSHOTS.mkdir(exist_ok=True)
    page.locator("#attempts-timeline").screenshot(path=str(SCREENSHOTS / "run-events.png"))


def test_browser__retry_all_matching_then_follow_the_bulk_operation(page: Any) -> None:
    """From a filtered run list: "apply to all matching", confirm, the message's link to
    the operation's page; the batches (run here, as a worker's maintenance loop runs
    them) fill its progress and list the skipped runs with their reasons."""
    from dispatch.models import BulkOperation
    from dispatch.ops import bulk
    from tests.support.bulk import make_runs

    b = binding("orders-nightly", {"rows": 10})
    JobBinding.objects.filter(pk=b.pk).update(enabled=False)  # the retries wait
    make_runs(b.pk, 40, Status.FAILED)
    make_runs(b.pk, 3, Status.SUCCEEDED)
    page.goto(f"{page.base}/admin/dispatch/run/?binding__id__exact={b.pk}")
    assert "Apply to all 43 matching this filter" in page.inner_text("#dsp-bulk")
    page.click("#dsp-bulk >> text=Retry…")
    page.wait_for_selector("#dsp-bulk-filter")
    page.click("input[type=submit]")
    page.click(".messagelist >> text=Follow it on its page")
    page.wait_for_selector("#dsp-bulk-state")
    assert page.get_attribute("#dsp-bulk-state", "data-status") == "PENDING"
    while bulk.work_batch(20) is not None:
        pass
    assert BulkOperation.objects.get().done == 40
    page.reload()
    assert page.get_attribute("#dsp-bulk-state", "data-status") == "DONE"
    text = page.inner_text("#content-main")
    assert "40 done, 3 skipped of 43" in text and "NOT_RETRYABLE" in text
    assert f"binding__id__exact = {b.pk} (orders-nightly)" in text
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    SCREENSHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "bulk-operation.png"), full_page=True)


def test_browser__a_run_page_draws_its_chain(page: Any) -> None:
    """A fan-in caught half-way: dims-a -> facts and dims-b -> facts, dims-a succeeded,
    dims-b still queued; the page of dims-a's run shows the run it caused (facts,
    waiting for its other upstream), and facts' page the runs it was caused by."""
    from dispatch.models import BindingEdge

    root_b = binding("nightly-start", {"rows": 1, "batch": 1})
    dims_a = binding("dims-customers", {"rows": 1, "batch": 1})
    dims_b = binding("dims-products", {"rows": 1, "batch": 1})
    facts = binding("facts-orders", {"rows": 1, "batch": 1})
    for up, down in ((root_b, dims_a), (root_b, dims_b), (dims_a, facts), (dims_b, facts)):
        BindingEdge.objects.create(upstream=up, downstream=down)
    root = services.trigger(root_b)

    def finish(run: Run) -> None:
        [c] = claims.claim("browser-chain", run_id=run.id, limit=1, generic=False)
        claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED", rows_read=1, rows_written=1)

    finish(root)
    finish(Run.objects.get(binding=dims_a, chain_root_id=root.id))
    waiting = Run.objects.get(binding=facts, chain_root_id=root.id)
    page.goto(f"{page.base}/admin/dispatch/run/{waiting.id}/change/")
    page.wait_for_selector(".dsp-chain-upstream")
    assert "dims-customers" in page.inner_text(".dsp-chain-upstream")
    assert "nightly-start" in page.inner_text(".dsp-chain-root")
    assert "Waiting for upstream runs" in page.inner_text("body")
    a_run = Run.objects.get(binding=dims_a, chain_root_id=root.id)
    page.goto(f"{page.base}/admin/dispatch/run/{a_run.id}/change/")
    page.wait_for_selector(".dsp-chain-downstream")
    assert "facts-orders" in page.inner_text(".dsp-chain-downstream")
    SCREENSHOTS.mkdir(exist_ok=True)
    page.goto(f"{page.base}/admin/dispatch/run/{waiting.id}/change/")
    page.wait_for_selector(".dsp-chain-upstream")
    page.screenshot(path=str(SCREENSHOTS / "run-chain.png"), full_page=True)
