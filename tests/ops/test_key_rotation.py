"""Key rotation end to end, without downtime (contract sections 6 and 8): workers run with
keys [new, old] while `manage.py rotate_keys` re-encrypts configs and live snapshots under
the new key; then a worker holding only [new] completes new runs."""

from __future__ import annotations

import signal

import pytest
from cryptography.fernet import Fernet, InvalidToken

from dispatch.core import conf
from dispatch.core.states import Status
from dispatch.models import Attempt, Datasource, Run
from tests.support.factories import BindingFactory, JobFactory, trigger
from tests.support.processes import Processes, wait_until, worker_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def decrypts_with(key: str, token: str) -> bool:
    try:
        Fernet(key).decrypt(token.encode("ascii"))
    except InvalidToken:
        return False
    return True


def test_rotate_keys__while_workers_run_then_new_key_alone(processes: Processes) -> None:
    (old,) = conf.encryption_keys()  # the suite's key: everything so far is under it
    new = Fernet.generate_key().decode()
    # About 3 s per run, so attempts are RUNNING (with snapshots under the old key) while
    # the rotation happens.
    binding = BindingFactory(
        job=JobFactory(source_spec={"rows": 30, "batch": 1, "delay_ms": 100}),
        max_concurrency=2,
    )
    # A binding's hash key is a ciphertext under the site's keys too.
    binding.set_hash_key("a pseudonymisation key")
    binding.save(update_fields=["hash_key_ciphertext"])
    assert decrypts_with(old, binding.hash_key_ciphertext)
    both = worker_env(DISPATCH_ENCRYPTION_KEYS=f"{new},{old}")
    first = processes.worker("--concurrency", "2", "--worker-id", "rotation-1", env=both)
    runs = [trigger(binding) for _ in range(2)]
    wait_until(
        lambda: (
            Attempt.objects.filter(status=Status.RUNNING, source_snapshot__isnull=False)
            .values_list("source_snapshot", flat=True)
            .first()
        ),
        timeout=30,
        message="a running attempt with a snapshot",
    )
    live = list(
        Attempt.objects.filter(status=Status.RUNNING).values_list("source_snapshot", flat=True)
    )
    assert live and all(decrypts_with(old, s) and not decrypts_with(new, s) for s in live)

    rotate = processes.manage("rotate_keys", env=both)
    assert rotate.wait(60) == 0, processes.output(rotate)
    output = processes.output(rotate)
    assert "re-encrypted 2 datasource config(s), 1 binding hash key(s) and " in output
    assert old not in output and new not in output

    for ciphertext in Datasource.objects.values_list("config_ciphertext", flat=True):
        assert decrypts_with(new, ciphertext)
        assert not decrypts_with(old, ciphertext)
    binding.refresh_from_db()
    assert decrypts_with(new, binding.hash_key_ciphertext)
    assert not decrypts_with(old, binding.hash_key_ciphertext)
    for snapshot in Attempt.objects.filter(source_snapshot__isnull=False).values_list(
        "source_snapshot", flat=True
    ):
        assert decrypts_with(new, snapshot) and not decrypts_with(old, snapshot)

    # The runs in flight during the rotation finish on the worker that holds both keys.
    wait_until(
        lambda: all(Run.objects.get(pk=r.pk).status == Status.SUCCEEDED for r in runs),
        timeout=60,
        message="the runs in flight during the rotation to succeed",
    )
    first.send_signal(signal.SIGTERM)
    assert first.wait(30) == 0

    # Drop the old key: a worker with [new] alone completes new runs.
    second = processes.worker(
        "--concurrency",
        "2",
        "--worker-id",
        "rotation-2",
        env=worker_env(DISPATCH_ENCRYPTION_KEYS=new),
    )
    later = [trigger(binding) for _ in range(2)]
    wait_until(
        lambda: all(Run.objects.get(pk=r.pk).status == Status.SUCCEEDED for r in later),
        timeout=60,
        message="new runs to succeed on the worker holding only the new key",
    )
    assert set(Attempt.objects.filter(run__in=later).values_list("worker_id", flat=True)) == {
        "rotation-2"
    }
    assert not Attempt.objects.filter(reason="SNAPSHOT_UNREADABLE").exists()
    assert old not in processes.output(second)
