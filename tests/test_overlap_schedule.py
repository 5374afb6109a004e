"""The schedule replay of jaxpar/measure/overlap.py on hand-written scheduled HLO (no compile: fast).

Peak 1e12 FLOP/s and 1e12 B/s; every collective costs 10 µs (duration = 10 µs fixed). The dot
f32[1000,1000] x f32[1000,1000] is 2e9 FLOPs = 2 ms; its 12 MB of reads and writes take 12 µs < 2 ms.
"""
import pytest

from jaxpar.measure import overlap

HW = overlap.Hardware(peak_flops=1e12, hbm_bw=1e12)
TEN_US = 10e-6

HLO = """HloModule m, is_scheduled=true, num_partitions=2

%body (p: (s32[], f32[1000,1000])) -> (s32[], f32[1000,1000]) {
  %p = (s32[], f32[1000,1000]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[1000,1000]{1,0} get-tuple-element(%p), index=1
  %ag-start = (f32[500,1000]{1,0}, f32[1000,1000]{1,0}) all-gather-start(%x), replica_groups={{0,1}}, dimensions={0}
  %d = f32[1000,1000]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ag-done = f32[1000,1000]{1,0} all-gather-done(%ag-start)
  %ar-start = f32[1000,1000]{1,0} all-reduce-start(%d), replica_groups={{0,1}}, to_apply=%add
  %ar-done = f32[1000,1000]{1,0} all-reduce-done(%ar-start)
  ROOT %t = (s32[], f32[1000,1000]{1,0}) tuple(%i, %ar-done)
}

%cond (p: (s32[], f32[1000,1000])) -> pred[] {
  %p = (s32[], f32[1000,1000]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[1000,1000]) -> f32[1000,1000] {
  %a = f32[1000,1000]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[1000,1000]{1,0}) tuple(%z, %a)
  %w = (s32[], f32[1000,1000]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[1000,1000]{1,0} get-tuple-element(%w), index=1
  ROOT %s = f32[1000,1000]{1,0} all-reduce(%y), replica_groups={{0,1}}, to_apply=%add
}
"""


def _replay(text):
    records, step = overlap.replay(text, HW, lambda c: TEN_US)
    return {r.name: r for r in records}, step


def test_compute_between_start_and_done_hides_the_collective():
    records, _ = _replay(HLO)
    gather = records["ag-start"]
    assert gather.compute_s == pytest.approx(2e-3, rel=0.01)     # the dot lies between start and done
    assert gather.exposed_s == 0.0 and gather.hidden_s == pytest.approx(TEN_US)
    assert gather.runs_per_step == 3


def test_nothing_between_start_and_done_is_exposed():
    records, _ = _replay(HLO)
    reduce = records["ar-start"]
    assert reduce.compute_s == 0.0
    assert reduce.exposed_s == pytest.approx(TEN_US) and reduce.hidden_s == pytest.approx(0.0)


def test_synchronous_collective_is_exposed_and_step_adds_up():
    records, step = _replay(HLO)
    assert not records["s"].is_async and records["s"].exposed_s == pytest.approx(TEN_US)
    # 3 trips x (2 ms dot + 10 µs exposed all-reduce) + 10 µs synchronous all-reduce
    assert step == pytest.approx(3 * (2e-3 + 12e-6 + TEN_US) + TEN_US, rel=0.01)
    axes = overlap.by_axis(list(records.values()))
    assert axes["?"]["hidden_s"] == pytest.approx(3 * TEN_US)
    assert axes["?"]["exposed_s"] == pytest.approx(3 * TEN_US + TEN_US)


def test_moving_the_done_before_the_compute_exposes_the_gather():
    lines = HLO.splitlines()
    dot = next(i for i, line in enumerate(lines) if "%d = " in line)
    done = next(i for i, line in enumerate(lines) if "%ag-done" in line)
    lines[dot], lines[done] = lines[done], lines[dot]
    records, _ = _replay("\n".join(lines))
    assert records["ag-start"].exposed_s == pytest.approx(TEN_US)


def test_transfer_carried_across_the_loop_boundary_is_hidden_by_the_previous_trip():
    # the collective pipeliner's shape: done at the top of the body, start at its end, the dot in between
    body = HLO.replace(
        "  %ag-start = (f32[500,1000]{1,0}, f32[1000,1000]{1,0}) all-gather-start(%x), replica_groups={{0,1}}, "
        "dimensions={0}\n", "").replace(
        "  %ag-done = f32[1000,1000]{1,0} all-gather-done(%ag-start)\n", "")
    body = body.replace("  %d = f32", "  %ag-done = f32[1000,1000]{1,0} all-gather-done(%ag-start)\n  %d = f32", 1)
    body = body.replace("  %ar-start", "  %ag-start = (f32[500,1000]{1,0}, f32[1000,1000]{1,0}) all-gather-start(%x), "
                        "replica_groups={{0,1}}, dimensions={0}\n  %ar-start", 1)
    records, _ = _replay(body)
    # issued after the dot, in flight during the all-reduce's exposed wait, done at the next trip's top
    assert records["ag-start"].exposed_s == 0.0 and records["ag-start"].hidden_s == pytest.approx(TEN_US)


def test_a_pair_marked_synchronous_is_exposed():
    text = HLO.replace("dimensions={0}\n", 'dimensions={0}, backend_config={"is_sync":true}\n', 1)
    records, _ = _replay(text)
    assert not records["ag-start"].is_async and records["ag-start"].exposed_s == pytest.approx(TEN_US)


def test_profile_lanes_count_collective_time_beside_compute():
    from jaxpar.labs.overlap.lab import lanes_of, overlap_of
    cpu = lambda name, ts, dur, dev=0: {"ph": "X", "pid": 1, "tid": 1, "name": name, "ts": ts, "dur": dur,
                                        "args": {"hlo_op": name, "device_ordinal": dev}}
    gpu = lambda name, ts, dur, tid: {"ph": "X", "pid": 9, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": {}}
    events = [cpu("while.3", 0, 100), cpu("all_gather.1", 10, 20), cpu("dot.2", 20, 40), cpu("dot.2", 0, 15, dev=1),
              {"ph": "M", "pid": 9, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 9, "tid": 1, "name": "thread_name", "args": {"name": "Stream #1"}},
              {"ph": "M", "pid": 9, "tid": 2, "name": "thread_name", "args": {"name": "Stream #2"}},
              gpu("ncclDevKernel_AllGather_RING_LL", 0, 10, 2), gpu("gemm_fusion", 5, 10, 1)]
    lanes = lanes_of(events)
    assert lanes["cpu:0"]["collective"] == [(10, 30)] and lanes["cpu:0"]["compute"] == [(20, 60)]  # no `while`
    assert lanes["/device:GPU:0"]["collective"] == [(0, 10)]
    result = overlap_of(lanes)
    assert result["collective_us"] == 30 and result["overlapped_us"] == 10 + 5
