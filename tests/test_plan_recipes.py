"""Recipes people copy, through `jaxpar plan --strategy` (issue 31): sequence and context parallelism, interleaving's
v, the distributed optimizer in any mesh, a pipeline's m chosen by the planner's rule, the registry's names; and the
physics they need: all-to-all through each GPU's NIC, start-up latency growing with the group. Planner only."""
import dataclasses

import pytest
from test_plan import seven_b, with_moe

from jaxpar.parallel.context_predict import context_flows
from jaxpar.parallel.memory import kept_per_layer
from jaxpar.parallel.registry import implementations
from jaxpar.parallel.theory import Candidate
from jaxpar.plan import anchors
from jaxpar.plan.fleet import collective_alpha, gpu_cluster
from jaxpar.plan.planner import evaluate, plan
from jaxpar.plan.space import microbatch_choices
from jaxpar.plan.strategy import check_fits_model, parse_strategy

H100 = gpu_cluster("h100", 8, 8)
TITAN = "fsdp=32 tp=8 sp m=1 remat=full bf16 flash"


def test_recipe_words_parse_and_round_trip():
    """sp, v=N, dist-opt and every data implementation and schedule the strategy registry runs are words."""
    for text in (TITAN, "data=2 pipe=4 tp=2 sp interleaved v=8 m=16 remat=full bf16 flash",
                 "data=8 pipe=4 1f1b m=8 remat=full bf16 flash dist-opt",
                 "data=128 m=16 remat=none bf16 flash dist-opt", "data=64 cp=2 m=32 remat=none bf16 flash dist-opt",
                 "data=64 cp=2 m=32 remat=none bf16 flash dist-opt=bf16-grads",
                 "fsdp=2 cp=2 tp=2 all_to_all m=1 remat=full bf16 flash"):
        assert parse_strategy(text).label() == text
    c = parse_strategy("data=2 pipe=4 tp=2 sp interleaved v=8 m=16 dist-opt")
    assert (c.sequence, c.virtual, c.layout) == (True, 8, "distributed-optimizer")
    valid = implementations()
    for impl in (n for n in valid["data"] if n != "auto"):
        assert parse_strategy(f"{impl}=8 m=1").data_impl == impl
    for schedule in (n for n in valid["pipe"] if n != "auto"):
        cand = parse_strategy(f"pipe=4 {schedule} m=8")
        assert cand.schedule == schedule and parse_strategy(cand.label()) == cand
    for bad in ("data=8 sp", "pipe=4 1f1b v=4 m=8", "data=8 v=2", "zero1=8 dist-opt", "pipe=2 dualpipev v=4 m=4"):
        with pytest.raises(Exception, match="--strategy"):
            parse_strategy(bad)


def test_context_parallelism_is_a_word_refused_where_no_strategy_builds_it():
    """cp=N (context=N) with ring (the default) or all_to_all (context_impl=); with pipe, ep, sp, a ZeRO data
    implementation or a MoE model (what parallel/context.py does not compose with) refused in one line."""
    ring, same = parse_strategy("data=4 cp=2 m=32"), parse_strategy("data=4 context=2 context_impl=ring m=32")
    assert (ring.context, ring.context_impl) == (2, "ring") and ring == same and ring.devices == 8
    assert parse_strategy("data=4 cp=2 all_to_all").context_impl == "all_to_all"
    for bad, why in (("data=2 cp=2 pipe=2 m=4", "pipe=2"), ("data=2 ep=2 cp=2", "ep=2"), ("data=2 tp=2 sp cp=2", "sp"),
                     ("data=8 ring", "needs cp"), ("data=2 cp=2 ring all_to_all", "contradicts"),
                     ("zero1=4 cp=2", "not built"), ("data=4 cp=2 context_impl=ulysses", "not understood")):
        with pytest.raises(Exception, match=f"--strategy: .*{why}"):
            parse_strategy(bad)
    with pytest.raises(Exception, match="--strategy: cp=2: the model has 8 experts"):
        check_fits_model(ring, with_moe(seven_b(), experts=8, top_k=2, expert_mlp_dim=1024))
    with pytest.raises(Exception, match="--strategy: all_to_all gives each device whole heads"):
        check_fits_model(parse_strategy("fsdp=1 cp=8 tp=8 all_to_all"), anchors.LLAMA31_8B)   # 8 kv heads, 64 ways
    with pytest.raises(Exception, match="--strategy: .*no strategy runs.*data=2 dist-opt"):   # ZeRO-1 in a pipeline
        parse_strategy("zero1=2 pipe=4 m=8")


def test_every_ranked_label_parses_back_to_its_candidate():
    """The space's rows (and given recipes with sp, v, dist-opt) print labels that `--strategy` reads back."""
    s, node = seven_b(), gpu_cluster("h100", 1, 8)
    given = [parse_strategy(t) for t in ("fsdp=2 tp=4 sp m=2 remat=full bf16 flash",
                                         "data=2 pipe=2 tp=2 sp interleaved v=4 m=8 remat=full bf16 flash dist-opt",
                                         "data=2 cp=2 tp=2 all_to_all m=4 remat=dots bf16 flash")]
    labels = []
    for p in (plan(s, node, global_batch=16, seq_len=8192, tokens=1e12, check_fits=False),
              plan(s, node, global_batch=16, seq_len=8192, tokens=1e12, candidates=given, check_fits=False)):
        assert p.results
        for r in p.results:
            assert parse_strategy(r.label, r.cand.devices) == r.cand, r.label
            labels.append(r.label)
    assert any("cp=2 " in label and "all_to_all" not in label for label in labels)   # the space's ring rows
    assert any("cp=2 tp=2 all_to_all" in label for label in labels)


def test_a_pipeline_without_m_gets_the_planners_choice():
    """pipe > 1 and no m: the fastest fitting m of the space's choices, not m = 1 (a 1F1B it cannot build)."""
    s = seven_b()
    open_m = parse_strategy("data=8 pipe=8 1f1b remat=full bf16 flash")
    assert open_m.microbatches == 0
    chosen = plan(s, H100, global_batch=256, seq_len=4096, tokens=1e12, candidates=[open_m]).results[0]
    counts = microbatch_choices(256 // 8, 8, "1f1b")
    each = [evaluate(s, dataclasses.replace(open_m, microbatches=m), H100, 256, 4096, 1e12) for m in counts]
    fastest = min((r for r in each if r.memory.fits), key=lambda r: r.time.total_s)
    assert chosen.cand.microbatches == fastest.cand.microbatches >= 8
    with pytest.raises(Exception, match="--strategy"):     # 2 sequences per shard cannot fill 8 stages
        plan(s, H100, global_batch=16, seq_len=4096, tokens=1e12, candidates=[open_m])
    with pytest.raises(Exception, match="--strategy"):     # v=3 chunks of 8 stages do not divide 32 layers
        plan(s, H100, global_batch=256, seq_len=4096, tokens=1e12,
             candidates=[parse_strategy("data=8 pipe=8 interleaved v=3 m=16")])


def test_sequence_parallelism_splits_the_activations_over_tensor():
    """torchtitan's Llama-3.1-70B recipe (FSDP 32 x TP 8 with SP) fits: the kept layer input is split over tensor."""
    shape, cluster = anchors.LLAMA31_70B, gpu_cluster("h100", 32, 8)
    sp = parse_strategy(TITAN, 256)
    tp = dataclasses.replace(sp, sequence=False)
    assert kept_per_layer(shape, tp, 512, 8192) == pytest.approx(8 * kept_per_layer(shape, sp, 512, 8192))
    with_sp, without = (evaluate(shape, c, cluster, 512, 8192, 1e12) for c in (sp, tp))
    assert with_sp.memory.fits and not without.memory.fits
    assert with_sp.time.memory_s < without.time.memory_s            # the residual passes over 1/8 of the tokens
    assert with_sp.comm_bytes == without.comm_bytes                 # SP sends what TP sends


def test_the_distributed_optimizer_in_a_pipeline_reduce_scatters_over_data():
    """dist-opt in a pipe layout: ZeRO-1 over data (reduce-scatter + all-gather of what a device stores) in place of
    the gradients' all-reduce over data (no pipe part: the embedding and head are stage-owned); the pipeline's sends
    stay; the optimizer split over data."""
    s = seven_b()
    own = parse_strategy("data=8 pipe=8 1f1b m=16 remat=full bf16 flash")
    dist = dataclasses.replace(own, layout="distributed-optimizer")
    a, b = (evaluate(s, c, H100, 256, 4096, 1e12) for c in (own, dist))
    assert "data" in a.comm_bytes and not any("+" in axis for axis in (*a.comm_bytes, *b.comm_bytes))
    assert b.comm_bytes["pipe"] == a.comm_bytes["pipe"] > 0
    assert b.comm_bytes["data"] == pytest.approx(7 / 8 * 6 * b.memory.params / 2)   # 4 + 2 bytes per stored param
    assert b.memory.optimizer == pytest.approx(a.memory.optimizer * 12 / 8 / 8)
    assert b.memory.layout == "distributed-optimizer" and b.label.endswith("dist-opt")


def test_the_distributed_optimizer_with_context_parallelism_reduces_over_data_x_context():
    """Megatron's data-parallel group with context parallelism: dist-opt splits the optimizer over data x context
    and reduce-scatters the gradients over both once per step, in place of the context axis' per-microbatch
    all-reduce; the ring's key/value hops stay."""
    cluster = gpu_cluster("h100", 16, 8)
    dist = parse_strategy("data=64 cp=2 m=32 remat=none bf16 flash dist-opt", 128)
    own = dataclasses.replace(dist, layout="jaxpar")
    a, b = (evaluate(anchors.LLAMA31_8B, c, cluster, 2048, 8192, 1e12) for c in (own, dist))
    ring = [f.bytes for f in context_flows(anchors.LLAMA31_8B, dist, 2048, 8192, "gpu") if f.op == "permute"]
    assert b.comm_bytes["context"] == pytest.approx(sum(ring)) and a.comm_bytes["context"] > 10 * sum(ring)
    assert b.comm_bytes["data+context"] == pytest.approx(127 / 128 * 6 * b.memory.params / 2)
    assert b.memory.optimizer == pytest.approx(a.memory.optimizer * 12 / 8 / 128)
    assert b.time.comm_s["context"] < a.time.comm_s["context"] / 5


def test_the_distributed_optimizer_with_bf16_gradients_keeps_and_reduces_half():
    """NeMo's published runs (grad_sync_dtype=bf16): the gradients a device keeps and the reduce-scatter's bytes
    are half of Megatron's fp32 default; parameters and the split optimizer are the same."""
    cluster = gpu_cluster("h100", 16, 8)
    fp32 = parse_strategy("data=64 cp=2 m=32 remat=none bf16 flash dist-opt", 128)
    bf16 = parse_strategy("data=64 cp=2 m=32 remat=none bf16 flash dist-opt=bf16-grads", 128)
    a, b = (evaluate(anchors.LLAMA31_8B, c, cluster, 2048, 8192, 1e12) for c in (fp32, bf16))
    assert b.memory.gradients == pytest.approx(a.memory.gradients / 2)
    assert (b.memory.params, b.memory.optimizer) == (a.memory.params, a.memory.optimizer)
    assert b.comm_bytes["data+context"] == pytest.approx(127 / 128 * 4 * b.memory.params / 2)   # 2 + 2 bytes
    assert b.memory.layout == "distributed-optimizer-bf16-grads"
    assert a.memory.total - b.memory.total == pytest.approx(b.memory.gradients)


def test_all_to_all_across_nodes_goes_through_each_gpus_nic():
    """An expert group over 2 nodes: each GPU's NIC carries (n-g)/(n-1) of what it sends, not 8 NICs' worth."""
    nic = H100.scaleout.bus_bw
    cand = Candidate(data=4, expert=16)                     # 16 experts' devices: 8 per node on 2 nodes
    link = H100.axis_link(cand, "expert", "all-to-all")
    assert link.bus_bw == pytest.approx(nic * 15 / 8)
    assert H100.axis_link(cand, "expert", "all-gather").bus_bw == pytest.approx(min(8 * nic, H100.scaleup.bus_bw))
    assert H100.axis_link(Candidate(data=8, expert=8), "expert", "all-to-all").name == "NVLink"   # one node


def test_collective_latency_grows_with_the_group():
    """Ring all-gather: p-1 steps; all-reduce: the smaller of ring and tree (log p); 8 GPUs keep the stated α."""
    nv, ib = H100.scaleup.alpha_s, H100.scaleout.alpha_s
    assert collective_alpha("all-gather", 8, 1, nv, ib) == pytest.approx(nv)
    assert collective_alpha("all-reduce", 8, 8, nv, ib) == pytest.approx(ib)
    ring = [collective_alpha("all-gather", p, p // 8, nv, ib) for p in (64, 512, 4096)]
    assert ring == sorted(ring) and ring[-1] / ring[0] > 50
    tree = collective_alpha("all-reduce", 4096, 512, nv, ib)
    assert tree < 4 * collective_alpha("all-reduce", 64, 8, nv, ib)          # log p, not p


def test_fsdp_per_gpu_throughput_falls_as_the_job_grows():
    """A fixed-per-GPU FSDP job (8B, 2 sequences per GPU) from 64 to 32,768 GPUs: each GPU gets slower."""
    per_gpu = []
    for n in (64, 512, 4096, 32768):
        cand = parse_strategy(f"fsdp={n} m=1 remat=dots bf16 flash", n)
        r = evaluate(anchors.LLAMA31_8B, cand, gpu_cluster("h100", n // 8, 8), 2 * n, 8192, 1e12)
        per_gpu.append(r.tokens_per_s / n)
    assert per_gpu == sorted(per_gpu, reverse=True) and per_gpu[-1] < 0.5 * per_gpu[0]


def test_published_recipes_fit_and_are_predicted():
    """The torchtitan 70B recipe fits and is within 15% of its published tokens/s per GPU (the anchor table); NeMo's
    8B on 128 GPUs, written as published (CP 2, the distributed optimizer with bf16 gradients), fits and is within
    15%."""
    rows = {r["anchor"]: r for r in anchors.anchor_table()}
    titan = rows["torchtitan Llama-3.1-70B FSDP x TP+SP compiled"]
    assert titan["fits"] and abs(titan["ratio"] - 1) <= 0.15
    nemo = rows["NeMo 24.09 Llama-3.1-8B bf16, 128 GPUs"]
    assert "cp=2" in nemo["strategy"] and nemo["fits"] and abs(nemo["ratio"] - 1) <= 0.15


def test_async_tp_recipe_is_predicted_through_its_layouts_measured_overlap():
    """torchtitan's 70B with async TP (652 published) fits and is within 15%, its tensor axis exposing what the
    compiled fsdp x tp+sp + collective matmul schedule left exposed (overlap_measured.json, lab 05)."""
    from jaxpar.plan.overlap import measured
    row = next(r for r in anchors.anchor_table() if "async-tp" in r["strategy"])
    assert row["fits"] and abs(row["ratio"] - 1) <= 0.15, row
    anchor = next(a for a in anchors.ANCHORS if a.name == row["anchor"])
    t = anchors.evaluate_anchor(anchor, anchors.calibration(anchor.framework)).time
    key = "fsdp=auto tensor=manual sequence tensor_overlap=collective_matmul"
    assert t.exposed_s["tensor"] == pytest.approx(t.comm_s["tensor"] * (1 - dict(measured())[(key, "tensor")]))


def test_hand_written_tp_gathers_fsdp_weights_in_the_wire_dtype():
    """Manual TP x FSDP on GPU: the weights are cast to the compute dtype before the fsdp gather (its transpose,
    the reduce-scatter, too), so bf16 sends half of fp32 (as the compiled 7B on 64 H100s does, lab 05); on CPU
    XLA sends both in fp32."""
    from jaxpar.parallel.tensor import predict
    bf16 = parse_strategy("fsdp=8 tp=8 sp m=1 remat=full bf16 flash async-tp", 64)
    fp32 = dataclasses.replace(bf16, precision="float32")

    def fsdp(cand, platform):
        return sum(f.bytes for f in predict(seven_b(), cand, 64, 4096, platform).flows if f.axis == "fsdp")
    assert fsdp(bf16, "gpu") == pytest.approx(fsdp(fp32, "gpu") / 2)
    assert fsdp(bf16, "cpu") == pytest.approx(fsdp(fp32, "cpu"))


def test_async_tp_is_a_word_that_round_trips_and_needs_tp_and_sp():
    """async-tp (parallel.tensor_overlap=collective_matmul, or =bidirectional) on Megatron's hand-written tensor axis:
    its label reads back, a verified config sets it, and without tp > 1 and sp it is refused in one line."""
    from jaxpar.plan.verify import candidate_overrides
    for text, mode in ((f"{TITAN.replace(' sp', ' sp async-tp')}", "collective_matmul"),
                       ("data=8 tp=8 sp async-tp=bidirectional m=1 remat=full bf16 flash", "bidirectional")):
        cand = parse_strategy(text)
        assert (cand.tensor_overlap, cand.tensor_impl) == (mode, "manual") and cand.label() == text
        assert f"parallel.tensor_overlap={mode}" in candidate_overrides(cand, 512, 8192)
    same = ("fsdp=32 tp=8 sp tensor_overlap=collective_matmul", "fsdp=32 tp=8 sp async-tp")
    assert parse_strategy(same[0]) == parse_strategy(same[1])
    for bad in ("data=8 tp=8 async-tp", "data=8 async-tp", "data=8 tp=8 sp async-tp=ring"):
        with pytest.raises(Exception, match="--strategy: .*(async|sp)"):
            parse_strategy(bad)


def test_async_tp_is_predicted_through_the_measured_overlap_of_its_layout():
    """data x tp+sp on 64 H100s: the tensor axis exposes what the compiled schedule of that whole layout left
    exposed (overlap_measured.json): collective matmul's fraction with async-tp, XLA's own without."""
    from jaxpar.plan.overlap import hidden_fraction, layout_key, measured
    s, cluster = seven_b(), gpu_cluster("h100", 8, 8)
    plain = parse_strategy("data=8 tp=8 sp async-tp m=1 remat=full bf16 flash")
    plain = dataclasses.replace(plain, tensor_overlap="none")
    exposed = {}
    modes = ("collective_matmul", "bidirectional")
    for cand in (plain, *(dataclasses.replace(plain, tensor_overlap=m) for m in modes)):
        r = evaluate(s, cand, cluster, 64, 4096, 1e12)
        fraction = hidden_fraction(measured(), layout_key(cand), "tensor")
        assert fraction is not None
        assert r.time.exposed_s["tensor"] == pytest.approx(r.time.comm_s["tensor"] * (1 - fraction))
        exposed[cand.tensor_overlap] = r.time.exposed_s["tensor"]
    assert exposed["bidirectional"] < exposed["collective_matmul"] < exposed["none"]


def test_mixtral_recipe_keeps_its_moe_layers_activations_and_does_not_fit_without_recompute():
    """Megatron-Core's Mixtral-8x7B layout (data 2 x pipe 4 x expert 8, 1F1B, m = 16, micro-batch 1 x 4096) without
    recompute, in jaxpar's own count (XLA's buffers): each MoE layer keeps the rows its experts received and their
    SwiGLU states (parallel/expert_memory.py, read off deviceless H100 compiles: lab 07), more than the dense layer
    the fitted constant describes; with the 6 microbatches a first stage holds, the activations alone come near the
    72 GB usable (65.2 GB; 70.8 with a copy of the expert weights per layer and microbatch, 113.1 before
    expert_gating), so it does not fit in either model-state layout. Recomputing
    each layer (remat full, Megatron's --recompute-granularity full) keeps only the layer inputs, and it fits.
    Counted as Megatron's kernels keep them, the published recipe fits (tests/test_framework_memory.py)."""
    from jaxpar.config import load_config
    from jaxpar.model.counting import ModelShape
    from jaxpar.parallel.expert_memory import expert_weight_copies, moe_kept_extra
    from jaxpar.parallel.stage_memory import PIPELINE_EXTRA_SLOTS
    mixtral = ModelShape.from_config(load_config("configs/mixtral_8x7b.py"))
    dense = ModelShape(dataclasses.replace(mixtral.model, moe=None))
    recipe = parse_strategy("data=2 pipe=4 ep=8 m=16 remat=none bf16 flash", 64)
    extra = moe_kept_extra(mixtral, recipe, 1, 4096, "gpu")
    assert kept_per_layer(mixtral, recipe, 256, 4096) - kept_per_layer(dense, recipe, 256, 4096) == pytest.approx(extra)
    assert extra > 0
    fp = evaluate(mixtral, recipe, H100, 256, 4096, 1e12)
    dist = evaluate(mixtral, recipe, H100, 256, 4096, 1e12, layout="distributed-optimizer")
    stage_layers, slots = mixtral.layers // recipe.pipe, recipe.pipe + PIPELINE_EXTRA_SLOTS   # 1F1B's first stage
    assert fp.memory.activations == pytest.approx(stage_layers * (slots * kept_per_layer(mixtral, recipe, 256, 4096)
                                                                  + expert_weight_copies(mixtral, recipe)))
    assert fp.memory.activations > 0.9 * fp.memory.limit and not fp.memory.fits and not dist.memory.fits
    recompute = evaluate(mixtral, dataclasses.replace(recipe, remat="full"), H100, 256, 4096, 1e12)
    assert recompute.memory.fits and recompute.memory.activations < fp.memory.activations / 40
