"""`jaxpar plan --sweep N` on a real Slurm cluster (scripts/slurm/local-cluster.sh): a job array of 3 CPU
candidates, each training a few steps of the tiny test model, merged by `jaxpar plan collect` into the defence.

Needs slurmctld, slurmd, munge (CI installs them with apt); skipped with the reason otherwise.
"""
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from test_plan import run_cli

from jaxpar.measure.host_allocator import jemalloc_library
from jaxpar.plan.sweep import spearman

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "scripts" / "slurm" / "local-cluster.sh"
MISSING = [b for b in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(b) is None]


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_sweep_records_a_config_its_tasks_can_load(capsys, tmp_path, monkeypatch):
    """Planned outside the checkout with a preset's path: candidates.json names the preset, which an array task
    (another working directory, no Slurm needed for the check) loads."""
    from jaxpar.config import load_config
    (tmp_path / "plan").mkdir()
    monkeypatch.chdir(tmp_path / "plan")
    code, _, err = run_cli(capsys, [
        "plan", "--config", "configs/test.py", "--set", "model.vocab_size=256", "--cpu-devices", "8",
        "--global-batch", "8", "--seq-len", "16", "--tokens", "1e6", "--sweep", "1", "--out", "sweep"])
    assert code == 0, err
    spec = json.loads((tmp_path / "plan" / "sweep" / "candidates.json").read_text())
    monkeypatch.chdir(tmp_path)
    assert spec["config"] == "test" and load_config(spec["config"]).name == "test"


def test_collect_reports_the_tasks_it_can_and_names_the_damaged_ones(capsys, tmp_path):
    """A killed array task leaves `{}` or half a file in results/; the collect used to end in a traceback."""
    out = tmp_path / "sweep"
    (out / "results").mkdir(parents=True)
    strategies = ("data=8", "fsdp=8", "tp=2 data=4", "pipe=2 data=4")
    (out / "candidates.json").write_text(json.dumps({
        "cluster": "8 CPU devices", "global_batch": 8, "seq_len": 16, "steps": 3,
        "candidates": [{"index": i, "strategy": s, "predicted_step_s": 0.1 * (i + 1), "predicted_memory": 1e6}
                       for i, s in enumerate(strategies)]}))
    for i in (0, 1):
        (out / "results" / f"{i}.json").write_text(json.dumps(
            {"index": i, "step_s": 0.2 * (i + 1), "times_s": [0.2 * (i + 1)] * 3, "memory_compiled": 2e6}))
    (out / "results" / "2.json").write_text('{"index": 2, "step_s": 0.')
    (out / "results" / "3.json").write_text("{}")
    code, printed, err = run_cli(capsys, ["plan", "collect", str(out)])
    assert code == 0, err
    assert "over 2 candidates" in printed
    assert ("No result (task failed or still running): tp=2 data=4 (results/2.json is damaged), "
            "pipe=2 data=4 (results/3.json is damaged).") in printed


@pytest.mark.skipif(bool(MISSING), reason=f"Slurm is not installed here (no {', '.join(MISSING)}); "
                    "`scripts/slurm/local-cluster.sh install` installs it (apt, root)")
def test_sweep_runs_as_a_slurm_job_array(capsys, tmp_path):
    out = tmp_path / "sweep"
    code, printed, err = run_cli(capsys, [
        "plan", "--config", "configs/test.py", "--set", "model.vocab_size=256", "--set", "model.layers=1",
        "--cpu-devices", "8", "--global-batch", "8", "--seq-len", "16", "--tokens", "1e6",
        "--sweep", "3", "--steps", "1", "--out", str(out)])     # 3 repeats of 1 step: 3 timed steps per task
    assert code == 0, err
    spec = json.loads((out / "candidates.json").read_text())
    assert len(spec["candidates"]) == 3 and "#SBATCH --array=0-2%1" in (out / "sweep.sbatch").read_text()
    state = tmp_path / "slurm"
    env = {**os.environ, "SLURMCTLD_PORT": str(7000 + 2 * (os.getpid() % 400))}
    started = subprocess.run(["bash", str(CLUSTER), "start", str(state), "8"], capture_output=True, text=True,
                             timeout=60, env=env)
    assert started.returncode == 0, started.stderr
    env["SLURM_CONF"] = str(state / "slurm.conf")
    try:
        job = subprocess.run(["sbatch", "--parsable", str(out / "sweep.sbatch")], env=env, capture_output=True,
                             text=True, timeout=30)
        assert job.returncode == 0, job.stderr
        job_id = job.stdout.strip().split(";")[0]
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and subprocess.run(["squeue", "-h", "-j", job_id], env=env,
                                                             capture_output=True, text=True).stdout.strip():
            time.sleep(1)
        logs = {p.name: p.read_text()[-2000:] for p in (out / "logs").glob("*.out")}
        assert len(list((out / "results").glob("*.json"))) == 3, logs
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(state)], timeout=30, env=env)
    code, printed, err = run_cli(capsys, ["plan", "collect", str(out)])
    assert code == 0, err
    defence = json.loads((out / "defence.json").read_text())
    assert len(defence["rows"]) == 3 and -1 <= defence["spearman"] <= 1
    assert all(len(r["times_s"]) == 3 and len(r["repeats_s"]) == 3 and r["memory_compiled"] > 0
               for r in defence["rows"])
    assert defence["verdict"]["verdict"] in ("confirmed", "choose", "not resolved")
    kept_by = "jemalloc" if jemalloc_library() else "glibc"   # the script preloads jemalloc where the machine has it
    for result in (out / "results").glob("*.json"):     # each CPU task measured with freed memory kept
        task = json.loads(result.read_text())
        assert task["allocator"].startswith(f"host allocator: {kept_by} keeps") and len(task["page_faults"]) == 3
    assert "Spearman rank correlation" in printed and "**Verdict: " in printed and (out / "defence.md").is_file()
    code, _, err = run_cli(capsys, ["plan", "collect", str(tmp_path)])
    assert code == 2 and err[0].startswith("error: collect: ")


def _sweep(out: Path, results: dict[int, list[float]]):
    """A finished sweep's files: candidates.json (planner's order = index) and results/INDEX.json with repeats."""
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "candidates.json").write_text(json.dumps({
        "cluster": "8 CPU devices", "global_batch": 8, "seq_len": 16, "steps": 2, "repeats": 3,
        "candidates": [{"index": i, "strategy": f"s{i}", "predicted_step_s": 0.1 * (i + 1), "predicted_memory": 1e6}
                       for i in results]}))
    for i, repeats in results.items():
        (out / "results" / f"{i}.json").write_text(json.dumps(
            {"index": i, "step_s": sorted(repeats)[1], "repeats_s": repeats, "times_s": repeats * 2,
             "memory_compiled": 2e6}))


def test_collect_says_not_resolved_inside_the_noise(capsys, tmp_path):
    """Two runs of one sweep whose measured order flips inside the noise give no confident 'choose it' (the
    collect used to say 'choose it' at any order); a difference beyond the noise is a choice both times."""
    noisy = [{0: [0.30, 0.26, 0.34], 1: [0.28, 0.33, 0.31], 2: [0.40, 0.41, 0.42]},
             {0: [0.29, 0.31, 0.33], 1: [0.28, 0.27, 0.30], 2: [0.40, 0.41, 0.42]}]   # s1 measured fastest
    verdicts = []
    for run, results in enumerate(noisy):
        _sweep(tmp_path / f"noisy{run}", results)
        code, printed, err = run_cli(capsys, ["plan", "collect", str(tmp_path / f"noisy{run}")])
        assert code == 0, err
        assert "choose it" not in printed and "not resolved" in printed
        verdicts.append(json.loads((tmp_path / f"noisy{run}" / "defence.json").read_text())["verdict"]["verdict"])
    assert verdicts == ["not resolved", "not resolved"]
    _sweep(tmp_path / "clear", {0: [0.30, 0.31, 0.32], 1: [0.20, 0.21, 0.22], 2: [0.40, 0.41, 0.42]})
    code, printed, err = run_cli(capsys, ["plan", "collect", str(tmp_path / "clear")])
    assert code == 0 and "the planner's #2, s1, beyond the noise: choose it" in printed
    assert "±3.2%" in printed          # s0's noise: half its repeats' range over its median


def test_sweep_tasks_run_one_at_a_time_with_repeats(capsys, tmp_path, monkeypatch):
    """The array runs its tasks one at a time (%1) and records how many repeats each measures."""
    monkeypatch.setenv("JAXPAR_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli(capsys, [
        "plan", "--config", "configs/test.py", "--set", "model.vocab_size=256", "--cpu-devices", "8",
        "--global-batch", "8", "--seq-len", "16", "--tokens", "1e6", "--sweep", "2", "--out", str(tmp_path / "s")])
    assert code == 0, err
    assert "#SBATCH --array=0-1%1" in (tmp_path / "s" / "sweep.sbatch").read_text()
    assert json.loads((tmp_path / "s" / "candidates.json").read_text())["repeats"] == 3
    code, _, err = run_cli(capsys, ["plan", "--cpu-devices", "8", "--tokens", "1e6", "--repeats", "2"])
    assert code == 2 and "--repeats" in err[0]


def test_identical_cpu_plans_use_one_kept_host_probe(tmp_path, monkeypatch):
    """`jaxpar plan --cpu-devices` probes the host once and keeps it: a second probe under another load (here: other
    figures) does not change the cluster, so two identical invocations plan identically."""
    import dataclasses
    import itertools

    from jaxpar.measure import hardware
    from jaxpar.plan.command import host_cluster
    monkeypatch.setenv("JAXPAR_CACHE", str(tmp_path))
    monkeypatch.delenv(hardware.REPROBE_ENV, raising=False)
    host = hardware.HostProbe(name="h", bf16_flops=None, fp8_flops=None, fp32_flops=1e10, tf32_flops=None,
                              hbm_bytes=16e9, hbm_bw=1e10, link_bw=1e10, scaleout_bw=None, source="test")
    loads = itertools.count(1)
    monkeypatch.setattr(hardware, "probe_host", lambda *a: dataclasses.replace(
        host, fp32_flops=1e10 / next(loads), hbm_bw=2e10 / next(loads)))
    first, second = host_cluster(8), host_cluster(8)
    assert (first.peak("float32"), first.mem_bw) == (second.peak("float32"), second.mem_bw)
