"""The run directory: where a run lives, refusing to clobber one (or to share it), and what a resumed run may
change."""
from __future__ import annotations

import json
import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpar.checks import writable_dir
from jaxpar.config import ConfigError, config_from_dict, to_json
from jaxpar.train.runlock import LOCK_FILE, RunLock

METRICS = "metrics.jsonl"
# Fields a resumed run may not change: they change array shapes or the data order. Which kernel computes
# attention, the norm or the loss changes neither, so those may change.
RESUME_LOCKED = ("model", "data", "train.batch_size", "seed")
RESUME_FREE = ("model.attention", "model.norm", "model.loss", "model.attention_block_q", "model.attention_block_kv",
               "model.loss_chunk")


def default_run_dir(name: str) -> Path:
    """runs/<name>-<time>, with the time chosen by process 0 so all processes agree."""
    stamp = int(multihost_utils.broadcast_one_to_all(np.int64(int(time.time()))))
    return Path("runs") / f"{name}-{datetime.fromtimestamp(stamp).strftime('%Y%m%d-%H%M%S')}"


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool, restart: bool = False) -> bool:
    """Refuse to clobber a run, or to resume one that has nothing to resume.

    `restart` (`--auto-resume` found no checkpoint): a run directory holding a config.json and no saved step
    is a run that stopped before its first checkpoint; it may start again from step 0 (the caller compares
    the configs). Returns True when that is the case."""
    writable_dir(run_dir, "--run-dir")
    exists = run_dir.exists() and any(p.name != LOCK_FILE for p in run_dir.iterdir())
    if resume:
        if not (run_dir / "config.json").is_file() or not (run_dir / "checkpoints").is_dir():
            raise ConfigError("--resume", f"no checkpoint in '{run_dir}'; give the run directory of an "
                              "earlier run (--run-dir) or start a new run without --resume")
        if (run_dir / METRICS).is_file():
            metrics_records(run_dir / METRICS)   # damage before its last line is refused before anything is built
    elif restart and exists and (run_dir / "config.json").is_file() and not _saved_steps(run_dir):
        return True
    elif exists and not overwrite:
        raise ConfigError("--run-dir", f"'{run_dir}' already holds a run; pass --resume to continue it "
                          "or --overwrite to replace it")
    return False


def metrics_records(path: Path) -> tuple[list[tuple[str, dict]], int]:
    """metrics.jsonl's (line, record) pairs, and how many bytes of a torn tail were left out.

    A crash while the last line was written leaves a partial JSON object, or the NUL bytes ext4 fills an
    unwritten block with: that tail is left out (the resumed run logs those steps again). A damaged line
    before the last one is not a crash's work and is refused in one line."""
    raw = path.read_bytes()
    records, damaged, offset, good_end = [], None, 0, 0
    for number, line in enumerate(raw.split(b"\n"), 1):
        offset += len(line) + 1
        if not line.strip():
            continue
        try:
            record = json.loads(line)   # NUL bytes, a partial object, bytes that are not UTF-8: ValueError
        except ValueError:
            record = None
        if not isinstance(record, dict):
            damaged = damaged or number
            continue
        if damaged:
            raise ConfigError("--run-dir", f"line {damaged} of '{path}' is damaged (not a JSON record) and records "
                              "follow it; repair or delete that line and resume again")
        records.append((line.decode(), record))
        good_end = min(offset, len(raw))
    return records, (len(raw) - good_end) if damaged else 0


def lock_run_dir(lock: RunLock, run_dir: Path) -> None:
    """Process 0 takes `run_dir`'s lock (every process calls this, once every input is checked and before
    anything is written into the folder); a lock held by another run is refused on every process, in one line."""
    refusal = None
    if jax.process_index() == 0 and run_dir.is_dir():
        try:
            lock.acquire(run_dir)
        except ConfigError as err:
            refusal = err
    if int(multihost_utils.broadcast_one_to_all(np.int32(refusal is not None))) and refusal is None:
        refusal = ConfigError("--run-dir", f"'{run_dir}' is in use by another run (process 0 could not lock it)")
    if refusal is not None:
        raise refusal


def clear_run_dir(run_dir: Path) -> None:
    """`--overwrite`: delete the earlier run's files, keeping the lock this run holds."""
    for path in run_dir.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.name != LOCK_FILE:
            path.unlink()


def _saved_steps(run_dir: Path) -> list[str]:
    checkpoints = run_dir / "checkpoints"
    return [p.name for p in checkpoints.iterdir() if p.name.isdigit()] if checkpoints.is_dir() else []


def _without_free(values: dict) -> dict:
    values = json.loads(json.dumps(values))
    for field in RESUME_FREE:
        section, name = field.split(".")
        values.get(section, {}).pop(name, None)
    return values


def check_resume_config(config, saved: dict) -> None:
    """Refuse a resume that changes a locked field; `saved` is the run's config.json (fields added to jaxpar
    since then take their defaults)."""
    new = _without_free(json.loads(to_json(config)))
    saved = _without_free(json.loads(to_json(config_from_dict(saved))))
    for field in RESUME_LOCKED:
        old_value: Any = saved
        new_value: Any = new
        for part in field.split("."):
            old_value, new_value = old_value.get(part), new_value.get(part)
        if old_value != new_value:
            if isinstance(old_value, dict):
                changed = sorted(k for k in old_value if old_value.get(k) != new_value.get(k))
                field, old_value, new_value = f"{field}.{changed[0]}", old_value[changed[0]], new_value[changed[0]]
            raise ConfigError(field, f"was {old_value!r} in the run being resumed, now {new_value!r}; "
                              "a resumed run must keep shapes and data order (start a new run instead)")


def record_config(run_dir: Path, config) -> None:
    """Write the config a resumed run changed, keeping the earlier one beside it."""
    (run_dir / "config.json").rename(run_dir / f"config.before-resume-{int(time.time())}.json")
    (run_dir / "config.json").write_text(to_json(config))


def resume_config(run_dir: Path):
    return config_from_dict(json.loads((run_dir / "config.json").read_text()))
