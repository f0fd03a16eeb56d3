"""A `mysql` sink that stops its worker just before the fenced commit, for the test of the
stale-worker fence through real worker processes (tests/worker/test_mysql_workers.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from dispatch.connectors.base import Column, TransferContext, WriteResult
from dispatch.connectors.mysql import MySQLConnector, Writer

# In a worker's environment: its `test_mysql_pausing` sink stops the worker before the
# fenced commit, and says so in its output.
PAUSE_VARIABLE = "DISPATCH_TEST_PAUSE_BEFORE_SINK_COMMIT"
PAUSED = "paused before the sink commit"


class PausingWriter(Writer):
    def commit(self) -> WriteResult:
        if os.environ.get(PAUSE_VARIABLE) and not self.already_committed:
            # Past the runner's last lease check, before the fenced UPDATE. When the worker
            # wakes, its lease thread stops the execution and interrupts the running
            # statement (KILL QUERY from a second connection): in production that race
            # may go either way; here the interrupt always loses, so the sink's fence
            # alone decides.
            self._interrupter.close()
            print(f"{PAUSED} pid={os.getpid()}", flush=True)
            # To this thread: it stops on its way back from the call. Sent to the process
            # (os.kill), the stop would wait for the main thread to take it, and this
            # thread could send its UPDATE meanwhile.
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        return super().commit()


class PausingMySQLSink(MySQLConnector):
    """The `mysql` sink as kind `test_mysql_pausing` (for worker subprocesses:
    DISPATCH_CONNECTORS=tests.support.mysql_pausing.PausingMySQLSink). In a worker whose
    environment sets PAUSE_VARIABLE, it stops the whole worker (SIGSTOP to itself) after
    the runner's last lease check and just before the fenced commit: the test lets the
    lease expire and a successor commit, then continues the worker with SIGCONT."""

    kind = "test_mysql_pausing"
    roles = frozenset({"sink"})

    @classmethod
    @contextlib.contextmanager
    def open_writer(
        cls,
        config: dict[str, Any],
        spec: dict[str, Any],
        ctx: TransferContext,
        columns: list[Column],
    ) -> Iterator[Any]:
        writer = PausingWriter(config, spec, ctx, columns)
        try:
            writer.open()
            yield writer
        finally:
            writer.close()
