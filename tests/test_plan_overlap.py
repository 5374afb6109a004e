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
    for key in (("auto", "fsdp"), ("auto+tensor", "tensor"), ("auto+tensor", "fsdp"), ("zero3", "data")):
        assert 0.0 <= table[key] <= 1.0, key
    assert GPU_CALIBRATION.measured == overlap.measured()


@pytest.mark.parametrize("cand, strategy, axis", [(Candidate(fsdp=64), "auto", "fsdp"),
                                                  (Candidate(fsdp=8, tensor=8), "auto+tensor", "tensor"),
                                                  (Candidate(data=64, data_impl="zero3"), "zero3", "data")])
def test_step_time_exposes_what_the_schedule_did_not_hide(cand, strategy, axis):
    cluster = gpu_cluster("h100", 8, 8)
    t = step_time(seven_b(), cand, cluster, 256, 4096, calibration=GPU_CALIBRATION)
    fraction = overlap.hidden_fraction(GPU_CALIBRATION.measured, strategy, axis)
    assert t.exposed_s[axis] == pytest.approx(t.comm_s[axis] * (1 - fraction))
    assumed = step_time(seven_b(), cand, cluster, 256, 4096, calibration=Calibration())   # no measurements
    assert assumed.exposed_s[axis] != pytest.approx(t.exposed_s[axis])
