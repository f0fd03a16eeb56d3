"""`LOAD DATA LOCAL INFILE` from the writer's own rows, never from a file.

PyMySQL's own handler of the server's LOCAL INFILE request opens whichever file the server
names: a connection with it on would let the server it talks to read the worker's files.
Here the sink's connection (and no other) is a `StreamConnection`: it answers the request
only while the writer is loading, only for the name the writer put in its statement, and
only with the bytes the writer handed it (`load`); any other request is refused with an
empty answer and an error. PyMySQL's internals used: `Connection._read_query_result`,
`MySQLResult._read_load_local_packet`, `LoadLocalPacketWrapper`, `write_packet` (PyMySQL
1.1).
"""

from __future__ import annotations

from typing import Any

from pymysql import connections, err
from pymysql.constants import CR

# The file name in the writer's statement: a fixed word, never a path of this machine.
STREAM_NAME = "dispatch-rows"
PACKET_BYTES = 1 << 20


class RefusedRequest(Exception):  # noqa: N818 - the server asked for what it may not have
    pass


class _StreamResult(connections.MySQLResult):
    def _read_load_local_packet(self, first_packet: Any) -> None:
        conn: StreamConnection = self.connection  # type: ignore[assignment]
        request = connections.LoadLocalPacketWrapper(first_packet)
        name = request.filename.decode("utf-8", "replace") if isinstance(
            request.filename, bytes
        ) else str(request.filename)  # fmt: skip
        data, conn._pending = conn._pending, None
        refused = data is None or name != STREAM_NAME
        try:
            if not refused:
                assert data is not None
                view = memoryview(data)
                size = max(1024, min(conn.max_allowed_packet - 1024, PACKET_BYTES))
                for start in range(0, len(view), size):
                    conn.write_packet(view[start : start + size])
        finally:
            conn.write_packet(b"")  # the end of the data (or nothing, when refused)
            ok_packet = conn._read_packet()
        if refused:
            raise RefusedRequest(
                "the server asked for a local file the writer did not send; refused"
            )
        if not ok_packet.is_ok_packet():
            raise err.OperationalError(CR.CR_COMMANDS_OUT_OF_SYNC, "Commands Out of Sync")
        self._read_ok_packet(ok_packet)


class StreamConnection(connections.Connection):  # type: ignore[misc]
    """A PyMySQL connection whose LOCAL INFILE answers only `load`'s own data."""

    _pending: bytes | None = None

    def _read_query_result(self, unbuffered: bool = False) -> int:
        self._result = None
        result = _StreamResult(self)
        if unbuffered:
            result.init_unbuffered_query()
        else:
            result.read()
        self._result = result
        if result.server_status is not None:
            self.server_status = result.server_status
        return int(result.affected_rows or 0)

    def load(self, cursor: Any, statement: str, data: bytes) -> int:
        """Run `statement` (a LOAD DATA LOCAL INFILE of STREAM_NAME) sending `data`;
        returns the rows loaded."""
        self._pending = data
        try:
            return int(cursor.execute(statement))
        finally:
            self._pending = None
