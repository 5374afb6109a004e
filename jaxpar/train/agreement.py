"""Every process of a job learns, at the same call, whether any of them got a preemption notice.

A collective save needs every process at the same step, so "did anyone get a notice?" must have one
answer per call, the same on every process. JAX's own answer (`reached_preemption_sync_point`) was
measured to miss notices: both processes logged the signal and the run went on to its last step. The
answer here goes through the job's coordinator (the distributed runtime's key-value store, which every
process is connected to already; no device, no collective): at its n-th call each process adds 1 (no
notice) or 1 + W (a notice) to a counter named for n, W being the process count plus one; the process
whose addition completes the count (total mod W equals the process count) publishes the verdict for
call n, and every other process waits for it. That process also deletes call n-1's keys: each process
read n-1's verdict before it made call n. Two requests to the coordinator per process per call.

The loop makes call n after it dispatched step n and before it waits for any result of step n, so a
process waiting here has handed its devices everything its peers' steps need: waiting cannot deadlock.
While it waits it also watches for a peer that left at once (a notice while nothing new existed,
`announce_leaving`): with a peer gone there is nothing to save together, and `PeerLeft` is raised.
"""
from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

PREFIX = "jaxpar/preemption/"
LEFT_KEY = PREFIX + "left"   # a process left at once after a notice; its value names it
POLL_MS = 100                # how often a waiting process looks for a peer that left
CLIENT_PATH = "jax._src.distributed.global_state.client"
KEY_VALUE_OPERATIONS = ("key_value_increment", "key_value_set", "blocking_key_value_get", "key_value_try_get",
                        "key_value_delete")   # every operation of the client used here


class PeerLeft(Exception):
    """Another process left the job after a notice before anything new existed; nothing can be saved now."""


class KeyValueStoreMissing(RuntimeError):
    """This JAX does not offer the coordinator's client where `_client` reaches it; the message is one line."""

    exit_code = 1


def _client() -> Any:
    """JAX's client of the job's coordinator, whose key-value store the agreement uses (checked, see below).

    The one private access of jaxpar, here alone: JAX 0.10.2 and 0.11 export no public route to the client or its
    key-value operations (`jax.distributed` offers only initialize, is_initialized and shutdown), and JAX's own
    users of the store (`jax.experimental.multihost_utils`, `jax.experimental.array_serialization`, the examples
    of its fault-tolerance guide) read `jax._src.distributed.global_state.client` as well. Should a JAX release
    move or change it, this raises `KeyValueStoreMissing`, one line naming what is missing, before the first step.
    """
    module = "jax._src.distributed"
    try:
        distributed = importlib.import_module(module)
    except ImportError:
        raise KeyValueStoreMissing(_missing(module)) from None
    if not hasattr(distributed, "global_state"):
        raise KeyValueStoreMissing(_missing(f"{module}.global_state"))
    if not hasattr(distributed.global_state, "client"):
        raise KeyValueStoreMissing(_missing(CLIENT_PATH))
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("not in a multi-process job: jax.distributed is not initialized")
    absent = [f"{CLIENT_PATH}.{op}" for op in KEY_VALUE_OPERATIONS if not callable(getattr(client, op, None))]
    if absent:
        raise KeyValueStoreMissing(_missing(", ".join(absent)))
    return client


def _missing(what: str) -> str:
    jax_version = importlib.metadata.version("jax")   # not `import jax`: that may be what failed
    return (f"the preemption agreement needs the coordinator's key-value store, but this JAX ({jax_version}) "
            f"lacks {what} (JAX 0.10 and 0.11 have it); see jaxpar/train/agreement.py")


def _timed_out(err: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(err) or "Deadline" in str(err)


class JobAgreement:
    """One answer per call, the same on every process: did any process get a notice (see the module)."""

    def __init__(self, process_count: int):
        _client()   # in a job, a JAX without the store fails here, before the first step, not at the first call
        self.processes = process_count
        self.weight = process_count + 1
        self.calls = 0

    def any_notice(self, mine: bool) -> bool:
        """Call n (counted here; every process makes the same calls in the same order): True on every process
        when at least one of them passed `mine=True` to its call n."""
        client = _client()
        self.calls += 1
        count, verdict = f"{PREFIX}count/{self.calls}", f"{PREFIX}verdict/{self.calls}"
        total = client.key_value_increment(count, 1 + self.weight * mine)
        if total % self.weight == self.processes:   # the last to arrive: everyone has, and said whether noticed
            answer = "1" if total >= self.weight else "0"
            client.key_value_set(verdict, answer)
            if self.calls > 1:
                client.key_value_delete(f"{PREFIX}count/{self.calls - 1}")
                client.key_value_delete(f"{PREFIX}verdict/{self.calls - 1}")
            return answer == "1"
        return self._wait(client, verdict) == "1"

    @staticmethod
    def _wait(client: Any, key: str) -> str:
        while True:
            try:
                return client.blocking_key_value_get(key, POLL_MS)
            except Exception as err:   # noqa: BLE001 - jaxlib raises its own runtime error type
                if not _timed_out(err):
                    raise
            if peer_left():
                raise PeerLeft()


def announce_leaving(process_index: int) -> None:
    """Tell every process that this one leaves at once after a notice (nothing new to save)."""
    try:
        _client().key_value_set(LEFT_KEY, str(process_index), allow_overwrite=True)
    except Exception:   # noqa: BLE001 - the coordinator is gone: the peers learn it from their own runtime
        pass


def peer_left() -> bool:
    """Some process of this job announced that it left at once (False when it cannot tell)."""
    try:
        return _client().key_value_try_get(LEFT_KEY) is not None
    except Exception:   # noqa: BLE001 - not set (NOT_FOUND), or no client: nothing known
        return False
