"""The preemption agreement's reach into JAX (train/agreement.py), in one process, in milliseconds.

The agreement uses JAX's private client of the coordinator (no public API offers it). A JAX that moved or
changed it must stop a multi-process `train` before its first step with one line naming what is missing, not
with an AttributeError deep in a step. The two-process agreement itself is tests/test_launch.py's; here the
protocol runs between two threads on an in-memory store that offers only the operations the module declares.
"""
import importlib
import sys
import threading
from types import SimpleNamespace

import jax
import pytest
from ops_helpers import TINY

from jaxpar.cli import main
from jaxpar.train import agreement
from jaxpar.train.agreement import KEY_VALUE_OPERATIONS, JobAgreement, KeyValueStoreMissing

DISTRIBUTED = "jax._src.distributed"


class MemoryStore:
    """The coordinator's key-value store in memory, with exactly the operations in KEY_VALUE_OPERATIONS. The thread
    named `last` adds to a counter only once another thread has: it completes every count."""

    def __init__(self, last: str = ""):
        self.values: dict[str, str] = {}
        self.changed = threading.Condition()
        self.last = last

    def key_value_increment(self, key, increment):
        with self.changed:
            if threading.current_thread().name == self.last:
                self.changed.wait_for(lambda: key in self.values, 30)
            total = int(self.values.get(key, "0")) + increment
            self.values[key] = str(total)
            self.changed.notify_all()
            return total

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.changed:
            assert allow_overwrite or key not in self.values, key
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise RuntimeError("DEADLINE_EXCEEDED")
            return self.values[key]

    def key_value_try_get(self, key):
        with self.changed:
            if key not in self.values:
                raise RuntimeError("NOT_FOUND")
            return self.values[key]

    def key_value_delete(self, key):
        with self.changed:
            self.values.pop(key, None)


def with_client(monkeypatch, client) -> None:
    """JAX's distributed state, as agreement.py reads it, holding `client`."""
    monkeypatch.setattr(importlib.import_module(DISTRIBUTED), "global_state", SimpleNamespace(client=client))


@pytest.mark.parametrize("last", ["p0", "p1"])
def test_the_agreement_answers_the_same_on_both_processes_with_only_its_declared_operations(monkeypatch, last):
    """Process 1 alone notices, at call 2; the process that completes each count (and publishes the verdict) is
    the one that noticed (p1) or the other (p0)."""
    store = MemoryStore(last)
    assert sorted(name for name in vars(MemoryStore) if name.startswith(("key", "blocking"))) == sorted(
        KEY_VALUE_OPERATIONS)
    with_client(monkeypatch, store)
    answers: dict[int, list[bool]] = {}

    def process(index):
        job = JobAgreement(2)
        answers[index] = [job.any_notice(mine=index == 1 and call == 2) for call in (1, 2, 3)]

    threads = [threading.Thread(target=process, args=(i,), name=f"p{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert answers == {0: [False, True, False], 1: [False, True, False]}
    assert sorted(store.values) == ["jaxpar/preemption/count/3", "jaxpar/preemption/verdict/3"]   # 1, 2 deleted


@pytest.mark.parametrize("jax_lacks, named", [
    ("the module", DISTRIBUTED),
    ("the state", f"{DISTRIBUTED}.global_state"),
    ("the client", f"{DISTRIBUTED}.global_state.client"),
    ("an operation", f"{DISTRIBUTED}.global_state.client.key_value_increment"),
])
def test_a_jax_without_the_coordinators_store_is_refused_in_one_line_naming_what_is_missing(
        monkeypatch, jax_lacks, named):
    if jax_lacks == "the module":
        monkeypatch.setitem(sys.modules, DISTRIBUTED, None)   # importing it raises ImportError
    elif jax_lacks == "the state":
        monkeypatch.delattr(importlib.import_module(DISTRIBUTED), "global_state")
    elif jax_lacks == "the client":
        monkeypatch.setattr(importlib.import_module(DISTRIBUTED), "global_state", SimpleNamespace())
    else:
        monkeypatch.delattr(MemoryStore, "key_value_increment")
        with_client(monkeypatch, MemoryStore())
    with pytest.raises(KeyValueStoreMissing) as refused:
        JobAgreement(2)   # at construction, not at the first call
    message = str(refused.value)
    assert f"lacks {named} " in message and "\n" not in message, message
    assert f"({jax.__version__})" in message


def test_a_multi_process_train_on_such_a_jax_stops_before_its_first_step_with_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, DISTRIBUTED, None)
    monkeypatch.setattr(jax, "process_count", lambda: 2)   # a job: the run takes the agreement
    code = main(["train", *TINY, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == KeyValueStoreMissing.exit_code == 1, err
    assert len(err) == 1 and err[0].startswith("the preemption agreement needs") and DISTRIBUTED in err[0], err
    assert not (tmp_path / "run").exists()


def test_outside_a_job_the_client_is_refused_as_before(monkeypatch):
    with_client(monkeypatch, None)
    with pytest.raises(RuntimeError, match="not in a multi-process job"):
        agreement._client()
