"""The planner's overlap per strategy and axis comes from the recorded compiled schedules (plan/overlap.py)."""
import pytest

from jaxpar.config import load_config
from jaxpar.model.counting import ModelShape
from jaxpar.parallel.theory import Candidate
from jaxpar.plan import overlap
from jaxpar.plan.fleet import gpu_cluster
from jaxpar.plan.steptime import GPU_CALIBRATION, Calibration, step_time


def seven_b():
    return ModelShape.from_config(load_config("configs/arabic_7b.py"))


def test_recorded_fractions_cover_the_7b_layouts():
    table = dict(overlap.measured())
    for key in (("fsdp=auto", "fsdp"), ("fsdp=auto tensor=auto", "tensor"), ("fsdp=auto tensor=auto", "fsdp"),
                ("data=zero3", "data")):
        assert 0.0 <= table[key] <= 1.0, key
    assert GPU_CALIBRATION.measured == overlap.measured()


@pytest.mark.parametrize("cand, strategy, axis", [(Candidate(fsdp=64), "fsdp=auto", "fsdp"),
                                                  (Candidate(fsdp=8, tensor=8), "fsdp=auto tensor=auto", "tensor"),
                                                  (Candidate(data=64, data_impl="zero3"), "data=zero3", "data")])
def test_step_time_exposes_what_the_schedule_did_not_hide(cand, strategy, axis):
    cluster = gpu_cluster("h100", 8, 8)
    t = step_time(seven_b(), cand, cluster, 256, 4096, calibration=GPU_CALIBRATION)
    fraction = overlap.hidden_fraction(GPU_CALIBRATION.measured, strategy, axis)
    assert t.exposed_s[axis] == pytest.approx(t.comm_s[axis] * (1 - fraction))
    assumed = step_time(seven_b(), cand, cluster, 256, 4096, calibration=Calibration())   # no measurements
    assert assumed.exposed_s[axis] != pytest.approx(t.exposed_s[axis])


HAND_TP = dict(data=8, tensor=8, tensor_impl="manual", sequence=True)


def test_the_whole_layout_picks_the_figure():
    """Hand-written TP, collective matmul and ZeRO-3 prefetch each get their own recorded figure (not XLA's)."""
    table = GPU_CALIBRATION.measured
    cases = {Candidate(**HAND_TP): "data=auto tensor=manual sequence",
             Candidate(**HAND_TP, tensor_overlap="collective_matmul"):
                 "data=auto tensor=manual sequence tensor_overlap=collective_matmul",
             Candidate(data=64, data_impl="zero3", prefetch=True): "data=zero3 prefetch"}
    for cand, key in cases.items():
        assert overlap.layout_key(cand) == key
    hand = overlap.hidden_fraction(table, overlap.layout_key(Candidate(**HAND_TP)), "tensor")
    cm = overlap.hidden_fraction(table, overlap.layout_key(Candidate(**HAND_TP, tensor_overlap="collective_matmul")),
                                 "tensor")
    xla = overlap.hidden_fraction(table, "fsdp=auto tensor=auto", "tensor")
    assert len({hand, cm, xla}) == 3
    # fallback: the closest recorded part of the layout, never a technique the layout does not use
    assert overlap.hidden_fraction(table, "data=auto fsdp=auto", "fsdp") == dict(table)[("fsdp=auto", "fsdp")]
    assert overlap.hidden_fraction(table, "data=zero3 prefetch buckets=2", "data") == \
        dict(table)[("data=zero3 prefetch", "data")]
    unrecorded = "data=auto tensor=manual sequence tensor_overlap=unrecorded"
    assert overlap.hidden_fraction(table, unrecorded, "tensor") == hand
    assert overlap.hidden_fraction(table, "data=auto fsdp=auto", "data") is None


def test_the_dry_runs_step_changes_with_collective_matmul():
    """`jaxpar dryrun --target h100`'s headline step (dryrun.calibrated_step) for hand-written TP+SP on 64 H100s:
    collective matmul hides more of the tensor axis, so the predicted step is shorter (it used to be the same)."""
    from jaxpar.config import apply_overrides
    from jaxpar.dryrun import calibrated_step
    machine = {"platform": "gpu", "target": "h100", "hosts": 8, "gpus_per_host": 8}
    sizes = {"data": 8, "fsdp": 1, "tensor": 8, "pipe": 1, "expert": 1}
    steps = {}
    for mode in ("none", "collective_matmul"):
        config = load_config("configs/arabic_7b.py")
        apply_overrides(config, ["mesh.fsdp=1", "mesh.data=8", "mesh.tensor=8", "parallel.tensor=manual",
                                 "parallel.sequence=true", f"parallel.tensor_overlap={mode}"])
        steps[mode] = calibrated_step(config, sizes, 32000, machine, 64)["step_s"]
    assert steps["collective_matmul"] < steps["none"]
