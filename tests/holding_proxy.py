"""A TCP proxy in front of the real S3 server that can hold one request: the network between a run and its
object store, as it is when the run stalls in the middle of a request.

Every connection is forwarded both ways, byte for byte. `hold(marker)` arms it: the next request whose first
line holds `marker` (bytes, e.g. b"PUT " + part of a key) is neither forwarded nor answered -- the run waits
on it as on a server that does not answer -- until `cut()` resets that connection (what a client sees after
a stall: a request that failed). Requests after it are forwarded again, so a client that sends the request
once more reaches the server.
"""
from __future__ import annotations

import re
import socket
import struct
import threading
from typing import List, Optional

_REQUEST = re.compile(rb"[A-Z]+ \S+ HTTP/")


class HoldingProxy:
    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.target = (host, port)
        self.listener = socket.create_server((host, 0))
        self.endpoint = f"http://{host}:{self.listener.getsockname()[1]}"
        self.held = threading.Event()           # set once the armed request arrived (and is held)
        self.requests: List[bytes] = []         # the first line of every request seen, in order
        self._marker: Optional[bytes] = None
        self._cut = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self, marker: bytes) -> None:
        self.held.clear()
        self._cut.clear()
        with self._lock:
            self._marker = marker

    def cut(self) -> None:
        """Reset the held request's connection."""
        self._cut.set()

    def close(self) -> None:
        self._cut.set()
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
        try:
            while True:
                chunk = client.recv(1 << 16)
                if not chunk:
                    break
                line = chunk.split(b"\r\n", 1)[0]
                if _REQUEST.match(line):
                    self.requests.append(line)
                    with self._lock:
                        armed = self._marker is not None and self._marker in line
                        if armed:
                            self._marker = None
                    if armed:
                        self.held.set()
                        self._cut.wait()
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        break
                upstream.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:
                    s.close()
                except OSError:
                    pass


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
