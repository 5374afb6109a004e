"""A strategy on a mesh axis of its own is one file (tests/replica_axis.py) plus one registry line: with the line the
axis is a config field, a mesh axis, a `--strategy` word, a dry-run row and part of the planner's space; without
it `mesh.replica` is an unknown field."""

import pytest
from replica_axis import AXIS, ReplicaStrategy

from jaxpar import strategies
from jaxpar.config import ConfigError, apply_overrides, config_from_dict, load_config, to_json
from jaxpar.model.counting import ModelShape
from jaxpar.parallel import registry
from jaxpar.plan.fleet import gpu_cluster
from jaxpar.plan.planner import plan
from jaxpar.plan.space import enumerate_candidates
from jaxpar.plan.strategy import parse_strategy

CONFIG = "configs/test.py"
LINE = strategies.NewAxis(AXIS, ReplicaStrategy)


@pytest.fixture
def replica(monkeypatch):
    """The one registry line."""
    monkeypatch.setattr(strategies, "STRATEGIES", (*strategies.STRATEGIES, LINE))


def small_config(*overrides):
    c = load_config(CONFIG)
    apply_overrides(c, ["model.vocab_size=512", *overrides])
    return c


def test_without_the_line_the_axis_is_unknown(capsys):
    """`--set mesh.replica=2` is refused in one line naming the field, exit 2."""
    from jaxpar.cli import main
    assert main(["plan", "--config", CONFIG, "--set", "mesh.replica=2", "--tokens", "1e9"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: mesh.replica: unknown config field; valid here: context, data, expert, fsdp, pipe, tensor"]


def test_the_line_makes_config_fields_that_round_trip(replica):
    c = small_config("mesh.replica=2", "parallel.replica=mirror", "mesh.data=4")
    assert config_from_dict(c.to_dict()).to_dict() == c.to_dict() and '"replica": "mirror"' in to_json(c)
    assert strategies.mesh_axes()[0] == AXIS and load_config(CONFIG).mesh.replica == 1
    assert registry.implementations()[AXIS] == ("auto", "mirror")
    with pytest.raises(ConfigError, match=r"^parallel\.replica: is 'auto' but mesh\.replica=2; choose one of mirror"):
        registry.select(small_config("mesh.replica=2", "mesh.data=4"), {"data": 4, "fsdp": 1, "pipe": 1, "expert": 1,
                                                                         "context": 1, "tensor": 1, AXIS: 2})


def test_the_axis_is_a_strategy_word(replica):
    """`replica=N` means its strategy's first implementation, `mirror=N` names it; the label parses back."""
    cand = parse_strategy("replica=2 data=4 m=2 remat=full fp32 dot", devices=8, platform="cpu")
    assert cand.added == ((AXIS, 2, "mirror"),) and cand.impls[AXIS] == "mirror" and cand.devices == 8
    assert parse_strategy("mirror=2 data=4 m=2 remat=full fp32 dot", platform="cpu") == cand
    assert parse_strategy(cand.label(), platform="cpu") == cand
    assert cand.label().startswith("mirror=2 data=4 ")


def test_the_planner_enumerates_and_ranks_the_axis(replica):
    shape = ModelShape.from_config(small_config())
    space = enumerate_candidates(shape, 8, 16, remats=("full",), precisions=("bfloat16",), attentions=("flash",))
    mirrored = [c for c in space if c.added]
    assert {c.sizes[AXIS] for c in mirrored} == {2, 4, 8} and all(c.devices == 8 for c in mirrored)
    assert all(c.impls[AXIS] == "mirror" and c.data_impl == "auto" and c.pipe == 1 for c in mirrored)
    p = plan(shape, gpu_cluster("h100", 1, 8), global_batch=16, seq_len=32, tokens=1e9, candidates=mirrored)
    best = p.ranked[0]
    predicted = ReplicaStrategy.predict(shape, best.cand, 16, 32, "gpu").bytes_by_axis()[AXIS]
    assert best.comm_bytes[AXIS] == predicted > 0 and best.time.comm_s[AXIS] > 0


def test_the_dry_run_shows_the_axis_and_its_collective(replica):
    """The compiled program's all-reduce over `replica` is in the report beside the toy's prediction (2(R-1)/R·4·Ψ,
    R = 2), and the report's step time is the planner's for that strategy (tests/test_strategy_theory.py's toy on
    an existing axis goes through the same registry calls)."""
    from jaxpar.dryrun import dryrun, markdown_report
    from jaxpar.measure.hardware import host_matmul_peak, probe_host
    from jaxpar.plan.fleet import cpu_cluster
    from jaxpar.plan.planner import predict_config
    from jaxpar.plan.steptime import Calibration
    c = small_config("mesh.replica=2", "parallel.replica=mirror", "mesh.data=4", "model.layers=1")
    r = dryrun(c, "cpu")
    assert r["mesh"][AXIS] == 2
    row = r["collectives"]["by_axis"][AXIS]
    assert row["predicted_bytes"] == 4 * ModelShape.from_config(c).params
    assert row["bytes"] == pytest.approx(row["predicted_bytes"], rel=0.01)
    host = probe_host()
    flops = host_matmul_peak(8)[0]     # the kept probe, as the dry run reads it (another process may have kept it)
    expected = predict_config(c, r["mesh"], c.model.vocab_size, cpu_cluster(8, {}, flops, host.hbm_bw,
                                                                             host.hbm_bytes or 16e9),
                              Calibration(compute=1.0, overlap=0.0, memory=1.0, step_overhead_s=0.0,
                                          layer_overhead_s=0.0))
    assert r["time"]["calibrated"]["step_s"] == pytest.approx(expected.total_s)
    assert expected.comm_s[AXIS] > 0
    text = markdown_report(r)
    assert f"| {AXIS} | host memory" in text
    assert "The planner's step model (jaxpar.plan) for these 8 virtual CPU devices:" in text
    assert "Optimistic bound (100% of peak" in text
