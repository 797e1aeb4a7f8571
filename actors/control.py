"""The control plane: a `multiprocessing.managers` server hosting the gang's registry.

Actors reach it at startup to fetch their rendezvous (torch.distributed master
address and port, epoch) and to register their pid and host. It listens on a Unix
socket in a private directory by default, or on loopback TCP, and every client
must pass the authkey challenge (HMAC) before a single byte is unpickled.

The server runs in threads of the supervisor's own process, so it adds no process
that could outlive the gang.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from multiprocessing import managers
from typing import Any, Union

Address = Union[str, tuple[str, int]]

logger = logging.getLogger(__name__)


class Registry:
    """What the gang knows about itself: rendezvous values and the actors that registered."""

    def __init__(self, rendezvous: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._rendezvous = dict(rendezvous)
        self._members: dict[int, dict[str, Any]] = {}

    def rendezvous(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._rendezvous)

    def set_rendezvous(self, rendezvous: dict[str, Any]) -> None:
        with self._lock:
            self._rendezvous = dict(rendezvous)
            self._members.clear()

    def register(self, global_rank: int, epoch: int, pid: int, host: str) -> None:
        with self._lock:
            if epoch != self._rendezvous.get("epoch"):
                raise RuntimeError(f"actor of epoch {epoch} tried to join epoch {self._rendezvous.get('epoch')}")
            self._members[global_rank] = {"pid": pid, "host": host, "since": time.time()}

    def members(self) -> dict[int, dict[str, Any]]:
        with self._lock:
            return {rank: dict(info) for rank, info in self._members.items()}


class _ThreadedServer(managers.Server):
    """A manager server that runs in threads and can be stopped (serve_forever cannot)."""

    def start(self) -> None:
        self._closed = False
        self.stop_event = threading.Event()  # serve_client loops until it is set
        self._accepter = threading.Thread(target=self._accept_loop, name="pipeactors-control", daemon=True)
        self._accepter.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self.listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            threading.Thread(target=self.handle_request, args=(conn,), daemon=True).start()

    def stop(self) -> None:
        self._closed = True
        self.stop_event.set()
        # Closing the listening socket alone does not wake accept() on Linux.
        try:
            self.listener._listener._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self._accepter.join(timeout=2.0)


class ControlServer:
    """The authkey-protected manager server of one supervisor."""

    def __init__(self, registry: Registry, address: Address, authkey: bytes) -> None:
        self.registry = registry
        self._server = _ThreadedServer(
            {"registry": (lambda: registry, None, None, None)}, address, authkey, "pickle"
        )
        self.address: Address = self._server.address
        self._server.start()
        logger.debug("control plane listening on %s", self.address)

    def close(self) -> None:
        self._server.stop()


class _ControlClient(managers.BaseManager):
    pass


_ControlClient.register("registry")


def connect_registry(address: Address, authkey: bytes) -> Any:
    """A proxy of the supervisor's Registry; raises AuthenticationError on a wrong authkey."""
    client = _ControlClient(address=address, authkey=authkey)
    client.connect()
    return client.registry()
