"""A worker's own metrics port (`runworker --metrics-port`), scraped over HTTP from a real
worker process and parsed with prometheus_client's own parser."""

from __future__ import annotations

import re
import signal
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dispatch.core.states import Status
from dispatch.models import Run
from tests.ops.test_metrics import samples
from tests.support.factories import BindingFactory, trigger
from tests.support.processes import Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    list(text_string_to_metric_families(text))  # parses whole, or raises
    return samples(text)


def test_worker_metrics__port_serves_this_workers_counters_and_histogram(
    processes: Processes,
) -> None:
    proc = processes.worker(
        "--worker-id", "w-port", "--concurrency", "2", "--poll-interval", "60",
        "--metrics-port", str(free_port()),
    )  # fmt: skip
    announced = re.compile(r"worker metrics on (http://127\.0\.0\.1:\d+/metrics) worker=w-port")
    wait_until(
        lambda: announced.search(processes.output(proc)) or proc.poll() is not None,
        message="the worker's metrics port",
    )
    match = announced.search(processes.output(proc))
    assert match, processes.output(proc)
    url = match.group(1)
    before = scrape(url)
    assert before[("dispatch_worker_slots", (("state", "free"),))] == 2
    assert before[("dispatch_worker_execution_seconds_count", ())] == 0

    binding = BindingFactory(job__source_spec={"rows": 7, "batch": 3})
    runs = [trigger(binding) for _ in range(3)]
    wait_until(
        lambda: (
            Run.objects.filter(pk__in=[r.pk for r in runs], status=Status.SUCCEEDED).count() == 3
        ),
        message="three runs to succeed",
    )
    # The counters are taken after the settlement commits: wait for the third.
    wait_until(
        lambda: scrape(url)[("dispatch_worker_execution_seconds_count", ())] == 3,
        message="three executions counted",
    )
    got = scrape(url)
    assert got[("dispatch_worker_events_total", (("event", "executions_finished"),))] == 3
    assert got[("dispatch_worker_events_total", (("event", "rows_read"),))] == 21
    assert got[("dispatch_worker_events_total", (("event", "rows_written"),))] == 21
    assert got[("dispatch_worker_execution_seconds_bucket", (("le", "+Inf"),))] == 3
    assert got[("dispatch_worker_slots", (("state", "busy"),))] == 0
    assert ("dispatch_worker_listen_healthy", (("state", "ok"),)) in got or (
        "dispatch_worker_listen_healthy",
        (("state", "starting"),),
    ) in got
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def test_worker_metrics__a_port_in_use_is_a_clear_error(processes: Processes) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = processes.worker("--metrics-port", str(port))
        assert proc.wait(60) != 0
    assert f"cannot serve metrics on 127.0.0.1:{port}" in processes.output(proc)
