"""What a training run shows and records: a progress bar that moves every step, each step's own time
in metrics.jsonl, an MFU that never reads above 100% with its peak stated, the end-of-run sample's
settings, and a `jaxpar sample` command that pastes and reproduces it. One short run serves them all.
"""
import ast
import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from rich.progress import Progress

from jaxpar import training as loop
from jaxpar.cli import main
from jaxpar.launch import launch
from jaxpar.measure.flops import Throughput
from jaxpar.measure.hardware import Peak
from jaxpar.train.sample import END_OF_RUN

ROOT = Path(__file__).resolve().parent.parent
TOKENS_PER_STEP = 16 * 32          # configs/test.py: batch 16 x seq_len 32
LOW_PEAK = 1e6                     # FLOP/s per device: a probe far below what the run reaches


class RecordingProgress(Progress):
    """The loop's progress bar, recording (completed, ETA) at every update."""

    updates: list = []

    def update(self, task_id, **fields):
        super().update(task_id, **fields)
        task = self._tasks[task_id]
        RecordingProgress.updates.append((task.completed, task.time_remaining))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """8 steps of configs/test.py, logging every 4th, with a CPU peak probe that read far too low."""
    run_dir = tmp_path_factory.mktemp("runs") / "run"
    low = Peak(LOW_PEAK, "a probe that ran while the host was busy (test)", measured=True)
    RecordingProgress.updates = []
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as out:
        patch.setattr(loop, "run_peak", lambda dtype: low)
        patch.setattr(loop, "Progress", RecordingProgress)
        assert main(["train", "--config", "configs/test.py", "--run-dir", str(run_dir),
                     "--set", "train.log_every=4"]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "loss" in r}
    return run_dir, out.getvalue(), steps, list(RecordingProgress.updates)


def test_progress_bar_moves_every_step_with_an_eta(run):
    _, _, _, updates = run
    completed = [c for c, _ in updates]
    assert sorted(set(completed)) == list(range(1, 9))                      # every step, not every 4th
    assert completed == sorted(completed)                                   # never backwards
    etas = [eta for c, eta in updates if 3 <= c < 8]
    assert etas and all(eta is not None for eta in etas)                    # a real ETA, not -:--:--


def test_metrics_record_each_steps_own_time(run):
    _, printed, steps, _ = run
    assert sorted(steps) == list(range(1, 9)) and steps[1]["step_time_s"] is None   # step 1 compiles
    times = [steps[s]["step_time_s"] for s in range(2, 9)]
    assert all(t > 0 for t in times)
    assert len(set(times[:3])) == 3 and len(set(times[3:])) == 4            # not one interval's average copied
    for s in range(2, 9):
        assert steps[s]["tokens_per_s"] * steps[s]["step_time_s"] == pytest.approx(TOKENS_PER_STEP, rel=1e-9)
    # the console averages the interval's own step times: steps 5-8 at step 8
    line = next(line for line in printed.splitlines() if line.startswith("step     8/8"))
    mean_ms = float(np.mean(times[3:])) * 1e3
    assert f"  {mean_ms:.0f} ms/step" in line


def test_metrics_time_is_each_steps_end(run):
    """`time` is when the step finished, not when its burst was written: within a burst (steps 5-8) the times are
    apart by about the steps' own times (written at once they were microseconds apart)."""
    _, _, steps, _ = run
    ends = [steps[s]["time"] for s in range(1, 9)]
    assert all(a < b for a, b in zip(ends, ends[1:]))
    for s in range(6, 9):
        assert ends[s - 1] - ends[s - 2] > 0.5 * steps[s]["step_time_s"], s


def test_mfu_never_above_100_percent_and_the_peak_is_stated(run):
    run_dir, printed, steps, _ = run
    mfus = [steps[s]["mfu"] for s in range(2, 9)]
    assert all(0 < m <= 1.0 for m in mfus) and max(mfus) == 1.0            # the probe was beaten: raised, stated
    assert all(float(m) <= 100.0 for m in re.findall(r"MFU ([\d.]+)%", printed))
    assert "above the measured peak 0.001 GFLOP/s (the probe ran while the host was busier)" in printed
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["peak_flops_per_device"] > LOW_PEAK
    assert "a probe that ran while the host was busy (test)" in summary["peak_source"]
    assert summary["peak_source"] in printed                                # the final peak, stated in the output
    # each step against the peak of its time: the fastest step so far sets it
    for s in range(2, 9):
        fastest_so_far = min(steps[r]["step_time_s"] for r in range(2, s + 1))
        assert steps[s]["mfu"] == pytest.approx(fastest_so_far / steps[s]["step_time_s"], rel=1e-9), s


def test_end_of_run_sample_states_its_settings_and_its_command_reproduces_it(run, capsys):
    run_dir, printed, _, _ = run
    summary = json.loads((run_dir / "summary.json").read_text())
    command = next(line for line in printed.splitlines() if line.startswith("sample again: "))
    args = shlex.split(command.removeprefix("sample again: "))
    assert args[:2] == ["jaxpar", "sample"] and args[args.index("--run-dir") + 1] == str(run_dir)
    prompt = args[args.index("--prompt") + 1]
    assert f"sample (temperature 0.8, top-k 20, seed 0): {prompt}{summary['sample']}\n" in printed
    assert main(args[1:]) == 0                                              # pastes: the same sample again
    assert capsys.readouterr().out == f"[step 8] {prompt}{summary['sample']}\n"
    # the README's sample command pastes as it is and samples the way the run did
    readme = (ROOT / "README.md").read_text()
    pasted = next(line for line in readme.splitlines() if line.startswith("jaxpar sample --run-dir "))
    flags = shlex.split(pasted)
    assert flags[3] == "$(ls -td runs/default-* | head -1)"                 # no `<time>` placeholder
    assert float(flags[flags.index("--temperature") + 1]) == END_OF_RUN.temperature
    assert int(flags[flags.index("--top-k") + 1]) == END_OF_RUN.top_k and END_OF_RUN.seed == 0   # --seed's default


@pytest.mark.slow
def test_every_process_reports_the_same_peak_and_step_times(monkeypatch, capsys):
    """On 2 processes each probes its own cores, and all take process 0's peak and step times (the
    MFU gauge of process 1 read 8.3e-07 against 0.016: its probe timed a matmul placed on process 0)."""
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests'}:{ROOT}")
    assert launch(2, 2, ["run"], module="peak_worker", timeout=120) == 0
    reports = dict(re.findall(r"\[p(\d)\] process=\d+ (.*)", capsys.readouterr().out))
    assert sorted(reports) == ["0", "1"]
    fields = {p: dict(re.findall(r"(\w+)=(\[.*?\]|\S+)", text)) for p, text in reports.items()}
    assert fields["0"]["peak"] == fields["1"]["peak"] and fields["0"]["times"] == fields["1"]["times"]
    times = ast.literal_eval(fields["0"]["times"])
    assert times[0] is None and len(times) == 4 and all(t > 0 for t in times[1:])   # the first step compiles
    probes = [float(fields[p]["probe"]) for p in "01"]
    assert max(probes) / min(probes) < 100                                  # both timed their own matmul


def test_a_datasheet_peak_is_never_raised():
    """Above a datasheet peak the FLOP count or the table is wrong: said once, and shown as it is."""
    notices = []
    throughput = Throughput(16e12, TOKENS_PER_STEP, 8, Peak(1e12, "a datasheet", measured=False), notices.append)
    assert throughput.step(2, 1.0)["mfu"] == 2.0 and throughput.step(3, 4.0)["mfu"] == 0.5
    assert throughput.peak == 1e12 and len(notices) == 1 and "FLOP count or the peak table is wrong" in notices[0]
    assert "step 2 ran above it" in throughput.describe()


def test_the_cpu_peak_is_probed_once_per_host_and_kept(tmp_path, monkeypatch):
    """Two runs' MFUs divide by one peak: the first probe is kept; a later, busier probe is not taken;
    JAXPAR_REPROBE_PEAK=1 probes again and keeps the new figure. Each peak line says which it is."""
    import dataclasses

    import jax

    from jaxpar.measure import hardware
    monkeypatch.setenv("JAXPAR_CACHE", str(tmp_path))
    monkeypatch.delenv(hardware.REPROBE_ENV, raising=False)
    probes = iter([63.8e9, 35.8e9, 50e9])
    host = hardware.Accelerator("cpu-host (test)", None, None, 0.0, None, None, None, None, None, "a test probe")
    monkeypatch.setattr(hardware, "probe_host", lambda: dataclasses.replace(host, fp32_flops=next(probes)))
    n = jax.local_device_count()
    first = hardware.run_peak("float32")
    assert first.per_device == 63.8e9 / n and "probed now and kept in" in first.source
    second = hardware.run_peak("float32")                                   # the host is busier now: not probed
    assert second.per_device == 63.8e9 / n and "kept from this host's probe of" in second.source
    assert "JAXPAR_REPROBE_PEAK=1 probes again" in second.source and "a test probe" in second.source
    monkeypatch.setenv(hardware.REPROBE_ENV, "1")
    assert hardware.run_peak("float32").per_device == 35.8e9 / n            # asked for: probed and kept
    monkeypatch.delenv(hardware.REPROBE_ENV)
    assert hardware.run_peak("float32").per_device == 35.8e9 / n
    assert len(list((tmp_path / "host_peak").iterdir())) == 1               # one file per host and device count
