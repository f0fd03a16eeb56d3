"""A local TCP server that speaks just enough of the PostgreSQL protocol to ask for a
clear-text password, and records every byte it receives."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from types import TracebackType


class RecordingServer:
    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = int(self.sock.getsockname()[1])
        self.received = bytearray()
        self.connections = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def __enter__(self) -> RecordingServer:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        # shutdown() wakes the blocked accept(); close() alone would not.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _recv(self, conn: socket.socket) -> bytes:
        data = conn.recv(65536)
        with self._lock:
            self.received += data
        return data

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        try:
            with conn:
                while True:
                    data = self._recv(conn)
                    if not data:
                        return
                    code = struct.unpack("!I", data[4:8])[0] if len(data) >= 8 else 0
                    if code in (80877103, 80877104):  # SSLRequest, GSSENCRequest: no
                        conn.sendall(b"N")
                        continue
                    # The startup message: ask for the password in clear text.
                    conn.sendall(b"R" + struct.pack("!II", 8, 3))
                    while self._recv(conn):
                        pass
                    return
        except OSError:
            return

    def got(self, secret: str) -> bool:
        with self._lock:
            return secret.encode() in self.received
