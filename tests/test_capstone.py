"""Lab 10 end to end, reduced (two CPU strategies, one vocabulary, a short collectives sweep): every section
of the report is written from what the run measured, and bad input writes nothing."""
import json

import pytest
from test_plan import CONFIGS, run_cli

from jaxpar.measure.targets import gpu_plugin_problem
from jaxpar.parallel.theory import Candidate


@pytest.fixture
def reduced(monkeypatch):
    import jaxpar.labs.capstone.lab as lab
    import jaxpar.plan.reality as reality
    plain = dict(remat="none", precision="float32", attention="dot")
    monkeypatch.setattr(reality, "default_strategies", lambda: [Candidate(data=8, **plain), Candidate(fsdp=8, **plain)])
    monkeypatch.setattr(reality, "BENCH_SIZES", ("16K", "32K"))
    monkeypatch.setattr(reality, "BENCH_OPS", ("all-reduce", "all-gather"))
    import jaxpar.plan.cpu_links as links
    monkeypatch.setattr(links, "OPS", ("all-reduce", "all-gather"))
    monkeypatch.setattr(links, "SIZES", (4096, 256 * 1024))
    monkeypatch.setattr(links, "REPEATS", 4)
    monkeypatch.setattr(lab, "VOCABS", (1024,))

    def small_model():      # part d's report and numbers on the test model (the lab: the default config's)
        from jaxpar.config import apply_overrides, load_config
        config = load_config("configs/test.py")
        apply_overrides(config, ["model.vocab_size=256"])
        return config
    monkeypatch.setattr(lab, "reality_config", small_model)


def test_capstone_report(capsys, tmp_path, reduced, monkeypatch):
    """Part d measures through `call_with_kept_memory` (its fresh process: test_host_allocator.py); here in this
    process with glibc's default, its result through pickle as the fresh process returns it."""
    import pickle

    import jaxpar.measure.host_allocator as host_allocator
    monkeypatch.setattr(host_allocator, "call_with_kept_memory",
                        lambda fn, *args: pickle.loads(pickle.dumps(fn(*args, keep=False))))
    out = tmp_path / "lab"
    code, _, err = run_cli(capsys, ["lab", "capstone", "--config", CONFIGS["arabic_7b"], "--tokens", "1e12",
                                    "--verify", "0", "--rounds", "3", "--out", str(out)])
    assert code == 0, err
    report = (out / "report.md").read_text()
    for heading in ("## a. The plan", "### Defence", "## The chosen strategy", "## b. Calibration",
                    "## c. Checked against the compiler", "## d. Checked against reality", "## e. Arabic tokenizer",
                    "## f. Risks"):
        assert heading in report, heading
    for plot in ("plan.png", "memory.png", "steptime.png", "cpu_check.png", "fertility.png"):
        assert (out / plot).stat().st_size > 0, plot
    results = json.loads((out / "results.json").read_text())
    rows = results["reality"]["rows"]
    assert [r["calibration"] for r in rows] == [True, False]
    assert results["reality"]["allocator"] == "host allocator: glibc's default (not changed)"   # this process's
    assert "page faults per step" in report and all(f"| {r['faults_per_step']:,.0f} |" in report for r in rows)
    assert rows[0]["ratio"] == pytest.approx(1.0, rel=1e-6)                # η is fitted on the first strategy
    cores = results["reality"]["cores"]
    for r in rows:
        assert r["measured_s"] == sorted(r["times_s"])[1] and len(r["times_s"]) == 3   # median of 3 rounds
        assert r["cpu_s"] == pytest.approx(sorted(r["cpu_times_s"])[1] / cores)        # CPU seconds per core
        assert f"| {r['strategy']} | {r['cpu_s']:.3f} (" in report and f"| {r['predicted_s']:.3f} |" in report
        assert f"| {r['measured_s']:.3f} (" in report and f"| {r['predicted_wall_s']:.3f} |" in report
    resolved, agreeing, pairs = results["reality"]["resolved_pairs"]
    assert pairs == 1 and agreeing <= resolved <= 1 and f"resolve **{resolved} of 1** pairs" in report
    fert = results["fertility"]["rows"]
    assert [f["normalize"] for f in fert] == [False, True]
    assert fert[0]["tokens_per_word"] == fert[0]["held_out_tokens"] / fert[0]["held_out_words"]
    assert "Quran is a small" in report
    assert results["risks"]["risk"]["goodput"] < 1


@pytest.mark.skipif(gpu_plugin_problem() is None, reason="the CUDA plugin is installed here")
def test_capstone_says_how_to_verify_without_the_plugin(capsys, tmp_path, reduced):
    out = tmp_path / "lab"
    code, _, err = run_cli(capsys, ["lab", "capstone", "--config", CONFIGS["arabic_7b"], "--tokens", "1e12",
                                    "--skip-cpu", "--out", str(out)])
    assert code == 0, err
    assert "Skipped: a deviceless GPU compile needs the jax-cuda12-plugin" in (out / "report.md").read_text()


def test_capstone_runs_the_parts_asked_for(capsys, tmp_path):
    """`--parts f` (e.g. `--parts d` to rerun the CPU check alone): only that part runs and is reported."""
    out = tmp_path / "lab"
    code, _, err = run_cli(capsys, ["lab", "capstone", "--config", CONFIGS["test"], "--set", "model.vocab_size=512",
                                    "--nodes", "1", "--tokens", "1e9", "--parts", "f", "--out", str(out)])
    assert code == 0, err
    report = (out / "report.md").read_text()
    assert "## f. Risks" in report and "parts f only" in report
    for heading in ("## a.", "## b.", "## c.", "## d.", "## e."):
        assert heading not in report, heading
    results = json.loads((out / "results.json").read_text())
    assert results["parts"] == "f" and results["risks"]["risk"]["goodput"] < 1
    assert results["anchors"] is results["reality"] is results["fertility"] is None
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]


@pytest.mark.parametrize("extra, field", [(["--gpu", "tpu9"], "--gpu"), (["--tokens", "0"], "--tokens"),
                                          (["--rounds", "1"], "--rounds"), (["--parts", "dx"], "--parts")])
def test_capstone_bad_input(capsys, tmp_path, extra, field):
    argv = ["lab", "capstone", "--config", CONFIGS["arabic_7b"], "--out", str(tmp_path / "lab"), *extra]
    code, _, err = run_cli(capsys, argv)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {field}: "), err
    assert not (tmp_path / "lab").exists()
