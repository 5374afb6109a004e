"""The capstone planner (jaxpar/plan): formulas against jaxpar's own and the compiler, ranking, bad input."""
import dataclasses
import json
import math
from pathlib import Path

import jax
import pytest

from jaxpar.cli import main
from jaxpar.config import ConfigError, apply_overrides, load_config
from jaxpar.measure.targets import gpu_plugin_problem
from jaxpar.model.counting import ModelShape, param_count, train_flops_per_token
from jaxpar.model.moe import MoEConfig
from jaxpar.model.transformer import ModelConfig
from jaxpar.parallel import registry
from jaxpar.parallel.memory import config_memory, memory
from jaxpar.parallel.schedules import bubble_fraction
from jaxpar.parallel.stage_memory import PIPELINE_EXTRA_SLOTS
from jaxpar.parallel.theory import Candidate, candidate_from_config
from jaxpar.plan import risks
from jaxpar.plan.fleet import cpu_cluster, gpu_cluster
from jaxpar.plan.planner import defence, evaluate, plan, smallest_cluster
from jaxpar.plan.space import enumerate_candidates
from jaxpar.plan.steptime import executed_flops_per_token, step_time
from jaxpar.plan.verify import candidate_config, verify

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {name: f"configs/{name}.py" for name in ("test", "arabic_7b", "llama_1b")}
HAS_GPU_PLUGIN = gpu_plugin_problem() is None


def config(name="test", *overrides):
    c = load_config(CONFIGS[name])
    if c.model.vocab_size == 0:
        apply_overrides(c, ["model.vocab_size=512"])
    apply_overrides(c, list(overrides))
    return c


def seven_b():
    return ModelShape.from_config(config("arabic_7b"))


# ----------------------------------------------------------------------------- the model as numbers

@pytest.mark.parametrize("name", ["test", "arabic_7b", "llama_1b"])
def test_shape_counts_and_flops_are_jaxpars(name):
    c = config(name)
    shape, model = ModelShape.from_config(c), ModelConfig.from_config(c.model)
    counts = param_count(model)
    assert shape.params == counts["total"]
    assert shape.counts()["blocks"] == counts["blocks"]
    assert shape.flops_per_token(c.data.seq_len) == train_flops_per_token(model, c.data.seq_len)


def with_moe(shape, **moe):
    return ModelShape(dataclasses.replace(shape.model, moe=MoEConfig(**moe)))


def test_moe_flops_follow_active_experts():
    """k of E experts: stored parameters count every expert, FLOPs only the k a token visits."""
    dense = seven_b()
    moe = with_moe(dense, experts=8, top_k=2, expert_mlp_dim=dense.mlp_dim)
    every = with_moe(dense, experts=8, top_k=8, expert_mlp_dim=dense.mlp_dim)
    d, f, L = dense.d_model, dense.mlp_dim, dense.layers
    assert moe.params - dense.params == L * (7 * 3 * d * f + d * 8)           # 7 more experts and a router
    assert moe.flops_per_token(4096) - dense.flops_per_token(4096) == 6 * L * (3 * d * f + d * 8)   # 1 more, router
    assert every.flops_per_token(4096) > moe.flops_per_token(4096)


def test_the_planner_counts_every_router_weight():
    """The noisy router's noise weights and the sigmoid router's bias are parameters the planner stores too."""
    dense = seven_b()
    plain, noisy, sigmoid = (with_moe(dense, experts=8, top_k=2, expert_mlp_dim=dense.mlp_dim, router=r)
                             for r in ("softmax", "noisy", "sigmoid"))
    L, d = dense.layers, dense.d_model
    assert noisy.params - plain.params == L * d * 8 and sigmoid.params - plain.params == L * 8


def test_full_remat_recomputes_what_the_compiler_recomputes():
    """Remat full: every forward matmul of a layer again except wo and w_down, and both attention einsums."""
    s = seven_b()
    base = executed_flops_per_token(s, 4096, "none", "dot")
    full = executed_flops_per_token(s, 4096, "full", "dot")
    per_layer = 2 * (s.d_model * (s.heads + 2 * s.kv_heads) * s.head_dim + 2 * s.d_model * s.mlp_dim)
    assert full["matmul"] - base["matmul"] == pytest.approx(per_layer * s.layers)
    assert full["attention"] - base["attention"] == pytest.approx(2 * 2 * s.heads * s.head_dim * 4096 * s.layers)


# ----------------------------------------------------------------------------- communication

@pytest.mark.parametrize("sizes", [dict(fsdp=8, microbatches=2), dict(data=4, tensor=2)], ids=["fsdp", "tensor"])
def test_bytes_match_the_compiled_cpu_program(sizes):
    from jaxpar.measure import hlo
    from jaxpar.mesh import make_mesh
    from jaxpar.parallel.registry import make_strategy
    cand = Candidate(remat="none", precision="float32", **sizes)
    c, reason = candidate_config(config("test"), cand, 16, 32, platform="cpu")
    assert reason is None
    mesh = make_mesh(c)
    strategy = make_strategy(c, ModelConfig.from_config(c.model), mesh)
    with jax.set_mesh(mesh):
        compiled = strategy.lower_step().compile()
    found = {}
    for col in hlo.collectives(compiled.as_text(), mesh):
        found[col.axis_label] = found.get(col.axis_label, 0.0) + col.bytes_per_step
    predicted = registry.predict(ModelShape.from_config(c), cand, 16, 32, "cpu").bytes_by_axis()
    for axis, value in predicted.items():
        assert found.get(axis, 0) == pytest.approx(value, rel=0.1), (axis, found)


# ----------------------------------------------------------------------------- memory and time

def test_memory_responds_to_each_setting():
    s, hbm = seven_b(), 80e9

    def m(**settings):
        return memory(s, Candidate(**{"fsdp": 64, "microbatches": 4, **settings}), 256, 4096, hbm).total

    assert m(remat="none") > m(remat="dots") > m(remat="full")
    assert m(attention="dot") > m(attention="flash")
    assert m(microbatches=1) > m(microbatches=4)
    hybrid, sharded = (memory(s, c, 256, 4096, hbm).state for c in (Candidate(fsdp=8, data=8), Candidate(fsdp=64)))
    assert hybrid == pytest.approx(8 * sharded, rel=1e-6)
    p1 = Candidate(fsdp=8, pipe=8, microbatches=32, schedule="1f1b", remat="full")
    gp = dataclasses.replace(p1, schedule="gpipe")
    extra = PIPELINE_EXTRA_SLOTS                                            # GPipe keeps m, 1F1B p microbatches
    assert memory(s, gp, 256, 4096, hbm).activations == pytest.approx(
        (32 + extra) / (8 + extra) * memory(s, p1, 256, 4096, hbm).activations)
    zb = memory(s, dataclasses.replace(p1, schedule="zb-h1"), 256, 4096, hbm)
    assert zb.taps > 0 and memory(s, p1, 256, 4096, hbm).taps == 0             # only ZB-H1 keeps (x, dy) taps


def recorded_h100_compiles() -> dict:
    """The recorded deviceless H100 compiles of the 7B (tests/data), by their overrides: (config, mesh sizes, peak)."""
    from jaxpar.config import mesh_shape
    recorded = json.loads((ROOT / "tests" / "data" / "h100_7b_compiles.json").read_text())["compiles"]
    out = {}
    for rec in recorded:
        c = config("arabic_7b", *rec["overrides"])
        out[" ".join(rec["overrides"])] = (c, mesh_shape(c, 64), rec["compiled_peak_bytes"])
    return out


def uncalibrated_h100_compiles() -> set:
    """The recorded compiles the memory model is known not to reproduce (their note says so)."""
    recorded = json.loads((ROOT / "tests" / "data" / "h100_7b_compiles.json").read_text())["compiles"]
    return {" ".join(rec["overrides"]) for rec in recorded if rec.get("note", "").startswith("not calibrated")}


def test_memory_reproduces_recorded_h100_compiles():
    """The memory model, asked as the dry run asks it (`config_memory`), against 43 recorded deviceless H100
    compiles of the 7B (tests/data; re-checked live by `jaxpar plan --verify` where the CUDA plugin is
    installed). Not calibrated, and reported: fp32, and ZB-H1 with remat dots at tensor 2. Pipelines at tensor 2
    keep the heads- and MLP-wide share of a layer split (memory.py's `tensor_split_kept`): whole, the model read
    0.68-0.77 of them."""
    ratios = {key: peak / config_memory(c, ModelConfig.from_config(c.model), sizes, "gpu", 80e9).total
              for key, (c, sizes, peak) in recorded_h100_compiles().items()}
    uncalibrated = {k: ratios.pop(k) for k in uncalibrated_h100_compiles()}
    assert len(uncalibrated) == 1 and all(v > 1.1 for v in uncalibrated.values()), uncalibrated   # as noted
    fp32 = {k: v for k, v in ratios.items() if "float32" in k}
    assert len(ratios) == 42 and len(fp32) == 1
    rest = [v for k, v in ratios.items() if k not in fp32]
    assert all(abs(v - 1) < 0.12 for v in rest), ratios
    assert sum(abs(v - 1) < 0.05 for v in rest) >= 0.85 * len(rest), ratios
    zb = {k: v for k, v in ratios.items() if "zb-h1" in k}      # parallel/stage_memory.py's terms, counted from these
    assert len(zb) == 10 and all(abs(v - 1) < 0.06 for v in zb.values()), zb
    tensor_pipes = {k: v for k, v in ratios.items() if "mesh.tensor" in k and "mesh.pipe" in k}
    assert len(tensor_pipes) == 3 and all(abs(v - 1) < 0.05 for v in tensor_pipes.values()), tensor_pipes
    assert all(v > 1.2 for v in fp32.values())          # what the docstring says: fp32 is under-predicted


def test_the_dry_run_and_the_planner_predict_the_same_memory():
    """One memory model: for every recorded 7B layout (pipelines, tensor, ZeRO, fp8, flash...), what the dry run
    reports (`config_memory`) is, part by part, what the planner ranks with (`evaluate`)."""
    cluster = gpu_cluster("h100", 8, 8)
    for key, (c, sizes, _) in recorded_h100_compiles().items():
        model_cfg = ModelConfig.from_config(c.model)
        shape, cand, batch, seq_len, _ = registry.workload(c, model_cfg, sizes, "gpu")
        planned = evaluate(shape, cand, cluster, batch, seq_len, 1e9).memory
        dry = config_memory(c, model_cfg, sizes, "gpu", cluster.hbm_bytes)
        assert dry.parts() == planned.parts() and dry.total == planned.total, key


def test_step_time_terms():
    s, c = seven_b(), gpu_cluster("h100", 8, 8)
    fsdp = Candidate(fsdp=64)
    hybrid = Candidate(fsdp=8, data=8)
    t_fsdp, t_hybrid = (step_time(s, x, c, 256, 4096) for x in (fsdp, hybrid))
    assert t_fsdp.comm_s["fsdp"] > t_hybrid.comm_s["fsdp"]                # InfiniBand (8 NICs) vs NVLink
    assert c.axis_link(fsdp, "fsdp").name.startswith("InfiniBand") and c.axis_link(hybrid, "fsdp").name == "NVLink"
    assert t_fsdp.exposed_s["fsdp"] < t_fsdp.comm_s["fsdp"]              # hidden behind compute on GPU
    tp = step_time(s, Candidate(fsdp=8, tensor=8), c, 256, 4096)
    from jaxpar.plan.steptime import GPU_CALIBRATION
    measured = dict(GPU_CALIBRATION.measured).get(("fsdp=auto tensor=auto", "tensor"), 0.0)   # lab 05's schedule
    assert tp.exposed_s["tensor"] == pytest.approx(tp.comm_s["tensor"] * (1 - measured))
    cpu = cpu_cluster(8, {}, 50e9, 5e9, 16e9)
    t_cpu = step_time(s, fsdp, cpu.resized(8), 256, 4096)
    assert t_cpu.exposed_s["fsdp"] == t_cpu.comm_s["fsdp"]               # XLA:CPU: nothing overlaps
    pipe = Candidate(fsdp=8, pipe=8, microbatches=32, schedule="1f1b")
    t = step_time(s, pipe, c, 256, 4096)
    assert t.bubble_fraction == pytest.approx(7 / (32 + 7))
    busy = t.compute_s + t.memory_s + t.exposed_s.get("tensor", 0)
    assert t.bubble_s == pytest.approx(busy * 7 / 32)


def test_bubble_fractions():
    assert bubble_fraction("1f1b", 4, 8) == bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction("zb-h1", 4, 8) == pytest.approx(3 / 27)
    assert bubble_fraction("circular", 4, 8, 2) == pytest.approx(3 / 19)    # the planner's copy refused it
    assert all(bubble_fraction(name, 1, 8, 2) == 0 for name in ("1f1b", "interleaved", "zb-h1", "circular"))


# ----------------------------------------------------------------------------- planning

def test_plan_ranks_fitting_candidates_and_defends_the_choice():
    s, c = seven_b(), gpu_cluster("h100", 8, 8)
    p = plan(s, c, global_batch=256, seq_len=4096, tokens=1e12)
    times = [r.time.total_s for r in p.ranked]
    assert times == sorted(times) and all(r.memory.fits for r in p.ranked)
    assert len(p.ranked) < p.evaluated == len(enumerate_candidates(s, 64, 256, precisions=("bfloat16", "float8")))
    best = p.best
    assert best.days == pytest.approx(1e12 / best.tokens_per_s / 86400)
    assert best.gpu_hours == pytest.approx(best.days * 24 * 64)
    text = defence(p)
    assert text.startswith(f"Choose {best.label}") and "dominates" in text and "Runner-up" in text


def test_nothing_fits_names_the_smallest_cluster():
    s = seven_b()
    small = gpu_cluster("h100", 1, 1)
    with pytest.raises(ConfigError, match=r"^--nodes: no strategy fits .* the smallest that fits is (\d+) x 1"):
        plan(s, small, global_batch=256, seq_len=4096, tokens=1e12)
    found = smallest_cluster(s, small, 256, 4096, 0.1)
    def fits(devices):
        return any(memory(s, c, 256, 4096, 80e9).fits for c in enumerate_candidates(s, devices, 256))

    assert fits(found.devices) and not fits(found.devices - 1)


def test_candidates_round_trip_through_configs():
    cand = Candidate(data=2, fsdp=4, microbatches=2, remat="dots", precision="bfloat16")
    c, reason = candidate_config(config("test"), cand, 16, 32, platform="cpu")
    assert reason is None
    assert candidate_from_config(c, cand.sizes, "cpu") == cand


def test_unbuildable_candidates_say_why(monkeypatch):
    refused = Candidate(data=2, fsdp=4, data_impl="zero1")                  # the manual stages run over data only
    c, reason = candidate_config(config("test"), refused, 16, 32, platform="cpu")
    assert c is None and reason.startswith("formula only: parallel.data: ")
    import jaxpar.plan.verify as v
    monkeypatch.setattr(v, "candidate_overrides", lambda *a, **k: ["model.no_such_kernel=1"])
    c, reason = candidate_config(config("test"), Candidate(data=8), 16, 32)
    assert c is None and reason.startswith("formula only: model.no_such_kernel: unknown config field")


def test_verification_demotes_what_does_not_fit(monkeypatch):
    """The compiler's memory overrides the prediction: a candidate that does not fit drops below the others."""
    s, cl = ModelShape.from_config(config("test")), gpu_cluster("h100", 1, 8)
    p = plan(s, cl, global_batch=16, seq_len=32, tokens=1e9, precisions=("bfloat16",), attentions=("dot",))
    first, second = p.ranked[0].label, p.ranked[1].label

    def fake_dryrun(cfg, target, topology=None):
        fat = candidate_from_config(cfg, {a: cfg.mesh[a] for a in ("data", "fsdp", "pipe", "expert", "tensor")})
        peak = 100e9 if fat.label() == first else 1e9
        return {"memory": {"compiled": {"peak": peak}}, "collectives": {"by_axis": {}}, "timing": {"compile_s": 1.0}}

    import jaxpar.measure.dryrun
    monkeypatch.setattr(jaxpar.measure.dryrun, "dryrun", fake_dryrun)
    verified, skipped = verify(p, config("test"), 2, log=lambda line: None)
    assert [v.label for v in verified] == [f"#1 {first}", f"#2 {second}"] and not skipped
    assert verified[0].demoted.startswith("demoted: compiled peak 100.0 GB exceeds")
    assert p.ranked[0].label == second and p.ranked[0].note.startswith("compiled peak")


# ----------------------------------------------------------------------------- risks

def test_young_daly_and_goodput():
    assert risks.young_interval(10.0, 86400.0) == pytest.approx(math.sqrt(2 * 10 * 86400))
    assert risks.daly_interval(10.0, 86400.0) == pytest.approx(risks.young_interval(10.0, 86400.0), rel=0.01)
    r = risks.assess(64, 10.0, 1.0, 600.0)
    assert r.failures_per_day == pytest.approx(64 * 419 / (54 * 16384))
    assert 0 < r.goodput < 1 and r.wall_days == pytest.approx(10.0 / r.goodput)
    assert risks.assess(64, 10.0, 1.0, 3600.0).goodput < r.goodput


# ----------------------------------------------------------------------------- the command line

def run_cli(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


def test_plan_command(capsys, tmp_path):
    code, out, err = run_cli(capsys, ["plan", "--config", CONFIGS["arabic_7b"], "--nodes", "8", "--gpus-per-node",
                                      "8", "--gpu", "h100", "--tokens", "1e12", "--out", str(tmp_path)])
    assert code == 0, err
    assert "| 1 | " in out and "## Defence" in out and "Choose " in out
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["ranked"][0]["strategy"] in out and saved["fit"] > 0
    assert all(r["note"] for r in saved["ranked"][:10])                   # builds, or formula only: why


@pytest.mark.parametrize("extra, field", [
    (["--gpu", "b300"], "--gpu"),
    (["--tokens", "0"], "--tokens"),
    (["--tokens=-5e11"], "--tokens"),
    (["--words", "0"], "--words"),
    (["--nodes", "1", "--gpus-per-node", "1"], "--nodes"),
    (["--global-batch", "0"], "--global-batch"),
    (["--headroom", "1.5"], "--headroom"),
])
def test_plan_bad_input(capsys, tmp_path, extra, field):
    argv = ["plan", "--config", CONFIGS["arabic_7b"], "--out", str(tmp_path / "out"), *extra]
    if not any(e.startswith(("--tokens", "--words")) for e in extra):
        argv += ["--tokens", "1e12"]
    code, _, err = run_cli(capsys, argv)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {field}: "), err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not HAS_GPU_PLUGIN, reason="needs jax-cuda12-plugin + jax-cuda12-pjrt matching jaxlib "
                                               "(a deviceless H100 compile); CI has no plugin")
def test_predicted_memory_matches_a_deviceless_h100_compile():
    s, cl = seven_b(), gpu_cluster("h100", 8, 8)
    p = plan(s, cl, global_batch=256, seq_len=4096, tokens=1e12,
             candidates=[Candidate(fsdp=8, data=8, microbatches=4, remat="full", attention="dot")])
    verified, skipped = verify(p, config("arabic_7b"), 1, log=lambda line: None)
    assert not skipped and verified[0].memory_ratio == pytest.approx(1.0, abs=0.1)


def test_moe_configs_get_an_expert_axis():
    dense = seven_b()
    moe = with_moe(dense, experts=8, top_k=2, expert_mlp_dim=dense.mlp_dim)
    p = plan(moe, gpu_cluster("h100", 8, 8), global_batch=256, seq_len=4096, tokens=1e12)
    expert = [r for r in p.results if r.cand.expert > 1]
    assert expert and all(8 % r.cand.expert == 0 for r in expert)
    assert not any(r.cand.expert > 1 for r in plan(dense, gpu_cluster("h100", 8, 8), global_batch=256, seq_len=4096,
                                                    tokens=1e12).results)
    r = min(expert, key=lambda r: r.time.total_s)
    unsplit = dataclasses.replace(r.cand, expert=1, data=r.cand.data * r.cand.expert)
    assert r.comm_bytes["expert"] > 0 and r.memory.state < memory(moe, unsplit, 256, 4096, 80e9).state


def test_budget_in_arabic_words(capsys, tmp_path):
    from jaxpar.plan.fertility import fertility
    code, out, err = run_cli(capsys, ["plan", "--config", CONFIGS["arabic_7b"], "--set", "data.vocab_size=1024",
                                      "--words", "1e9", "--top", "1", "--out", str(tmp_path)])
    assert code == 0, err
    f = fertility("quran", 1024, False)
    assert json.loads((tmp_path / "plan.json").read_text())["tokens"] == pytest.approx(1e9 * f["tokens_per_word"])
    assert f"{f['tokens_per_word']:.3f} tokens/word" in out
