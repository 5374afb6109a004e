"""Profile a window of training steps with `jax.profiler`, and summarise the trace.

The trace (TensorBoard xplane + Perfetto JSON) lands in `<run_dir>/profile`;
the summary (top ops by total time, and the share spent in collectives where
the trace shows them) is printed and written as `profile_summary.md/json`.
The trace files are Chrome trace-event JSON, so no TensorBoard is needed.
"""
from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

import jax

from jaxpar.config import ConfigError

COLLECTIVE = re.compile(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|"
                        r"allreduce|allgather|reducescatter|alltoall|nccl", re.IGNORECASE)


def parse_window(text: str | None, steps: int) -> tuple[int, int] | None:
    """'START:END' (1-based, inclusive) -> (start, end); None when not profiling."""
    if not text:
        return None
    try:
        start, end = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError("--profile", f"'{text}' is not START:END, e.g. --profile 5:8") from None
    if not 1 <= start <= end <= steps:
        raise ConfigError("--profile", f"'{text}' must satisfy 1 <= START <= END <= train.steps={steps}")
    return start, end


class StepProfiler:
    """Starts a trace before step `start` and stops it after step `end`."""

    def __init__(self, window: tuple[int, int] | None, out_dir: Path):
        self.window, self.out_dir, self.active = window, Path(out_dir), False

    def before(self, step: int) -> None:
        if self.window and step == self.window[0]:
            options = jax.profiler.ProfileOptions()
            options.host_tracer_level = 3  # on CPU, XLA's ops are host events: level 3 shows them
            jax.profiler.start_trace(str(self.out_dir), create_perfetto_trace=True, profiler_options=options)
            self.active = True

    def annotate(self, step: int):
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def stops_after(self, step: int) -> bool:
        return self.active and self.window is not None and step == self.window[1]

    def after(self, step: int, state) -> dict | None:
        if self.active and self.window is not None and step == self.window[1]:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.active = False
            return summarize(self.out_dir, steps=self.window[1] - self.window[0] + 1)
        return None


def trace_events(profile_dir: Path) -> list[dict]:
    """Complete events ('X') of XLA's compiled ops: GPU stream events, or on CPU the XLA executor threads."""
    files = sorted(Path(profile_dir).rglob("*.trace.json.gz"))
    if not files:
        return []
    with gzip.open(files[-1]) as f:
        events = json.load(f).get("traceEvents", [])
    processes = {e["pid"]: e["args"].get("name", "") for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"].get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}

    def is_op(e):
        if e.get("ph") != "X" or "dur" not in e or e["name"].startswith("ThunkExecutor"):
            return False
        if processes.get(e["pid"], "").startswith("/device:"):
            return True
        return threads.get((e["pid"], e.get("tid")), "").startswith("tf_XLAEigen")

    return [e for e in events if is_op(e)]


def self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """Each event with its exclusive time: its duration minus that of events nested in it (same thread)."""
    out = []
    by_thread = defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e.get("tid"))].append(e)
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, self_time]
        for e in thread_events:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                out.append(tuple(stack.pop()))
            if stack:
                stack[-1][1] -= e["dur"]
            stack.append([e, float(e["dur"])])
        out.extend(tuple(item) for item in stack)
    return out


def outermost(events: list[dict]) -> list[dict]:
    """The events not nested inside another of `events` on the same thread."""
    return [e for e, _ in self_times(events) if not any(
        o is not e and o["pid"] == e["pid"] and o.get("tid") == e.get("tid")
        and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"] for o in events)]


def summarize(profile_dir: Path, steps: int, top: int = 15) -> dict:
    """Top compiled ops by exclusive time per step (summed over devices); collective time vs the rest.

    A collective's time includes what is nested in it (rendezvous, waiting for peers).
    """
    events = trace_events(profile_dir)
    total: defaultdict[str, float] = defaultdict(float)
    count: defaultdict[str, int] = defaultdict(int)
    for e, exclusive in self_times(events):
        name = re.sub(r"=\d+/\d+", "", e["name"])  # "Wait: pending_threads=3/8" -> one row
        total[name] += exclusive
        count[name] += 1
    op_time = sum(total.values())
    collectives = [e for e in events if COLLECTIVE.search(e["name"])]
    collective_time = sum(e["dur"] for e in outermost(collectives))
    ops = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    summary = {
        "steps": steps,
        "op_ms_per_step": op_time / 1e3 / steps,
        "collective_ms_per_step": collective_time / 1e3 / steps,
        "collective_fraction": collective_time / op_time if op_time else None,
        "top_ops": [{"name": n, "ms_per_step": t / 1e3 / steps, "calls_per_step": count[n] / steps} for n, t in ops],
    }
    share = f"{summary['collective_fraction']:.1%}" if op_time else "n/a"
    lines = [f"profile of {steps} steps: compiled ops {summary['op_ms_per_step']:.1f} ms per step summed over "
             f"devices, of which collectives {summary['collective_ms_per_step']:.1f} ms ({share})",
             "", "| op | ms per step | calls per step |", "|---|---:|---:|"]
    lines += [f"| {o['name'][:70]} | {o['ms_per_step']:.2f} | {o['calls_per_step']:.1f} |" for o in summary["top_ops"]]
    summary["markdown"] = "\n".join(lines)
    return summary
