"""The planner's step and memory model against published runs: group bandwidth, overheads, GEMM size, layouts,
η per framework, and one strategy on request (`jaxpar plan --strategy`, `--json`)."""
import json

import pytest
from test_plan import CONFIGS, config, run_cli, seven_b

from jaxpar.model.counting import ModelShape
from jaxpar.parallel.theory import Candidate
from jaxpar.plan import anchors
from jaxpar.plan.fleet import gpu_cluster
from jaxpar.plan.gemm import gemm_efficiency
from jaxpar.plan.planner import evaluate, plan
from jaxpar.plan.steptime import GPU_CALIBRATION, STEP_OVERHEAD_S, step_time
from jaxpar.plan.strategy import parse_strategy

H100 = gpu_cluster("h100", 8, 8)


def test_a_group_across_nodes_uses_the_nics_of_its_gpus_in_each_node():
    """NCCL spreads a collective over every NIC the group owns per node (NCCL issue 812), capped by NVLink."""
    nic, nvlink = H100.scaleout.bus_bw, H100.scaleup.bus_bw
    whole_nodes = Candidate(fsdp=64)                      # 8 GPUs of each node in the group: 8 NICs
    assert H100.axis_link(whole_nodes, "fsdp").bus_bw == pytest.approx(min(8 * nic, nvlink))
    hybrid = Candidate(data=8, fsdp=8)                    # data: one GPU per node, fsdp: inside a node
    assert H100.axis_link(hybrid, "data").bus_bw == nic
    assert H100.axis_link(hybrid, "fsdp").name == "NVLink"
    assert H100.axis_link(Candidate(fsdp=32, tensor=2), "fsdp").bus_bw == pytest.approx(4 * nic)
    capped = gpu_cluster("h100", 8, 8, ib_gbps=100)       # 8 x 100 GB/s NICs would beat NVLink: NVLink caps it
    assert capped.axis_link(whole_nodes, "fsdp").bus_bw == capped.scaleup.bus_bw
    big = 1e10      # bytes: the bandwidth term, where the 8 NICs count (the start-up latency: next test)
    whole, inside = H100.axis_link(whole_nodes, "fsdp", "all-gather"), H100.axis_link(hybrid, "fsdp", "all-gather")
    assert whole.time("all-gather", big, 1) < 2 * inside.time("all-gather", big, 1)


def test_microbatches_and_steps_cost_time():
    """m=4..32 do not tie (each microbatch costs overhead and shrinks the GEMMs); the tie-break cannot pick m=32;
    a tiny model's step is not 0 s."""
    s = seven_b()
    times = [step_time(s, Candidate(fsdp=64, microbatches=m, remat="dots", attention="flash"), H100, 256, 4096).total_s
             for m in (1, 2, 4, 8, 16, 32)]
    assert times == sorted(times) and len(set(times)) == len(times)
    one_b = ModelShape.from_config(config("llama_1b"))
    best = plan(one_b, gpu_cluster("h100", 1, 8), global_batch=256, seq_len=2048, tokens=1e12).best
    same = [r for r in plan(one_b, gpu_cluster("h100", 1, 8), global_batch=256, seq_len=2048, tokens=1e12).ranked
            if r.cand.sizes == best.cand.sizes and r.cand.remat == best.cand.remat
            and r.cand.precision == best.cand.precision and r.cand.attention == best.cand.attention]
    assert best.cand.microbatches == min(r.cand.microbatches for r in same)
    tiny = ModelShape.from_config(config("test"))
    t = plan(tiny, gpu_cluster("h100", 1, 8), global_batch=64, seq_len=128, tokens=1e9).best.time
    assert t.total_s >= STEP_OVERHEAD_S and t.terms()["fixed overheads"] >= STEP_OVERHEAD_S


def test_small_gemms_are_less_efficient_and_fp8_mfu_names_its_peak():
    """The size factor falls with the width and the microbatch; a 1.1B model in fp8 predicts a lower MFU than an
    8B one in fp8 on the same node (it predicted 73% before: every GEMM at the same efficiency)."""
    wide = Candidate(data=8, precision="float8", attention="flash")
    one_b = ModelShape.from_config(config("llama_1b"))
    ridge = H100.peak("bfloat16") / H100.mem_bw
    g = {name: gemm_efficiency(shape, wide, 8192, ridge)
         for name, shape in (("1b", one_b), ("8b", anchors.LLAMA31_8B), ("70b", anchors.LLAMA2_70B))}
    assert g["1b"] < g["8b"] < g["70b"] < 1
    assert gemm_efficiency(anchors.LLAMA31_8B, wide, 512, ridge) < g["8b"]           # a short microbatch
    node = gpu_cluster("h100", 1, 8)
    mfu = {}
    for name, shape, seq in (("1b", one_b, 2048), ("8b", anchors.LLAMA31_8B, 8192)):
        p = plan(shape, node, global_batch=128, seq_len=seq, tokens=1e12, precisions=("float8",),
                 attentions=("flash",))
        mfu[name] = p.best.mfu
        assert p.best.mfu_fp8_peak == pytest.approx(p.best.mfu * node.peak("bfloat16") / node.peak("float8"))
    assert mfu["1b"] < 0.9 * mfu["8b"]          # 0.87 of it with NeMo's fp8 factor (either fit: 0.7149, 0.7286)


def test_memory_layouts():
    """jaxpar's layout (fp32 params everywhere + fp32 accumulator) vs a distributed optimizer with bf16 params."""
    s, node = anchors.LLAMA31_8B, gpu_cluster("h100", 1, 8)
    cand = Candidate(data=8, microbatches=16, remat="full", attention="flash")
    own = evaluate(s, cand, node, 128, 8192, 1e12)
    dist = evaluate(s, cand, node, 128, 8192, 1e12, layout="distributed-optimizer")
    assert own.memory.layout == "jaxpar" and dist.memory.layout == "distributed-optimizer"
    assert own.memory.params == pytest.approx(4 * s.params) and dist.memory.params == pytest.approx(2 * s.params)
    assert dist.memory.optimizer == pytest.approx(12 * s.params / 8)
    assert dist.memory.gradients == pytest.approx(4 * s.params)            # accumulated in place
    assert own.memory.gradients > 2 * 4 * s.params                          # + the fp32 accumulator
    assert not own.memory.fits and dist.memory.fits                         # 8B on 8 x 80 GB: only the second
    assert "params (bf16)" in dist.memory.parts()
    assert dist.comm_bytes["data"] < own.comm_bytes["data"] / 8             # one reduce-scatter per step, not m


def test_eta_is_fitted_per_framework_on_published_runs():
    """The recorded η of each framework is what fitting its anchor's own strategy gives, fitted and predicted with
    the calibration `jaxpar plan` predicts with (the measured overlap table included): each fitted anchor
    reproduces its figure, and every anchor (fits and checks) is predicted within 15% of its published tokens/s
    per GPU."""
    for framework, values in anchors.FITTED.items():
        assert anchors.fit_framework(framework) == pytest.approx(values, abs=0.002), framework
        assert anchors.calibration(framework).measured == GPU_CALIBRATION.measured != ()
    assert GPU_CALIBRATION.compute == anchors.FITTED["jaxpar (XLA)"]["compute"]
    assert GPU_CALIBRATION.fp8 == anchors.FITTED["NeMo"]["fp8"]
    rows = anchors.anchor_table()
    assert {r["role"] for r in rows} >= {"η", "fp8", "check"}
    for r in rows:
        assert abs(r["ratio"] - 1) <= (0.002 if r["fitted"] else 0.15), r
        assert parse_strategy(r["strategy"]).label() == r["strategy"]        # the run's own strategy


def test_strategy_text_round_trips_and_refuses_bad_words():
    for text in ("fsdp=64 m=2 remat=dots bf16 flash", "zero3=8 m=1 remat=none fp32 dot",
                 "data=2 fsdp=4 pipe=8 interleaved m=16 remat=full bf16 flash", "fsdp=8 tp=8 m=4 remat=dots bf16 dot"):
        assert parse_strategy(text).label() == text
    assert parse_strategy("fsdp=8,tp=8").tensor == 8
    for bad in ("fsdp=0", "fsdp=x", "remat=some", "warp=2", ""):
        with pytest.raises(Exception, match="--strategy"):
            parse_strategy(bad)


def test_plan_one_strategy_and_json(capsys, tmp_path):
    """`--strategy` evaluates one strategy (buildable or not, fitting or not); `--json` writes every candidate."""
    path = tmp_path / "all.json"
    code, out, err = run_cli(capsys, ["plan", "--config", CONFIGS["arabic_7b"], "--tokens", "1e12", "--strategy",
                                      "fsdp=64 m=2 remat=dots bf16 flash", "--json", str(path)])
    assert code == 0, err
    assert "buildable by jaxpar: yes" in out and "InfiniBand x8 NICs" in out
    row = json.loads(path.read_text())["candidates"][0]
    assert row["strategy"] == "fsdp=64 m=2 remat=dots bf16 flash" and row["exposed_s"]["fsdp"] > 0
    for key in ("tokens_per_s_per_device", "step_s", "mfu_bf16_peak", "memory_total", "comm_s", "layout"):
        assert key in row
    code, out, err = run_cli(capsys, ["plan", "--config", CONFIGS["arabic_7b"], "--tokens", "1e12", "--strategy",
                                      "data=64 m=1 remat=none fp8 flash", "--layout", "distributed-optimizer"])
    assert code == 0 and "buildable by jaxpar: no" in out and "distributed-optimizer" in out
    code, _, _ = run_cli(capsys, ["plan", "--config", CONFIGS["arabic_7b"], "--tokens", "1e12", "--json",
                                  str(path)])
    rows = json.loads(path.read_text())["candidates"]
    assert code == 0 and len(rows) > 1000 and any(not r["fits"] for r in rows)
    for argv, field in ((["--strategy", "fsdp=32"], "--strategy"), (["--layout", "zero9"], "--layout"),
                        (["--json", str(tmp_path)], "--json"), (["--sweep", "3"], "--sweep")):
        code, _, err = run_cli(capsys, ["plan", "--config", CONFIGS["arabic_7b"], "--tokens", "1e12", *argv])
        assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {field}: "), err
