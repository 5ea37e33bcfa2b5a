"""A job's processes watching each other: a frozen or vanished peer ends the job in
one line, instead of a C++ abort a minute later.

A process that dies makes the others' next collective fail at once (its sockets
close): the run then stops in one line (``trainer.training.stopping``). A process
that freezes (``SIGSTOP``, a hung host, a host lost from the network without a
reset) leaves the others waiting inside a collective, where no Python runs; JAX's
coordination service notices its missing heartbeats and aborts every process
(``Terminating process because the JAX distributed service detected fatal errors``,
rc -6), leaving the work directory marked ``running``.

So every process of a job publishes a counter in the coordination service's
key-value store every ``timeout / 6`` seconds (:class:`PeerWatch`), from a thread
that runs whatever the main thread waits for, and watches the others'. A peer whose
counter has not moved for ``timeout`` seconds, or a coordinator (process 0) that has
not answered for that long, is taken for lost: the watching process says so in one
``error:`` line naming it and what this process was doing, runs the run's
stop-now callbacks (the save in flight abandoned, the lock released, ``summary.json``
written) and exits with status 1. A process that leaves in order says so first, so
that its silence afterwards is not taken for a loss.

The timeouts, set together by ``--heartbeat_timeout`` (:func:`runtime_timeouts`):
this watch's is the flag's; JAX's own heartbeat timeout, the backstop, is twice
that; and a leaving process waits at most :data:`SHUTDOWN_TIMEOUT_S` at JAX's
shutdown barrier for the others.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from trainer import console

_PREFIX = "wus/alive/"
_LEFT = "left"
# A process leaving waits at most this long at JAX's shutdown barrier for the others
# (JAX's default is 300 s: a job whose peer died would linger five minutes).
SHUTDOWN_TIMEOUT_S = 30


def runtime_timeouts(heartbeat_timeout_s: int) -> dict[str, int]:
    """JAX's distributed-runtime timeouts for a watch of ``heartbeat_timeout_s``: its
    own heartbeat timeout a backstop behind this watch (twice as long), and the
    shutdown barrier's."""
    return {
        "heartbeat_timeout_seconds": 2 * heartbeat_timeout_s,
        "shutdown_timeout_seconds": SHUTDOWN_TIMEOUT_S,
    }


class PeerWatch:
    """Publishes this process's counter and watches the others' (module docstring).

    Args:
      client: JAX's distributed-runtime client (key-value store of the coordinator).
      process_id: this process.
      num_processes: processes in the job.
      timeout_s: a peer silent this long is lost.
      on_lost: ``(message) -> None``, called once from a thread when a peer is lost;
        it must end the process.
    """

    def __init__(
        self,
        client,
        process_id: int,
        num_processes: int,
        timeout_s: float,
        on_lost: Callable[[str], None],
    ):
        self._client, self._id, self._n = client, process_id, num_processes
        self._timeout, self._on_lost = timeout_s, on_lost
        self._stopped = threading.Event()
        now = time.monotonic()
        self._answered = now  # when the coordinator last answered
        self._heard = dict.fromkeys(range(num_processes), (None, now))  # counter, when it moved
        self._left: set[int] = set()
        self._threads = [
            threading.Thread(target=self._beat, name="peer-beat", daemon=True),
            threading.Thread(target=self._watch, name="peer-watch", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _beat(self) -> None:
        counter = 0
        while not self._stopped.wait(self._timeout / 6):
            counter += 1
            try:
                self._client.key_value_set(f"{_PREFIX}{self._id}", str(counter), True)
                seen = dict(self._client.key_value_dir_get(_PREFIX))
            except Exception:  # noqa: BLE001  (the coordinator is gone or leaving: the watch says)
                continue
            now = time.monotonic()
            self._answered = now
            for key, value in seen.items():
                peer = int(key.rsplit("/", 1)[-1])
                if value == _LEFT:
                    self._left.add(peer)
                elif self._heard.get(peer, (None, now))[0] != value:
                    self._heard[peer] = (value, now)

    def _watch(self) -> None:
        last = time.monotonic()
        while not self._stopped.wait(1.0):
            now = time.monotonic()
            if now - last > self._timeout / 2:
                # This process itself stood still (stopped, or starved of CPU): the others'
                # silence meanwhile is not theirs. Start the count again.
                self._answered = now
                self._heard = {peer: (value, now) for peer, (value, _) in self._heard.items()}
            last = now
            if self._id != 0 and now - self._answered > self._timeout:
                return self._lost(0, now - self._answered, "the coordinator of the job")
            for peer, (_, moved) in self._heard.items():
                if peer != self._id and peer not in self._left and now - moved > self._timeout:
                    return self._lost(peer, now - moved, "")
        return None

    def _lost(self, peer: int, silent_s: float, role: str) -> None:
        if self._stopped.is_set():
            return
        doing = console.activity()
        who = f"process {peer} of {self._n}" + (f" ({role})" if role else "")
        self._on_lost(
            f"{who} stopped answering: nothing from it for {silent_s:.0f}s "
            f"(--heartbeat_timeout={self._timeout:g}: frozen, or its host is gone) while "
            f"process {self._id} was {doing}; the job stops: restart it to resume from the "
            "newest checkpoint"
        )

    def leave(self) -> None:
        """Stops watching and tells the others this process leaves in order."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=self._timeout)
        # The coordinator may have left first: then nobody is watching.
        with contextlib.suppress(Exception):
            self._client.key_value_set(f"{_PREFIX}{self._id}", _LEFT, True)


def start(timeout_s: float, on_lost: Callable[[str], None]) -> PeerWatch | None:
    """Watches the peers of this process's job (after ``jax.distributed.initialize``);
    None for a lone process."""
    import jax  # noqa: PLC0415  (after the runtime started)

    from trainer import jax_internals  # noqa: PLC0415  (imports JAX)

    if jax.process_count() == 1:
        return None
    client = jax_internals.private("distributed runtime client")
    return PeerWatch(client, jax.process_index(), jax.process_count(), timeout_s, on_lost)
