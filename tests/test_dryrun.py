"""Dry runs: compile without allocating, and check the compiler's bill against theory.

In-process tests use the 8 CPU devices conftest gives; 64-device and GPU-target runs
go through `python -m jaxpar.cli dryrun` in a subprocess (the device count and the
platform are fixed when JAX starts).
"""
import copy
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxpar.config import ConfigError, apply_overrides, load_config
from jaxpar.dryrun import dryrun, markdown_report, plot_memory
from jaxpar.measure.flops import compiled_flops
from jaxpar.measure.targets import gpu_plugin_problem, parse_topology, target_devices
from jaxpar.mesh import make_mesh
from jaxpar.model.counting import param_count
from jaxpar.model.transformer import ModelConfig
from jaxpar.parallel.registry import make_strategy
from jaxpar.units import byte_unit, fmt_bytes

ROOT = Path(__file__).resolve().parent.parent
TINY = "configs/test.py"
SEVEN_B = "configs/arabic_7b.py"
HAS_GPU_PLUGIN = gpu_plugin_problem() is None


def tiny(*overrides):
    config = load_config(TINY)
    apply_overrides(config, ["model.vocab_size=512", *overrides])
    return config


def cli(*args, env=None):
    """Run `python -m jaxpar.cli dryrun ...` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "jaxpar.cli", "dryrun", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=600)


# ----------------------------------------------------------------------------- in process, 8 CPU devices

@pytest.fixture(scope="module")
def fsdp8():
    return dryrun(tiny("mesh.data=1", "mesh.fsdp=8"), "cpu")


def test_fsdp_memory_matches_zero_formula(fsdp8):
    mem = fsdp8["memory"]
    assert mem["compiled"]["argument"] == mem["state_from_shardings"]["state_total"] + mem["batch_bytes"]
    assert mem["compiled"]["argument"] == pytest.approx(mem["zero_formula"]["state"], rel=0.05)


def test_fsdp_collective_bytes_match_theory(fsdp8):
    """CPU FSDP: gathers (F-1)/F·4·(2Ψ_L + head), gradient all-reduce + slice 2(F-1)/F·4·(Ψ - embedding).

    XLA:CPU has no reduce-scatter: the gradient costs 2(F-1)/F instead of (F-1)/F. The embedding is
    never gathered: the tokens are, and all-to-alls move the looked-up activations (and their gradient).
    """
    col = fsdp8["collectives"]
    assert set(col["by_axis"]) == {"fsdp"}
    assert {"all-gather", "all-reduce", "all-to-all"} == set(col["by_op"])   # XLA:CPU: no reduce-scatter
    assert col["by_op"]["all-to-all"]["count"] == 2                          # the embedding, forward and backward
    assert col["by_axis"]["fsdp"]["bytes"] == pytest.approx(col["by_axis"]["fsdp"]["predicted_bytes"], rel=0.01)
    counts = param_count(ModelConfig.from_config(tiny().model))
    F = 8
    without_embedding = (F - 1) / F * 4 * (counts["total"] - counts["embedding"])
    assert 3 * without_embedding < col["total_bytes"] < 4 * without_embedding


def test_the_dry_run_reports_the_planners_memory_prediction(fsdp8):
    """The dry run's predicted memory is the planner's, part by part (one model: jaxpar.parallel.memory), beside
    the compiled figures with their ratio; on CPU the report says the model is not calibrated there."""
    from jaxpar.parallel.registry import workload
    from jaxpar.plan.fleet import cpu_cluster
    from jaxpar.plan.planner import evaluate
    config = tiny("mesh.data=1", "mesh.fsdp=8")
    shape, cand, batch, seq_len, _ = workload(config, ModelConfig.from_config(config.model), fsdp8["mesh"], "cpu")
    planned = evaluate(shape, cand, cpu_cluster(8, {}, 1e11, 1e10, 16e9), batch, seq_len, 1e6).memory
    pred, compiled = fsdp8["memory"]["predicted"], fsdp8["memory"]["compiled"]
    for part in ("params", "optimizer", "gradients", "activations", "working", "total"):
        assert pred[part] == planned.total if part == "total" else pred[part] == getattr(planned, part), part
    assert pred["peak_ratio"] == compiled["peak"] / planned.total
    assert 0.8 < pred["peak_ratio"] < 1.25   # no XLA:GPU fixed buffers on CPU: the model's parts are the step's
    assert pred["calibrated"] is False and pred["uncalibrated"] == ["XLA:CPU", "float32"]
    text = markdown_report(fsdp8)
    assert "| **peak** | | | " + fmt_bytes(planned.total) in text and "not calibrated for XLA:CPU" in text


def test_ddp_reduces_gradients_once_per_microbatch():
    """Gradient accumulation: XLA all-reduces inside the accumulation loop, m x 2(D-1)/D·4Ψ (not once)."""
    r = dryrun(tiny("mesh.data=8", "train.microbatches=2"), "cpu")
    data = r["collectives"]["by_axis"]["data"]
    psi, D = r["model"]["params"], 8
    assert data["bytes"] == pytest.approx(2 * 2 * (D - 1) / D * 4 * psi, rel=0.01)
    assert data["bytes"] == pytest.approx(data["predicted_bytes"], rel=0.01)


def test_report_has_every_section(fsdp8):
    text = markdown_report(fsdp8)
    for heading in ("## Memory per device", "## Collectives per step", "## FLOPs per device per step",
                    "## Time on these virtual CPU devices", "## Communication hidden behind compute"):
        assert heading in text
    fsdp = fsdp8["overlap"]["by_axis"]["fsdp"]                      # XLA:CPU collectives are synchronous
    assert fsdp["collectives"] > 0 and fsdp["async"] == 0 and fsdp["hidden_s"] == 0.0
    t = fsdp8["time"]
    assert t["overlapped_s"] == max(t["compute_s"], t["communication_s"])
    assert t["serial_s"] == pytest.approx(t["compute_s"] + t["communication_s"])
    json.dumps(fsdp8, default=str)                                   # the --out file is plain JSON


def test_memory_figure_stacks_the_tables_parts(fsdp8, tmp_path):
    """memory.png: the predicted parts stack to the predicted peak, the compiled bar to arguments + temp."""
    fig = plot_memory(fsdp8, tmp_path / "memory.png")
    tops: dict[int, float] = {}
    for bar in fig.axes[0].patches:
        x = round(bar.get_x() + bar.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    pr, cm = fsdp8["memory"]["predicted"], fsdp8["memory"]["compiled"]
    _, scale = byte_unit([pr["total"], cm["peak"], fsdp8["memory"]["device_hbm_bytes"] or 0])
    assert tops[0] * scale == pytest.approx(pr["total"])
    assert tops[1] * scale == pytest.approx(cm["argument"] + cm["temp"])
    assert (tmp_path / "memory.png").stat().st_size > 0


def test_cpu_headline_is_memory_and_communication_not_a_step_time(fsdp8):
    """Virtual CPU devices share one host: their step time is labelled as theirs, never the headline."""
    text = markdown_report(fsdp8)
    title, _, _, _, first = text.split("\n")[:5]
    assert title.startswith("# Dry run:") and first.startswith("**Per device: ")
    assert "peak memory" in first and "collectives per step" in first and "No step time is predicted" in first
    assert "per step, MFU" not in first and "**The planner's step model" not in text
    assert "for these 8 virtual CPU devices: " in text                   # still there, labelled as theirs
    gpu = {**fsdp8, "machine": {**fsdp8["machine"], "platform": "gpu"}}  # a GPU target's headline has the step
    assert "predicted step time" in markdown_report(gpu).split("\n")[4]


def test_cpu_times_in_days_and_without_mfu(fsdp8):
    """A 7B step on 64 virtual CPU devices takes weeks of this host: said in days, as this host's estimate, with
    no MFU (it printed "1441980.63 s per step, MFU 77.9%" and "Replayed step ... 1529497401.912 ms")."""
    slow = copy.deepcopy(fsdp8)
    slow["time"]["calibrated"]["step_s"], slow["overlap"]["replayed_step_s"] = 1441980.63, 1529497.401912
    cpu = markdown_report(slow)
    assert "virtual CPU devices: 16.7 days per step on this host (a CPU estimate): compute at" in cpu
    assert "Replayed step (compute at roofline + exposed waits): 17.7 days;" in cpu
    timed = cpu[cpu.index("## Time on these virtual CPU devices"):cpu.index("## Communication hidden")]
    assert not re.search(r"MFU|\d\.\d%", timed.replace("with no MFU", "")), timed
    gpu = {**slow, "machine": {**slow["machine"], "platform": "gpu"}}    # a GPU target keeps its MFUs
    assert re.search(r"16\.7 days per step, MFU [\d.]+%", markdown_report(gpu))


def test_bad_inputs_raise_config_error():
    with pytest.raises(ConfigError, match="^--target: unknown target 'tpu'"):
        dryrun(tiny(), "tpu")
    with pytest.raises(ConfigError, match="^--devices: 64 CPU devices asked for"):
        dryrun(tiny(), "cpu", devices=64)
    with pytest.raises(ConfigError, match="^mesh: "):
        dryrun(tiny("mesh.data=1", "mesh.fsdp=16"), "cpu")
    with pytest.raises(ConfigError, match="^model.vocab_size: is 0"):
        dryrun(tiny("model.vocab_size=0"), "cpu")
    for bad in ("8x8", "1x0x8", "axbxc", ""):
        with pytest.raises(ConfigError, match="^--topology: "):
            parse_topology(bad)
    assert parse_topology("1x8x8") == (1, 8, 8)
    with pytest.raises(ConfigError, match="^--devices: 16 does not match --topology 1x1x8"):
        target_devices("h100", 16, "1x1x8")


# ----------------------------------------------------------------------------- FLOPs: the loop correction

def test_scan_correction_on_a_toy_scan():
    """cost_analysis counts a scan body once; corrected FLOPs equal the unrolled program's."""
    def model(ws, x, unroll):
        def layer(h, w):
            return jnp.tanh(h @ w), None
        return jax.lax.scan(layer, x, ws, unroll=unroll)[0].sum()

    ws, x = jnp.ones((6, 64, 64)), jnp.ones((32, 64))
    scanned = jax.jit(functools.partial(model, unroll=1)).lower(ws, x).compile()
    unrolled = jax.jit(functools.partial(model, unroll=True)).lower(ws, x).compile()
    corrected, reference = compiled_flops(scanned), compiled_flops(unrolled)
    assert corrected["cost_analysis"] < reference["cost_analysis"] / 3            # the undercount
    assert corrected["dot_per_step"] == 6 * 2 * 32 * 64 * 64
    assert corrected["corrected"] == pytest.approx(reference["cost_analysis"], rel=0.01)


def _train_step(config):
    mesh = make_mesh(config)
    strategy = make_strategy(config, ModelConfig.from_config(config.model), mesh)
    with jax.set_mesh(mesh):
        return strategy.lower_step().compile()


def test_scan_correction_on_the_train_step(monkeypatch):
    """The real step with nested loops (2 microbatches around the layer scan) and remat, vs every scan unrolled."""
    config = tiny("mesh.data=1", "mesh.fsdp=8", "train.microbatches=2", "train.remat=full")
    scanned = compiled_flops(_train_step(config))
    monkeypatch.setattr(jax.lax, "scan", functools.partial(jax.lax.scan, unroll=True))
    unrolled_program = _train_step(config)
    monkeypatch.undo()
    assert " while(" not in unrolled_program.as_text()
    unrolled = compiled_flops(unrolled_program)
    assert unrolled["hlo_per_step"] == unrolled["hlo_once"]                     # nothing to correct
    assert scanned["dot_per_step"] == unrolled["dot_per_step"]                  # dots: exact
    assert scanned["cost_analysis"] < 0.5 * unrolled["cost_analysis"]
    assert scanned["corrected"] == pytest.approx(unrolled["cost_analysis"], rel=0.01)


def test_hlo_count_tracks_cost_analysis(fsdp8):
    """Counted once per computation, our HLO rules reproduce cost_analysis (loop-free comparison)."""
    fl = fsdp8["flops"]
    assert fl["hlo_once"] == pytest.approx(fl["cost_analysis"], rel=0.02)
    assert fl["corrected"] > fl["model_per_device"]          # the step does more than the model's 6Ψ


# ----------------------------------------------------------------------------- the CLI: exit 2, one line

@pytest.mark.parametrize("args, start", [
    (["--target", "tpu"], "error: argument --target: invalid choice"),
    (["--set", "mesh.fsdp=8", "--set", "mesh.data=1", "--devices", "4"], "error: mesh: "),
    (["--target", "h100", "--topology", "8x8"], "error: --topology: '8x8' is not PxHxG"),
])
def test_cli_bad_input(args, start):
    run = cli("--config", TINY, "--set", "model.vocab_size=512", *args)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), run.stderr


@pytest.mark.skipif(HAS_GPU_PLUGIN, reason="the CUDA plugin is installed here")
def test_cli_missing_gpu_plugin():
    run = cli("--config", TINY, "--set", "model.vocab_size=512", "--target", "h100", "--topology", "1x1x8")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("error: --target: ") and "jax-cuda12-plugin" in lines[0]
    assert f"=={jax.__version__}" in lines[0] or "jaxlib" in lines[0]


# ----------------------------------------------------------------------------- deviceless H100

@pytest.mark.skipif(not HAS_GPU_PLUGIN, reason="needs jax-cuda12-plugin + jax-cuda12-pjrt matching jaxlib")
def test_h100_deviceless_fsdp(tmp_path):
    """Real XLA:GPU collectives: async all-gathers and a reduce-scatter of gradients, ≈ 3Ψ·e in total."""
    run = cli("--config", TINY, "--set", "model.vocab_size=512", "--set", "mesh.data=1", "--set", "mesh.fsdp=8",
              "--target", "h100", "--topology", "1x1x8", "--out", str(tmp_path), env={"JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads((tmp_path / "dryrun.json").read_text())
    assert r["machine"]["platform"] == "gpu" and r["devices"] == 8
    assert "reduce-scatter" in r["collectives"]["by_op"]
    fsdp = r["collectives"]["by_axis"]["fsdp"]
    assert fsdp["link"] == "NVLink"                                      # one host: 8 GPUs on NVLink
    assert fsdp["bytes"] == pytest.approx(fsdp["predicted_bytes"], rel=0.05)
    mem = r["memory"]["compiled"]
    assert mem["peak"] == mem["peak_reported"] >= mem["temp"]            # GPU peak includes temporaries
    assert r["flops"]["cost_analysis"] is None and r["flops"]["corrected"] > 0
    hidden = r["overlap"]["by_axis"]["fsdp"]                             # async pairs, some compute between
    assert 0 < hidden["async"] <= hidden["collectives"] and 0 < hidden["hidden_s"] < hidden["comm_s"]


# ----------------------------------------------------------------------------- the 7B model on 64 devices

@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["--set", "mesh.fsdp=8", "--set", "mesh.tensor=8"]])   # fsdp=64: lab 00's table
def test_7b_on_64_cpu_devices(tmp_path, mesh):
    run = cli("--config", SEVEN_B, *mesh, "--target", "cpu", "--devices", "64", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads((tmp_path / "dryrun.json").read_text())
    assert r["devices"] == 64
    mem = r["memory"]
    psi = param_count(ModelConfig.from_config(load_config(SEVEN_B).model))["total"]
    assert r["model"]["params"] == psi
    assert mem["compiled"]["argument"] == pytest.approx(12 * psi / 64, rel=0.05)
    assert mem["compiled"]["argument"] == pytest.approx(mem["zero_formula"]["state"], rel=0.05)
    for axis, row in r["collectives"]["by_axis"].items():     # fsdp; and tensor (4 all-reduces a layer, +1 remat)
        assert row["bytes"] == pytest.approx(row["predicted_bytes"], rel=0.05), axis
    assert set(r["collectives"]["by_axis"]) == {"fsdp", *(["tensor"] if "mesh.tensor=8" in mesh else [])}
    assert r["timing"]["compile_s"] < 120
    assert r["timing"]["host_peak_rss_bytes"] < 4 * 2**30                 # nothing was allocated
    # remat 'full' recomputes most of the forward (at most 8Ψ instead of 6Ψ per token), plus
    # elementwise work
    assert 1.1 < r["flops"]["corrected"] / r["flops"]["model_per_device"] < 1.4
