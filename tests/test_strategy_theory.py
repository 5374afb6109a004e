"""A strategy owns its prediction: registered with it, a strategy is in the planner's space and `--strategy`'s words
with no other edit (in the dry run's report too: tests/test_new_axis.py, whose toy also adds a mesh axis)."""

import dataclasses

import pytest

from jaxpar import strategies
from jaxpar.config import apply_overrides, load_config
from jaxpar.model.counting import ModelShape
from jaxpar.parallel import registry
from jaxpar.parallel.auto import AutoStrategy
from jaxpar.parallel.memory import memory
from jaxpar.parallel.theory import Candidate, Flow, Prediction, stored_params
from jaxpar.plan.fleet import gpu_cluster
from jaxpar.plan.planner import plan
from jaxpar.plan.space import enumerate_candidates
from jaxpar.plan.strategy import parse_strategy

CONFIG = "configs/test.py"
TOY_BYTES = 123456.0


class ToyStrategy(AutoStrategy):
    """XLA's data parallelism under another name, with a prediction no other strategy makes."""

    RUNS = {"data": ("toy",)}

    @staticmethod
    def predict(shape, cand, global_batch, seq_len, platform):
        return Prediction([Flow("data", "all-reduce", TOY_BYTES * cand.data, 1, False)], stored_params(shape, cand))


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(strategies, "STRATEGIES", (*strategies.STRATEGIES, ToyStrategy))


def test_a_registered_strategy_is_in_the_planners_space(toy):
    c = load_config(CONFIG)
    apply_overrides(c, ["model.vocab_size=512"])
    shape = ModelShape.from_config(c)
    toys = [x for x in enumerate_candidates(shape, 8, 16) if x.data_impl == "toy"]
    assert toys and all(x.data == 8 for x in toys)
    p = plan(shape, gpu_cluster("h100", 1, 8), global_batch=16, seq_len=32, tokens=1e9, candidates=toys[:1])
    assert p.results[0].comm_bytes == {"data": TOY_BYTES * 8}


def test_a_registered_strategy_is_a_plan_word_and_holds_memory_by_default(toy):
    """`jaxpar plan --strategy` takes its words from the registry: `toy=8` is the toy's candidate and its label
    parses back; the memory model asks the toy what it holds (the default `held_memory`: it stores what the
    automatic strategy stores, so it holds the same gradients)."""
    cand = parse_strategy("toy=8 m=2 remat=full fp32 dot", devices=8, platform="cpu")
    assert (cand.data, cand.data_impl) == (8, "toy")
    assert parse_strategy(cand.label(), platform="cpu") == cand
    c = load_config(CONFIG)
    apply_overrides(c, ["model.vocab_size=512"])
    shape = ModelShape.from_config(c)
    assert registry.predict(shape, cand, 16, 32, "cpu").bytes_by_axis() == {"data": TOY_BYTES * 8}
    auto = dataclasses.replace(cand, data_impl="auto")
    assert memory(shape, cand, 16, 32, 80e9, platform="cpu") == memory(shape, auto, 16, 32, 80e9, platform="cpu")


def test_every_registered_strategy_predicts():
    """No registry line without its theory: each strategy answers `predict` for a candidate it runs (the MoE
    exchange needs an MoE model: tests/test_moe_parallel.py holds it against the compiler)."""
    c = load_config(CONFIG)
    apply_overrides(c, ["model.vocab_size=512"])
    shape = ModelShape.from_config(c)
    for cls in registry.registered():
        pipe = {"pipe": 2, "microbatches": 2, "schedule": cls.RUNS["pipe"][0]} if "pipe" in cls.RUNS else {}
        for axis, names in cls.RUNS.items():
            if axis in ("expert", "pipe"):
                cand = Candidate(**pipe) if pipe else None
            else:
                cand = Candidate(**{**pipe, axis: 2, f"{axis}_impl": names[0]})
            if cand is None:
                continue
            prediction = cls.predict(shape, cand, 16, 32, "cpu")
            assert prediction.flows and all(f.bytes > 0 for f in prediction.flows), (cls.__name__, names[0])
