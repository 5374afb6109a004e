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
        "--sweep", "3", "--steps", "3", "--out", str(out)])
    assert code == 0, err
    spec = json.loads((out / "candidates.json").read_text())
    assert len(spec["candidates"]) == 3 and "#SBATCH --array=0-2" in (out / "sweep.sbatch").read_text()
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
    assert all(len(r["times_s"]) == 3 and r["memory_compiled"] > 0 for r in defence["rows"])
    kept_by = "jemalloc" if jemalloc_library() else "glibc"   # the script preloads jemalloc where the machine has it
    for result in (out / "results").glob("*.json"):     # each CPU task measured with freed memory kept
        task = json.loads(result.read_text())
        assert task["allocator"].startswith(f"host allocator: {kept_by} keeps") and len(task["page_faults"]) == 3
    assert "Spearman rank correlation" in printed and (out / "defence.md").is_file()
    code, _, err = run_cli(capsys, ["plan", "collect", str(tmp_path)])
    assert code == 2 and err[0].startswith("error: collect: ")
