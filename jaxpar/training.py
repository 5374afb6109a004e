"""The training run: run directory, data, sharded state, steps, metrics, checkpoints, sample.

It sits at the top of the package, beside the command line, because it wires every layer together:
the strategy (parallel/), the step pieces and checkpoints (train/), MFU and profiles (measure/), goodput
and metrics sinks (cluster/).

Host work stays off the hot path: each step is timed while the next one is queued
(train/progress.py), step metrics are kept on device and fetched once per logging
interval, checkpoints are written asynchronously.

Operations (module 6) live in their own modules and are called from here: a
non-finite guard (train/guard.py), preemption signals (train/preemption.py),
goodput accounting (cluster/goodput.py) and metrics sinks (cluster/metrics.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from jaxpar.cluster.goodput import Goodput, restart_count
from jaxpar.cluster.metrics import Sinks
from jaxpar.config import ConfigError, model_vocab_size, to_json
from jaxpar.data.pipeline import build_token_data, local_rows, to_global, train_dataset, val_batches
from jaxpar.measure.flops import Throughput
from jaxpar.measure.hardware import run_peak
from jaxpar.measure.profile import StepProfiler, parse_window
from jaxpar.mesh import describe, make_mesh
from jaxpar.model.counting import param_count, train_flops_per_token
from jaxpar.model.transformer import ModelConfig
from jaxpar.parallel.registry import make_strategy, select
from jaxpar.parallel.step import learning_rate
from jaxpar.train.checkpoint import Checkpoints, write_failed
from jaxpar.train.guard import NonFiniteGuard
from jaxpar.train.preemption import Preempted, Preemption
from jaxpar.train.progress import StepClock
from jaxpar.train.rundir import (
    check_resume_config,
    check_run_dir,
    clear_run_dir,
    default_run_dir,
    lock_run_dir,
    metrics_records,
    record_config,
)
from jaxpar.train.runlock import RunLock
from jaxpar.train.sample import END_OF_RUN, complete, sample_command

if TYPE_CHECKING:
    from collections.abc import Callable

    from ml_collections import ConfigDict

    from jaxpar.data.pipeline import TokenData
    from jaxpar.parallel.strategy import Strategy

console = Console(highlight=False, soft_wrap=True)   # no hard wraps: long lines stay one line under `launch`


def is_main() -> bool:
    return jax.process_index() == 0


def say(message: str) -> None:
    if is_main():
        console.print(message)


class MetricsLog:
    """metrics.jsonl in the run directory, written by process 0."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if is_main() and resume_step is not None and path.exists():
            records, torn = metrics_records(path)
            if torn:
                say(f"{path}: left out its torn last line ({torn} bytes written as the run stopped)")
            kept = [line for line, record in records if record.get("step", 0) <= resume_step]
            dropped = len(records) - len(kept)
            path.write_text("".join(line + "\n" for line in kept))
            if dropped:
                say(f"resumed at step {resume_step}: dropped {dropped} metrics lines logged after it")

    def write(self, record: dict) -> None:
        if is_main():
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def train(config, run_dir: Path | None = None, *, resume: bool = False, overwrite: bool = False,
          profile: str | None = None, metrics_port: int | None = None, metrics_linger_s: float = 0.0,
          metrics_host: str = "127.0.0.1", restart: bool = False) -> dict:
    """Train per `config`; returns a summary (losses, timings, goodput, run directory).

    `profile`: "START:END" traces those steps with jax.profiler into the run directory.
    `metrics_port`: serve Prometheus metrics on this port + the process index (`metrics_linger_s` more
    seconds after the end, so that the last scrape sees the final values), bound to `metrics_host` (loopback
    by default: the endpoint has no authentication).
    Raises `Preempted` after saving on SIGTERM/SIGUSR1, `NonFiniteError` on bad numbers, `SaveFailed` when a
    checkpoint cannot be written. `restart`: the run directory may hold this run's config and no checkpoint
    (a run that stopped before its first save, started again by `--auto-resume`): it starts again from step 0.
    """
    entered = time.time()
    # from the first line: a notice during start-up is not lost; the run directory's lock is let go on any exit
    with Preemption() as preemption, RunLock() as lock:
        return _train(config, run_dir, resume, overwrite, restart, profile, (metrics_port, metrics_host),
                      metrics_linger_s, entered, preemption, lock)


def _train(config, run_dir, resume, overwrite, restart, profile, metrics_address, metrics_linger_s, entered,
           preemption, lock) -> dict:
    """`train` once its preemption handlers are in place."""
    window = parse_window(profile, config.train.steps)
    run_dir = Path(run_dir) if run_dir else default_run_dir(config.name)
    restart = check_run_dir(run_dir, resume, overwrite, restart)
    saved_config = json.loads((run_dir / "config.json").read_text()) if resume or restart else None
    if saved_config is not None:
        check_resume_config(config, saved_config)
    mesh = make_mesh(config, resumed=saved_config is not None)  # validates the config before any compile
    select(config, dict(mesh.shape))  # the strategy exists and accepts this config
    peak = run_peak(config.train.compute_dtype)   # now, before any compile competes for the cores
    data = build_token_data(config.data)
    model_cfg = ModelConfig.from_config(config.model, model_vocab_size(config, data.stats["vocab_size"],
                                                                       mesh.shape["tensor"]))
    strategy = make_strategy(config, model_cfg, mesh)
    # Every input is checked; only now does anything touch the run directory.
    multihost_utils.sync_global_devices("jaxpar-inputs-checked")
    preemption.stop_if_requested("before the run directory was written")
    if is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
    lock_run_dir(lock, run_dir)   # no other run may use it from here on; nothing was written into it yet
    if restart:
        say(f"no checkpoint in {run_dir}: the run stopped before its first save; starting it again from step 0")
    # A changed config (e.g. more steps, --set) is written with the first checkpoint saved under it: a resume
    # that fails before that leaves config.json as it was, so the next resume does not repeat the failure.
    config_changed = saved_config is not None and json.loads(to_json(config)) != saved_config
    if is_main():
        if overwrite and not resume:
            clear_run_dir(run_dir)
        if not config_changed:
            (run_dir / "config.json").write_text(to_json(config))
        data.tokenizer.save(str(run_dir / "tokenizer.json"))
    multihost_utils.sync_global_devices("jaxpar-run-dir-ready")
    s = data.stats
    say(f"corpus: {s['documents']:,} documents, {s['characters']:,} characters, {s['words']:,} words, "
        f"{s['tokens']:,} tokens ({s['tokens_per_word']:.2f} tokens/word, vocab {s['vocab_size']:,}); "
        f"{s['train_sequences']:,} train / {s['val_sequences']:,} val sequences of {config.data.seq_len}")
    counts = param_count(model_cfg)
    say(f"model: {counts['total'] / 1e6:.2f}M parameters ({counts['non_embedding'] / 1e6:.2f}M non-embedding), "
        f"{model_cfg.layers} layers, d_model {model_cfg.d_model}; mesh: {describe(mesh)} over "
        f"{jax.device_count()} {jax.devices()[0].platform} devices in {jax.process_count()} process(es)")

    rows = local_rows(strategy.batch_sharding, config.train.batch_size, config.data.seq_len + 1)
    validation = [to_global(b, strategy.batch_sharding, config.train.batch_size)
                  for b in val_batches(data.val, config.train.batch_size, config.train.eval_batches, rows)]
    checkpoints = Checkpoints(run_dir / "checkpoints", config.train.keep_checkpoints, notice=say)
    start, state = _initial_state(strategy, checkpoints, config.train.batch_size, resume, preemption, lock)
    # The data position is global: the run continues at global batch `start`, whatever the process count.
    iterator = iter(train_dataset(data.train, config.train.batch_size, config.data.shuffle_seed, rows, start))
    continued = start if resume or restart else None   # a restart from step 0 drops what the lost attempt logged
    metrics_log = MetricsLog(run_dir / "metrics.jsonl", continued)
    goodput = Goodput(run_dir / "goodput.json", continued, write=is_main(), entered=entered)
    sinks = Sinks(metrics_address, run_dir / "tensorboard" if config.train.tensorboard and is_main() else None,
                  jax.process_index())
    guard = NonFiniteGuard(config.train.max_bad_steps)
    goodput.add("startup_compile", time.time() - goodput.start)
    try:
        preemption.stop_if_requested(f"before step {start + 1}")
        run = _Run(config, run_dir, strategy, data, model_cfg, validation, checkpoints, metrics_log, goodput, sinks,
                   guard, preemption, lock, counts, config_changed)
        return _loop(run, state, start, iterator, window, peak)
    except OSError as err:   # e.g. the run directory deleted mid-run: one line, exit 74
        failed = write_failed(err, run_dir)
        if failed is err:   # not a file of the run directory
            raise
        raise failed from None
    finally:
        checkpoints.close()   # also after an error, so that no Orbax thread outlives the run
        sinks.close(metrics_linger_s)


def _initial_state(strategy, checkpoints, batch_size: int, resume: bool, preemption, lock) -> tuple[int, dict]:
    """(step, state): the last intact checkpoint's, or step 0's. Nothing new exists meanwhile: a notice ends the
    process at once, also while XLA compiles the initialisation."""
    if not resume:
        with preemption.exits_at_once("initialising the state", lock.release):
            return 0, strategy.init_state()
    with preemption.exits_at_once("restoring the last checkpoint", lock.release):
        start, state = checkpoints.restore(strategy.abstract_state)
    if start is None:
        raise ConfigError("--resume", f"no intact checkpoint in '{checkpoints.directory}' "
                          "(every step is damaged or unreadable); start a new run")
    checkpoints.set_aside_damaged()
    say(f"resumed from step {start} (global sample {start * batch_size:,}) on "
        f"{jax.process_count()} process(es) x {jax.local_device_count()} devices")
    return start, state


@dataclasses.dataclass
class _Run:
    """Everything the step loop works with, built and checked by `_train` before the first step."""
    config: ConfigDict
    run_dir: Path
    strategy: Strategy
    data: TokenData
    model_cfg: ModelConfig
    validation: list
    checkpoints: Checkpoints
    metrics_log: MetricsLog
    goodput: Goodput
    sinks: Sinks
    guard: NonFiniteGuard
    preemption: Preemption
    lock: RunLock
    counts: dict
    config_changed: bool = False   # config.json still holds the resumed run's config: written at the first save


@dataclasses.dataclass
class _Tally:
    """The loop's running state: losses so far, the steps not logged yet, and the current logging interval
    (its start, its steps, and the host time spent beside the steps, which stays out of the step times)."""
    throughput: Throughput
    schedule: Callable[[int], float]
    clock: StepClock = dataclasses.field(init=False)   # set by `_loop` once its progress bar exists
    losses: dict = dataclasses.field(default_factory=dict)
    pending: list = dataclasses.field(default_factory=list)
    val_loss: float | None = None
    evaluated: float | None = None     # a validation loss not printed yet
    compile_s: float | None = None
    interval_start: float = dataclasses.field(default_factory=time.perf_counter)
    interval_steps: int = 0
    excluded: float = 0.0

    def new_interval(self) -> None:
        self.interval_start, self.interval_steps, self.excluded = time.perf_counter(), 0, 0.0


def _loop(run: _Run, state, start: int, iterator, window, peak) -> dict:
    """The step loop of `train` (everything it needs is built and checked)."""
    config, t = run.config, run.config.train
    tokens_per_step = t.batch_size * config.data.seq_len
    throughput = Throughput(train_flops_per_token(run.model_cfg, config.data.seq_len) * tokens_per_step,
                            tokens_per_step, jax.device_count(), peak, notice=say)
    say(throughput.describe())
    fault_here = (t.fault_at_step and restart_count() == 0
                  and t.fault_process in (-1, jax.process_index()))   # first attempt only
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                        console=console, disable=not (is_main() and console.is_terminal))
    profiler = StepProfiler(window, run.run_dir / "profile")
    tally = _Tally(throughput, learning_rate(t))
    step, preempted = start, False
    with progress:
        task = progress.add_task("training", total=t.steps, completed=start)
        tally.clock = StepClock(lambda finished: progress.update(task, completed=finished))   # moves every step
        for step in range(start + 1, t.steps + 1):
            state = _step(run, tally, profiler, state, iterator, step)
            if tally.compile_s is None:
                _first_step_timed(run, tally)
            last = step == t.steps
            preempted = run.preemption.reached(step)
            evaluate = step % t.eval_every == 0 or last
            save = step % t.checkpoint_every == 0 or last or preempted
            if evaluate or save:  # evaluation and checkpointing stay out of the step times
                _evaluate_and_save(run, tally, state, step, evaluate, save)
            if step % t.log_every == 0 or step == start + 1 or last or step == t.fault_at_step or preempted:
                _log_interval(run, tally, step)
                progress.update(task, completed=step, description=f"loss {tally.losses[step]:.3f}")
            if fault_here and step == t.fault_at_step:  # a crash between checkpoints: later steps are lost
                _inject_fault(run, step)
            if preempted:
                break
    return _finish(run, tally, state, step, preempted)


def _step(run: _Run, tally: _Tally, profiler: StepProfiler, state, iterator, step: int):
    """One training step: its batch, the (maybe profiled) update, and the non-finite guard; returns the state."""
    t, guard = run.config.train, run.guard
    side_start = time.perf_counter()
    batch = to_global(next(iterator), run.strategy.batch_sharding, t.batch_size)
    waited = time.perf_counter() - side_start
    run.goodput.add("data_wait", waited)
    tally.excluded += waited
    before = state if not (guard.skips and run.strategy.donate_argnums) else jax.tree.map(jnp.copy, state)
    side_start = time.perf_counter()
    profiler.before(step)
    tally.excluded += time.perf_counter() - side_start
    dispatched = time.perf_counter()
    # the first step compiles (seconds to minutes): nothing new exists yet, so a notice meanwhile ends it at once
    compiling = tally.compile_s is None
    with profiler.annotate(step), (run.preemption.exits_at_once(f"compiling step {step}", run.lock.release)
                                   if compiling else contextlib.nullcontext()):
        state, metrics = run.strategy.step(state, batch)
    tally.clock.dispatched(step, metrics, dispatched)
    if profiler.stops_after(step):
        tally.clock.wait()   # the traced step's own time stays in the step times
    side_start = time.perf_counter()
    profiled = profiler.after(step, state)
    if profiled and is_main():
        (run.run_dir / "profile_summary.md").write_text(profiled["markdown"] + "\n")
        (run.run_dir / "profile_summary.json").write_text(json.dumps(profiled, indent=2))
        say(profiled["markdown"])
    if profiled:
        tally.excluded += time.perf_counter() - side_start
    if guard.skips and guard.is_bad(step, metrics):   # undo the step (its batch is consumed)
        say(f"step {step}: non-finite loss or gradient norm; update skipped "
            f"({len(guard.bad_steps)}/{t.max_bad_steps} allowed)")
        state = before
    else:
        guard.after_step(step, metrics)
    tally.pending.append((step, metrics))
    tally.interval_steps += 1
    run.goodput.stepped(step)
    return state


def _first_step_timed(run: _Run, tally: _Tally) -> None:
    """The first step includes the compile: book it as start-up and start the first logging interval after it.
    Until it ends nothing new exists, and a peer may still be compiling: a notice ends the process at once."""
    with run.preemption.exits_at_once("running the first step", run.lock.release):
        tally.clock.wait()
    tally.compile_s = time.perf_counter() - tally.interval_start
    run.goodput.add("startup_compile", tally.compile_s - tally.excluded)
    say(f"first step (compile + run): {tally.compile_s:.1f} s")
    tally.new_interval()


def _evaluate_and_save(run: _Run, tally: _Tally, state, step: int, evaluate: bool, save: bool) -> None:
    """The validation loss and/or a checkpoint after `step`, timed outside the step times."""
    tally.clock.wait()
    jax.block_until_ready(state)
    run.guard.flush()     # a non-finite state is never saved
    side_start = time.perf_counter()
    if evaluate:
        tally.val_loss = tally.evaluated = float(np.mean([float(run.strategy.evaluate(state["params"], b))
                                                          for b in run.validation]))
        run.metrics_log.write({"step": step, "val_loss": tally.val_loss})
        run.sinks.log(step, {"val_loss": tally.val_loss})
    if save:
        run.guard.check_state(step, state)   # nor an exploded one
        save_start = time.perf_counter()
        run.checkpoints.save(step, state, run.config.train.batch_size)
        if run.config_changed:
            run.checkpoints.wait()   # the first step saved under the changed config is on disk: record it
            if is_main():
                record_config(run.run_dir, run.config)
            run.config_changed = False
        saved_s = time.perf_counter() - save_start
        run.goodput.add("checkpoint", saved_s)
        run.goodput.saved(step)
        run.sinks.checkpoint(saved_s)
    tally.excluded += time.perf_counter() - side_start


def _log_interval(run: _Run, tally: _Tally, step: int) -> None:
    """Fetch the interval's step metrics once, write them, and print one console line; start a new interval."""
    times = tally.clock.take()      # each step's own time (process 0's on every process)
    fetched = jax.device_get([m for _, m in tally.pending])
    elapsed = time.perf_counter() - tally.interval_start - tally.excluded
    if tally.interval_steps:
        run.goodput.add("productive", elapsed)
    throughput = tally.throughput
    for (s_, _), m in zip(tally.pending, fetched):
        tally.losses[s_] = float(m["loss"])
        record = {"step": s_, **{k: np.asarray(v).tolist() for k, v in m.items()},
                  "lr": float(tally.schedule(s_ - 1)), **throughput.step(s_, times.get(s_)),
                  "time": tally.clock.ended.pop(s_)}   # when the step finished, not when this was written
        run.metrics_log.write(record)
        if record["step_time_s"]:
            run.sinks.step_times(record["step_time_s"], 1)
    timed = [seconds for seconds in times.values() if seconds]
    interval = throughput.step(step, float(np.mean(timed))) if timed else {}  # the console's average
    run.sinks.log(step, {**record, **interval})
    run.sinks.goodput(step, run.goodput.flush())
    message = f"step {step:>5}/{run.config.train.steps}  loss {tally.losses[step]:.4f}"
    if tally.evaluated is not None:  # printed once, never repeated stale
        message += f"  val {tally.evaluated:.4f}"
        tally.evaluated = None
    if interval:
        message += f"  {interval['step_time_s'] * 1e3:.0f} ms/step  {interval['tokens_per_s']:,.0f} tok/s"
    if interval.get("mfu") is not None:
        message += f"  MFU {interval['mfu']:.1%}"
    say(message)
    tally.pending = []
    tally.new_interval()


def _inject_fault(run: _Run, step: int) -> None:
    """train.fault_at_step: kill this process with train.fault_signal once the checkpoints are on disk."""
    t = run.config.train
    run.checkpoints.wait()
    console.print(f"fault injection: {t.fault_signal} to process {jax.process_index()} after step {step}")
    os.kill(os.getpid(), getattr(signal, t.fault_signal))


def _finish(run: _Run, tally: _Tally, state, step: int, preempted: bool) -> dict:
    """After the last step (or a preemption): wait for the checkpoints, sample, report goodput, write the summary."""
    t, run_dir, goodput = run.config.train, run.run_dir, run.goodput
    run.guard.flush()
    wait_start = time.perf_counter()
    run.checkpoints.close()
    goodput.add("checkpoint", time.perf_counter() - wait_start)
    if preempted and step < t.steps:
        totals = goodput.flush()
        run.preemption.leave_after_save(step)   # durable on every process; process 0 leaves last
        raise Preempted(f"preempted: saved a checkpoint at step {step} of {t.steps} and stopped "
                        f"(goodput so far {totals['goodput']:.1%}); start the run again to resume")
    say(tally.throughput.describe())

    sample_text = None
    if t.sample_tokens > 0:
        sample_text = sample_from_state(state["params"], run.model_cfg, run.data.tokenizer, t.sample_prompt,
                                        t.sample_tokens, run.config.data.seq_len)
        say(f"sample ({END_OF_RUN.describe()}): {t.sample_prompt}{sample_text}")
    totals = goodput.flush(finished=True)
    badput = ", ".join(f"{k} {v:.1f} s" for k, v in totals["badput_s"].items())
    say(f"goodput {totals['goodput']:.1%} of {totals['wall_s']:.1f} s wall ({totals['restarts']} restarts, "
        f"{totals['redone_steps']} re-done steps); badput: {badput}")
    command = sample_command(run_dir, t.sample_prompt, t.sample_tokens, END_OF_RUN)
    summary = {"run_dir": str(run_dir), "losses": tally.losses, "final_val_loss": tally.val_loss,
               "compile_s": tally.compile_s, "params": run.counts["total"], "sample": sample_text,
               "sample_command": command, **tally.throughput.summary(), "goodput": totals}
    if is_main():
        (run_dir / "summary.json").write_text(json.dumps(summary, ensure_ascii=False, indent=2))
    say(f"run directory: {run_dir}")
    say(f"sample again: {command}")
    return summary


def sample_from_state(params, model_cfg, tokenizer, prompt: str, max_new_tokens: int, buffer_len: int) -> str:
    """Gather the (possibly sharded, possibly multi-process) params and decode on one device."""
    host_params = multihost_utils.process_allgather(params, tiled=True)
    return complete(host_params, model_cfg, tokenizer, prompt, max_new_tokens, buffer_len,
                    **dataclasses.asdict(END_OF_RUN))
