"""The planner's CPU target (lab 10 part d): the terms read from XLA:CPU's compiled programs, the memory bandwidth
the virtual devices share, the collectives inside one program, and the load-free (CPU seconds) timing basis."""
import pytest

from jaxpar.config import apply_overrides, load_config
from jaxpar.model.counting import ModelShape
from jaxpar.parallel.memory import kept_per_layer
from jaxpar.parallel.theory import Candidate
from jaxpar.plan import cpu_links
from jaxpar.plan.fleet import cpu_cluster
from jaxpar.plan.reality import Measured, calibrate, resolved_pairs
from jaxpar.plan.steptime import ADAM_BYTES_PER_PARAM, KEPT_PASSES, RESIDUAL_PASSES, SCORE_BYTES, Calibration, step_time

PLAIN = dict(remat="none", precision="float32", attention="dot")
AT_PEAK = Calibration(compute=1.0, overlap=0.0, memory=1.0, step_overhead_s=0.0, layer_overhead_s=0.0)


def default_shape():
    c = load_config(None)
    apply_overrides(c, ["model.vocab_size=1024"])
    return ModelShape.from_config(c)


def test_a_cpu_step_pays_for_the_activations_it_keeps():
    """Without remat the compiled CPU step copies every kept activation into the layer scan's stack and reads it
    back: remat full saves those two passes (and pays one more forward's residual passes), besides recomputing."""
    s, cpu = default_shape(), cpu_cluster(8, {}, 200e9, 10e9, 16e9, cores=2)
    none, full = (Candidate(data=8, **{**PLAIN, "remat": r}) for r in ("none", "full"))
    t_none, t_full = (step_time(s, c, cpu, 16, 128, AT_PEAK) for c in (none, full))
    kept = (kept_per_layer(s, none, 16, 128) - kept_per_layer(s, full, 16, 128)) * s.layers
    residual = 16 * 128 / 8 * s.layers * s.d_model * 4 * RESIDUAL_PASSES["forward"]
    scores = 2 * s.heads * 128**2 * s.layers * SCORE_BYTES["forward"]         # the recomputed forward's S x S passes
    k = KEPT_PASSES["cpu"]
    assert t_none.memory_s - t_full.memory_s == pytest.approx((k * kept - residual - scores) / cpu.mem_bw)
    assert kept_per_layer(s, none, 16, 128) * s.layers == pytest.approx(42.3e6, rel=0.01)   # compiled: 34.8 MB


def test_kept_activations_cost_what_one_device_measured():
    """KEPT_PASSES on CPU is the cost per kept byte that a remat A/B on ONE device measured (the data=8 step's
    whole batch, 16 x 128 tokens, process CPU seconds, medians of 9 rounds, glibc keeping freed memory; the middle of
    three runs): loss+grad 0.8689 s without remat, 0.9253 s with remat full, the forward alone 0.2137 s. Remat full
    saves the kept activations and pays the recomputed share of the forward (its FLOPs' share, up to the whole
    forward), so the kept bytes cost t_none - t_full + share x t_forward, in passes at the host's copy rate
    (12.2-13.8 GB/s in those hours)."""
    from jaxpar.plan.steptime import executed_flops_per_token
    s, data = default_shape(), Candidate(data=8, **PLAIN)
    kept = kept_per_layer(s, data, 16, 128) * s.layers * 8           # every device's: the whole batch's
    flops = {r: sum(executed_flops_per_token(s, 128, r, "dot").values()) for r in ("none", "full")}
    share = (flops["full"] - flops["none"]) / (flops["none"] / 3)      # recomputed / forward FLOPs
    low = (0.8689 - 0.9253 + share * 0.2137) * 12.2e9 / kept
    high = (0.8689 - 0.9253 + 1.0 * 0.2137) * 13.8e9 / kept
    assert 2.0 < low < high < 7.0
    assert low <= KEPT_PASSES["cpu"] <= high


def test_a_cpu_adamw_update_costs_what_was_measured():
    """AdamW on CPU moves ~48 bytes per parameter at the copy rate (adam_cost.py: 46.9-51.3 in four runs, the
    default model replicated on 8 devices), so data=8's replicated update costs 7/8 of it more than fsdp=8's."""
    assert 46.9 <= ADAM_BYTES_PER_PARAM["cpu"] <= 51.3 and ADAM_BYTES_PER_PARAM["gpu"] == 32
    s, cpu = default_shape(), cpu_cluster(8, {}, 200e9, 10e9, 16e9, cores=2)
    data, fsdp = Candidate(data=8, **PLAIN), Candidate(fsdp=8, **PLAIN)
    t_data, t_fsdp = (step_time(s, c, cpu, 16, 128, AT_PEAK) for c in (data, fsdp))
    assert t_data.memory_s - t_fsdp.memory_s == pytest.approx(48 * s.params * 7 / 8 / cpu.mem_bw, rel=0.01)


def test_virtual_cpu_devices_share_every_cores_bandwidth():
    """The host probe's copy is one thread; the devices' AdamW and elementwise passes run on all cores at once."""
    s, data = default_shape(), Candidate(data=8, **PLAIN)
    one, two = (cpu_cluster(8, {}, 200e9, 10e9, 16e9, cores=n) for n in (1, 2))
    assert two.mem_bw == pytest.approx(2 * 10e9 / 8) and one.mem_bw == pytest.approx(10e9 / 8)
    assert step_time(s, data, two, 16, 128, AT_PEAK).memory_s == pytest.approx(
        step_time(s, data, one, 16, 128, AT_PEAK).memory_s / 2)


def test_the_check_calibrates_on_cpu_seconds_per_core():
    """The load-free basis: a step's process CPU seconds over the cores; η and O fitted on it reproduce it."""
    s, cpu = default_shape(), cpu_cluster(8, {}, 200e9, 10e9, 16e9, cores=2)
    data = Candidate(data=8, **PLAIN)
    full = Measured(data, [2.0, 3.0, 2.5], 0.0, {}, cpu_times=[0.9, 1.2, 1.0], global_batch=16, cores=2)
    half = Measured(data, [1.5, 1.2, 1.6], 0.0, {}, cpu_times=[0.6, 0.55, 0.7], global_batch=8, cores=2)
    assert full.cpu_step_s == pytest.approx(0.5) and full.step_s("wall") == 2.5
    for basis in ("cpu", "wall"):
        calibration = calibrate(cpu, s, full, half, 128, basis)
        assert step_time(s, data, cpu, 16, 128, calibration).total_s == pytest.approx(full.step_s(basis))
        assert step_time(s, data, cpu, 8, 128, calibration).total_s == pytest.approx(half.step_s(basis))


def test_a_step_faster_than_the_models_rest_is_not_calibrated():
    """A measured step shorter than the model's memory passes and collectives alone leaves no η to fit (the quick
    size's tiny steps): the calibration says so and keeps η = 1, never a huge η from dividing by ~0."""
    s, cpu = default_shape(), cpu_cluster(8, {}, 200e9, 10e9, 16e9, cores=2)
    data = Candidate(data=8, **PLAIN)
    rest = step_time(s, data, cpu, 16, 128, AT_PEAK)
    tiny = (rest.total_s - rest.compute_s) / 2
    full = Measured(data, [tiny] * 3, 0.0, {}, global_batch=16, cores=2)
    calibration = calibrate(cpu, s, full, None, 128)
    assert calibration.compute == 1.0 and calibration.source.startswith("not calibrated")


def test_collectives_inside_one_program(monkeypatch):
    """α-β from a loop of collectives in one program (one op here, for time), in bus bytes like the bench's."""
    import jax
    assert cpu_links.bus_bytes("all-reduce", 800, 8) == 1400 and cpu_links.bus_bytes("all-gather", 800, 8) == 700
    monkeypatch.setattr(cpu_links, "OPS", ("all-gather",))
    monkeypatch.setattr(cpu_links, "SIZES", (4096, 256 * 1024))
    monkeypatch.setattr(cpu_links, "REPEATS", 4)
    monkeypatch.setattr(cpu_links, "CALLS", 1)
    fits = cpu_links.measure_links(jax.devices()[:8])
    assert set(fits) == set(cpu_links.OPS)
    for fit in fits.values():
        assert fit["alpha_us"] >= 0 and (fit["beta_bus_GBps"] is None or fit["beta_bus_GBps"] > 0)


def test_the_check_counts_only_the_pairs_the_measurement_resolves():
    """A pair whose steps' quartiles overlap is noise to a ranking; the others count, ordered by the medians."""
    fast, slow, near_slow = [1.0, 1.1, 1.2, 1.3, 1.4], [2.0, 2.1, 2.2, 2.3, 2.4], [2.05, 2.15, 2.25, 2.35, 2.45]
    assert resolved_pairs([1, 2, 3], [fast, slow, near_slow]) == (2, 2, 3)
    assert resolved_pairs([3, 2, 1], [fast, slow, near_slow]) == (2, 0, 3)      # both resolved pairs ordered wrong
    assert resolved_pairs([1, 3, 2], [fast, slow, near_slow]) == (2, 2, 3)      # the unresolved pair does not count
