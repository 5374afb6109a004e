"""`jaxpar train --profile START:END` writes a trace and a summary of the ops it saw."""
import json

import pytest

from jaxpar.cli import main
from jaxpar.config import ConfigError
from jaxpar.measure.profile import parse_window, self_times


def test_profile_window_writes_trace_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", "--config", "configs/test.py", "--run-dir", str(run_dir), "--profile", "5:6",
                 "--set", "train.sample_tokens=0"]) == 0
    assert list((run_dir / "profile").rglob("*.xplane.pb"))
    assert list((run_dir / "profile").rglob("perfetto_trace.json.gz"))
    summary = json.loads((run_dir / "profile_summary.json").read_text())
    assert summary["steps"] == 2 and summary["top_ops"]
    assert summary["collective_ms_per_step"] > 0      # data parallel over 8 devices all-reduces gradients
    assert 0 < summary["collective_fraction"] < 1


@pytest.mark.parametrize("text", ["5", "a:b", "0:2", "3:2", "7:99"])
def test_bad_profile_window(text):
    with pytest.raises(ConfigError) as err:
        parse_window(text, steps=8)
    assert err.value.field == "--profile"


def test_self_time_subtracts_nested_events():
    outer = {"name": "all-reduce", "pid": 1, "tid": 1, "ts": 0, "dur": 10}
    inner = {"name": "Rendezvous", "pid": 1, "tid": 1, "ts": 2, "dur": 6}
    after = {"name": "fusion", "pid": 1, "tid": 1, "ts": 12, "dur": 3}
    times = {e["name"]: t for e, t in self_times([outer, inner, after])}
    assert times == {"all-reduce": 4, "Rendezvous": 6, "fusion": 3}
