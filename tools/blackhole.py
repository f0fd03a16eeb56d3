"""A TCP proxy the tests and the fault campaign own, which can turn into a black hole
(the repository site's, never in the package).

Forwarding, it copies bytes both ways between each client and the target. Blackholed, it
keeps every socket open and reads and drops every byte from both sides: no FIN, no RST,
no answer, what a stuck middlebox or a hung server does (the kernel still acknowledges,
so TCP keepalives and `tcp_user_timeout` see a healthy peer). Stalled, it holds every
byte back instead and delivers it, in order, at the heal (a congested or paused path:
requests and answers arrive late, long after their sender gave up). Healed, it forwards
again; connections whose bytes were dropped are left to their owners to notice and
discard.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from typing import Any


class BlackholeProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._blackhole = threading.Event()
        self._stall = threading.Event()
        # Stalled: bytes held for each destination, and pairs whose source closed meanwhile
        # (closed once what they sent is delivered). Touched by the proxy thread only.
        self._held: dict[socket.socket, list[bytes]] = {}
        self._closing: list[tuple[socket.socket, socket.socket]] = []
        self.held_bytes = 0
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.dropped_bytes = 0
        self.accepted = 0
        self._thread = threading.Thread(target=self._loop, name="blackhole-proxy", daemon=True)

    def __enter__(self) -> BlackholeProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._wake_w.send(b"x")
        self._thread.join(5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._wake_w.close()

    def blackhole(self) -> None:
        self._blackhole.set()

    def stall(self) -> None:
        self._stall.set()

    def heal(self) -> None:
        self._blackhole.clear()
        self._stall.clear()
        self._wake_w.send(b"h")  # the proxy thread delivers what a stall held back

    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.5):
                if key.data is None:
                    self._accept()
                elif key.data == "wake":
                    key.fileobj.recv(64)  # type: ignore[union-attr]
                    if not self._stall.is_set():
                        self._deliver_held()
                else:
                    self._pump(key.fileobj, key.data)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        self.accepted += 1
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        for s in (client, upstream):
            s.setblocking(False)
        self._selector.register(client, selectors.EVENT_READ, upstream)
        self._selector.register(upstream, selectors.EVENT_READ, client)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            data = src.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data and self._stall.is_set():
            # Closed while stalled: stop reading it; close the pair once what it sent
            # has been delivered.
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(src)
            self._closing.append((src, dst))
            return
        if not data:
            # One side closed: close both (what a forwarding proxy does).
            for s in (src, dst):
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(s)
                s.close()
            return
        if self._blackhole.is_set():
            self.dropped_bytes += len(data)
            return
        if self._stall.is_set():
            self._held.setdefault(dst, []).append(data)
            self.held_bytes += len(data)
            return
        if self._held or self._closing:
            self._deliver_held()  # healed: what was held goes first, in order
        self._send(dst, data)

    def _send(self, dst: socket.socket, data: bytes) -> None:
        # Bounded: a peer that reads nothing (a paused process) must not freeze the proxy
        # for every other connection.
        try:
            dst.settimeout(5)
            dst.sendall(data)
            dst.setblocking(False)
        except OSError:
            pass

    def _deliver_held(self) -> None:
        held, self._held = self._held, {}
        for dst, parts in held.items():
            self._send(dst, b"".join(parts))
        closing, self._closing = self._closing, []
        for pair in closing:
            for s in pair:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(s)
                s.close()
