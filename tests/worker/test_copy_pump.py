"""The copy's reading thread (`runner.CopyPump`) and the two connectors opened at once
(`runner._open_both`): errors on either side, a stop mid copy, the queue's bound, and no
thread left behind."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dispatch.connectors.base import Column, Stopped
from dispatch.worker import runner
from dispatch.worker.runner import CopyPump, Runner, _open_both
from tests.support.connectors import Ctx


def wait_until(predicate: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def copy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dispatch-copy-read"]


class Source:
    """A reader whose COPY blocks come from `blocks` (raising `fail` after them)."""

    columns = [Column("id", "bigint")]

    def __init__(self, blocks: int, fail: BaseException | None = None) -> None:
        self.blocks = blocks
        self.fail = fail
        self.produced = 0
        self.closed = False
        self.interrupted = threading.Event()

    def copy_chunks(self, fmt: str) -> Iterator[tuple[bytes, int]]:
        try:
            for _ in range(self.blocks):
                self.produced += 1
                yield b"x" * 10, 1
            if self.fail is not None:
                raise self.fail
        finally:
            self.closed = True

    def interrupt(self) -> None:
        self.interrupted.set()


class Sink:
    already_committed = False

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.written = 0

    def copy_format(self, columns: list[Column]) -> str:
        return "binary"

    def write_copy(self, data: bytes, rows: int) -> int:
        if self.written + 1 == self.fail_at:
            raise RuntimeError("sink failed")
        self.written += 1
        return rows


def test_pump__moves_every_block_in_order_and_leaves_no_thread() -> None:
    blocks = [(bytes([i]), i) for i in range(50)]
    assert list(CopyPump(iter(blocks))) == blocks
    assert copy_threads() == []


def test_transfer__a_source_error_mid_copy_is_raised_and_the_thread_ends() -> None:
    source, sink = Source(7, fail=ValueError("source failed at block 8")), Sink()
    ctx = Ctx()
    with pytest.raises(ValueError, match="block 8"):
        Runner._transfer(ctx, source, sink)  # type: ignore[arg-type]
    assert sink.written == 7 and ctx.rows_read == 7
    assert copy_threads() == []


def test_transfer__a_sink_error_mid_copy_ends_the_reading_thread() -> None:
    source, sink = Source(1000), Sink(fail_at=3)
    with pytest.raises(RuntimeError, match="sink failed"):
        Runner._transfer(Ctx(), source, sink)  # type: ignore[arg-type]
    assert copy_threads() == []
    # The read stopped at the queue's bound, not at the end of the source, and its
    # generator was closed (a connector's cleanup runs).
    assert source.closed
    assert source.produced <= 3 + runner.QUEUE_BLOCKS + 1 < 1000


def test_transfer__a_stop_mid_copy_ends_both_sides() -> None:
    source, sink = Source(1000), Sink()

    class StopAfter(Ctx):
        def progress(self, *, rows_read: int = 0, rows_written: int = 0) -> None:
            self.stop = self.rows_read >= 5
            super().progress(rows_read=rows_read, rows_written=rows_written)

    with pytest.raises(Stopped):
        Runner._transfer(StopAfter(), source, sink)  # type: ignore[arg-type]
    assert copy_threads() == []
    assert source.closed and source.produced < 1000


def test_pump__holds_at_most_its_queue_plus_two_blocks() -> None:
    """A slow sink: the reader runs ahead by the queue and one block in hand, no more."""
    source = Source(40)
    ahead: list[int] = []
    consumed = 0
    for _ in CopyPump(source.copy_chunks("binary"), blocks=3):
        consumed += 1
        # Wait until the reader is as far ahead as it can get (or done), then look.
        wait_until(
            lambda c=consumed: source.produced - c >= 3 + 1 or source.produced == 40,
            "the reader to fill the queue",
        )
        ahead.append(source.produced - consumed)
    assert consumed == 40
    # Reached and never passed: the queue's 3 blocks and the one waiting to go in.
    assert max(ahead) == 3 + 1
    assert copy_threads() == []


def test_pump__a_read_stuck_on_its_server_is_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sink failed while the source waits on its server: the pump interrupts the read
    (a cancel request, for PostgreSQL) instead of waiting for the source's next row."""
    monkeypatch.setattr(runner, "PUMP_JOIN_SECONDS", 0.05)
    interrupted = threading.Event()

    def chunks() -> Iterator[tuple[bytes, int]]:
        yield b"first", 1
        # Blocked "in the server" until interrupted, as a COPY waiting on a socket.
        if not interrupted.wait(30):
            raise AssertionError("never interrupted")
        raise RuntimeError("canceling statement due to user request")

    pump = CopyPump(chunks(), interrupt=interrupted.set)
    with pytest.raises(RuntimeError, match="sink failed"):
        for _ in pump:
            raise RuntimeError("sink failed")
    assert interrupted.is_set()
    assert not pump.thread.is_alive()


# --- the source and the sink opened at once -------------------------------------------------
class Opened:
    def __init__(self, log: list[str], name: str, columns: list[Column] | None = None) -> None:
        self.log = log
        self.name = name
        self.columns = columns if columns is not None else [Column("id", "bigint")]


def connector(name: str, log: list[str], *, fail: bool = False, early: bool = False) -> Any:
    class Fake:
        open_before_columns = early

        @staticmethod
        @contextlib.contextmanager
        def open_reader(config: Any, spec: Any, ctx: Any) -> Iterator[Opened]:
            log.append(f"open {name}")
            if fail:
                raise RuntimeError(f"{name} failed to open")
            try:
                yield Opened(log, name)
            finally:
                log.append(f"close {name}")

        @staticmethod
        @contextlib.contextmanager
        def open_writer(config: Any, spec: Any, ctx: Any, columns: list[Column]) -> Iterator[Any]:
            log.append(f"open {name}")
            if fail:
                raise RuntimeError(f"{name} failed to open")
            try:
                yield Opened(log, name, columns)
            finally:
                log.append(f"close {name}")

    return Fake


@pytest.mark.django_db
@pytest.mark.parametrize("early", [True, False])
def test_open_both__the_writer_gets_the_readers_columns_and_closes_first(early: bool) -> None:
    log: list[str] = []
    with contextlib.ExitStack() as stack:
        reader, writer = _open_both(
            stack,
            connector("source", log),
            connector("sink", log, early=early),
            ({}, {}),
            ({}, {}),
            Ctx(),  # type: ignore[arg-type]
        )
        assert writer.columns == reader.columns == [Column("id", "bigint")]
    assert sorted(log[:2]) == ["open sink", "open source"]
    assert log[2:] == ["close sink", "close source"]


@pytest.mark.django_db
@pytest.mark.parametrize("early", [True, False])
def test_open_both__a_source_that_fails_closes_the_sink_it_opened(early: bool) -> None:
    log: list[str] = []
    with pytest.raises(RuntimeError, match="source failed"), contextlib.ExitStack() as stack:
        _open_both(
            stack,
            connector("source", log, fail=True),
            connector("sink", log, early=early),
            ({}, {}),
            ({}, {}),
            Ctx(),  # type: ignore[arg-type]
        )
    # Opened at once, the sink was opened and is closed; opened after, it never was.
    assert sorted(log) == (["close sink", "open sink", "open source"] if early else ["open source"])
    assert [t for t in threading.enumerate() if t.name == "dispatch-open-sink"] == []


@pytest.mark.django_db
def test_open_both__a_sink_that_fails_closes_the_source() -> None:
    log: list[str] = []
    with pytest.raises(RuntimeError, match="sink failed"), contextlib.ExitStack() as stack:
        _open_both(
            stack,
            connector("source", log),
            connector("sink", log, fail=True, early=True),
            ({}, {}),
            ({}, {}),
            Ctx(),  # type: ignore[arg-type]
        )
    assert sorted(log) == ["close source", "open sink", "open source"]
