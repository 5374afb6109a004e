"""Unit tests of module 6's pieces: array checksums, the non-finite guard, the goodput ledger."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.cluster.goodput import Goodput
from jaxpar.train.checksum import checksums, mismatches
from jaxpar.train.guard import NonFiniteError, NonFiniteGuard


def test_checksums_do_not_depend_on_the_sharding_and_see_one_changed_element():
    values = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tree = {"w": jnp.asarray(values), "bf": jnp.asarray(values, jnp.bfloat16), "step": jnp.int32(7)}
    sharded = {"w": jax.device_put(values, NamedSharding(mesh, P("a", "b"))),
               "bf": jax.device_put(tree["bf"], NamedSharding(mesh, P(None, "b"))), "step": tree["step"]}
    one_device = {k: jax.device_put(v, jax.devices()[0]) for k, v in tree.items()}
    recorded = checksums(sharded)
    assert checksums(one_device) == recorded and mismatches(one_device, recorded) == []
    for i, j in [(0, 0), (7, 5), (3, 2)]:
        changed = values.copy()
        changed[i, j] = np.nextafter(changed[i, j], np.float32(np.inf))   # the smallest possible change
        assert mismatches({**tree, "w": jnp.asarray(changed)}, recorded) == ["['w']"]
    swapped = values.copy()
    swapped[[0, 1]] = swapped[[1, 0]]                                       # same values, other places
    assert mismatches({**tree, "w": jnp.asarray(swapped)}, recorded) == ["['w']"]


def test_guard_stops_at_the_first_bad_step_or_skips_up_to_the_limit():
    good, bad = {"loss": jnp.float32(2.0), "grad_norm": jnp.float32(1.0)}, {"loss": jnp.float32(np.nan),
                                                                           "grad_norm": jnp.float32(1.0)}
    guard = NonFiniteGuard(0)
    guard.after_step(1, good)
    guard.after_step(2, bad)                                   # checked one step later (no wait on the device)
    with pytest.raises(NonFiniteError, match="loss nan at step 2"):
        guard.after_step(3, good)
    guard = NonFiniteGuard(0)
    guard.after_step(1, bad)
    with pytest.raises(NonFiniteError, match="at step 1"):
        guard.flush()                                          # before a save
    skipping = NonFiniteGuard(2)
    assert skipping.skips and not skipping.is_bad(1, good)
    assert skipping.is_bad(2, bad) and skipping.is_bad(3, {"loss": jnp.float32(1), "grad_norm": jnp.float32(np.inf)})
    with pytest.raises(NonFiniteError, match="after skipping 2 bad step"):
        skipping.is_bad(4, bad)


def test_goodput_ledger_turns_lost_work_into_restart_time(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setenv("JAXPAR_RESTART_COUNT", "0")
    ledger = tmp_path / "goodput.json"
    first = Goodput(ledger, None, write=True, now=lambda: clock[0], start=1000.0)
    first.add("startup_compile", 10)
    first.add("productive", 40)                # steps 1..4
    first.stepped(4)
    first.saved(4)
    first.add("productive", 30)                # steps 5..7, then the process dies
    first.stepped(7)
    clock[0] = 1085.0
    first.flush()
    monkeypatch.setenv("JAXPAR_RESTART_COUNT", "1")
    clock[0] = 1110.0
    second = Goodput(ledger, 4, write=True, now=lambda: clock[0], start=1100.0)   # 15 s after the last flush
    second.add("startup_compile", 10)
    totals = second.flush()
    assert totals["wall_s"] == 110 and totals["restarts"] == 1 and totals["redone_steps"] == 3
    assert totals["productive_s"] == 40                              # steps 5..7 will be done again
    assert totals["badput_s"]["restart"] == 30 + 15                  # their time + the gap before the restart
    assert totals["badput_s"]["startup_compile"] == 20
    assert totals["goodput"] == pytest.approx(40 / 110)
    assert json.loads(ledger.read_text())["timeline"][-1][3] == 1
