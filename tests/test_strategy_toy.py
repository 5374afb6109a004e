"""A new strategy is one file plus one registry line: a toy written to a temporary module and added to
`registry.STRATEGIES` becomes a valid `parallel.data` value, is built and predicted by the dry run, holds
memory by the default `held_memory`, is a word of `jaxpar plan --strategy` and a data implementation of the
planner's space."""
import sys

import pytest

from jaxpar.config import ConfigError, apply_overrides, load_config
from jaxpar.dryrun import dryrun
from jaxpar.model.counting import ModelShape
from jaxpar.model.transformer import ModelConfig
from jaxpar.parallel import registry
from jaxpar.parallel.auto import predict as auto_predict
from jaxpar.parallel.memory import config_memory
from jaxpar.plan.space import enumerate_candidates
from jaxpar.plan.strategy import parse_strategy

MODULE = "jaxpar_toy_strategy"
TOY = '''"""A toy: the automatic step under a new `parallel.data` name; its theory counts every flow twice, so a
test can tell whose prediction the dry run printed."""
import dataclasses

from jaxpar.parallel.auto import AutoStrategy
from jaxpar.parallel.auto import predict as auto_predict


class ToyStrategy(AutoStrategy):
    RUNS = {"data": ("toy",)}

    @staticmethod
    def predict(shape, cand, global_batch, seq_len, platform):
        auto = auto_predict(shape, cand, global_batch, seq_len, platform)
        return dataclasses.replace(auto, flows=[dataclasses.replace(f, bytes=2 * f.bytes) for f in auto.flows])
'''


def tiny(*overrides):
    config = load_config("configs/test.py")
    apply_overrides(config, ["model.vocab_size=512", "model.layers=1", "data.seq_len=16", "mesh.data=8", *overrides])
    return config


@pytest.fixture
def toy(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(TOY)                                  # the one file
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "STRATEGIES", (*registry.STRATEGIES, f"{MODULE}:ToyStrategy"))   # the one line
    yield
    sys.modules.pop(MODULE, None)


def test_unregistered_toy_is_refused_naming_the_field():
    with pytest.raises(ConfigError) as err:
        registry.select(tiny("parallel.data=toy"), {"data": 8})
    assert err.value.field == "parallel.data" and "toy" in str(err.value)


def test_a_toy_strategy_is_one_file_and_one_registry_line(toy):
    config = tiny("parallel.data=toy")
    sizes = {"data": 8}
    assert "toy" in registry.implementations()["data"]
    assert registry.select(config, sizes).__name__ == "ToyStrategy"

    report = dryrun(config, "cpu")                                     # built, compiled and predicted
    model_cfg = ModelConfig.from_config(config.model, 512)
    shape, cand, batch, seq, platform = registry.workload(config, model_cfg, sizes, "cpu")
    auto = sum(f.bytes for f in auto_predict(shape, cand, batch, seq, platform).flows)
    assert auto > 0
    assert report["collectives"]["predicted_total_bytes"] == pytest.approx(2 * auto)     # the toy's theory
    auto_memory = config_memory(tiny(), model_cfg, sizes, "cpu")          # the default held_memory: auto's bytes
    assert report["memory"]["predicted"]["total"] == pytest.approx(auto_memory.total)

    parsed = parse_strategy("toy=8 m=1 remat=full fp32 dot", devices=8, platform="cpu")
    assert (parsed.data, parsed.data_impl) == (8, "toy")
    assert parse_strategy(parsed.label(), platform="cpu") == parsed
    space = enumerate_candidates(ModelShape(model_cfg), 8, config.train.batch_size)
    assert any(c.data_impl == "toy" and c.data == 8 for c in space)
