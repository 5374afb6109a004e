"""Lab 06: the same Llama in PyTorch and in jaxpar, side by side: DDP, FSDP2, tensor (and sequence) parallelism
and a pipeline on N local CPU processes, each beside jaxpar's automatic and hand-written counterpart.

experiments/06_pytorch/README.md is the sheet. The lab:

1. makes the inputs once, with jaxpar: the token batches (jaxpar's data pipeline), the initial weights
   (jaxpar's init, exported as a Hugging Face Llama, `model/hf.py`), the learning rate of every step
   (jaxpar's schedule) and the weight-decay mask (jaxpar's, mapped to Hugging Face names);
2. runs the PyTorch side (`torch_worker`: N gloo processes, `torch_parallel`'s strategies) and the
   jaxpar side (`jax_side`: one process with N virtual CPU devices), each in a subprocess;
3. compares per pair: losses (fp32, against each side's one-device run and across frameworks), bytes
   per collective kind beside the formula, memory per rank, step time (CPU), and the lines of
   parallelism-specific code each side's user writes. Files in --out: raw/ (the inputs and each side's
   results, written as they come), report.md and results.json, then losses.png and bytes.png.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from jaxpar.config import ConfigError, apply_overrides, load_config, model_vocab_size
from jaxpar.labs.arguments import add_quick
from jaxpar.labs.base import report
from jaxpar.labs.base.results import draw_plots, write_report
from jaxpar.labs.base.runner import run_directory, standalone_main
from jaxpar.labs.pytorch.pairs import PAIRS, TOLERANCE, code_lines
from jaxpar.labs.pytorch.sheet import (
    NOTES,
    PLOTS,
    header,
    md_communication,
    md_equivalence,
    md_lines,
    md_memory,
    md_time,
    rss_line,
)

PROFILED_STEP = 2          # the torch step run under the profiler (bytes, memory), left out of the times
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"     # PyTorch's own index of its CPU-only wheels
QUICK_PAIRS = ("tp-sp", "1f1b")     # a DTensor strategy with both jaxpar counterparts, a pipeline with one


# ============================================================================ 1. the shared inputs

def lab_config(config, steps: int, vocab: int):
    """fp32, no accumulation or remat, every axis 1 and automatic: the variants add their own settings."""
    c = copy.deepcopy(config)
    apply_overrides(c, lab_overrides(steps, vocab))
    return c


def lab_overrides(steps: int, vocab: int) -> list[str]:
    return [f"train.steps={steps}", "train.compute_dtype=float32", "train.microbatches=1", "train.remat=none",
            f"model.vocab_size={vocab}", "mesh.data=1", "mesh.fsdp=1", "mesh.pipe=1", "mesh.tensor=1",
            "mesh.expert=1", "parallel.data=auto", "parallel.tensor=auto", "parallel.pipe=auto",
            "parallel.sequence=false", "parallel.rules="]


def variants(pairs, n: int, m: int) -> dict[str, list[str]]:
    """jaxpar's runs: the one-device oracle, then each pair's automatic and hand-written counterpart."""
    out: dict[str, list[str]] = {"single": []}
    for key in pairs:
        _, _, auto, manual = PAIRS[key]
        for kind, overrides in (("auto", auto), ("manual", manual)):
            if overrides is not None:
                out[f"{key}/{kind}"] = [o.format(n=n, m=m) for o in overrides]
    return out


def decayed_names(params, cfg) -> list[str]:
    """The Hugging Face names of the parameters jaxpar's AdamW decays (`parallel.step.decay_mask`)."""
    from jaxpar.model.hf import _LAYER_EXPORT
    from jaxpar.parallel.step import decay_mask
    mask = decay_mask(params)
    names = [name for key, name in (("embed", "model.embed_tokens.weight"), ("final_norm", "model.norm.weight"),
                                    ("lm_head", "lm_head.weight")) if mask.get(key)]
    return names + [f"model.layers.{i}.{_LAYER_EXPORT[key][0]}" for key, decayed in mask["blocks"].items()
                    if decayed for i in range(cfg.layers)]


def prepare(config, data, steps: int, out: Path) -> tuple[ConfigDict, dict]:
    """The lab's config and what both sides read (`data`: jaxpar's TokenData): batches.npz and hf/ in `out`,
    jaxpar's optimizer as numbers."""
    from jaxpar.data.pipeline import train_dataset
    from jaxpar.model.hf import export_hf_llama
    from jaxpar.model.transformer import ModelConfig, init_params
    from jaxpar.parallel.step import learning_rate

    config = lab_config(config, steps, model_vocab_size(config, data.stats["vocab_size"], 1))
    cfg = ModelConfig.from_config(config.model)
    B = config.train.batch_size
    stream = iter(train_dataset(data.train, B, config.data.shuffle_seed, slice(0, B)))
    np.savez(out / "batches.npz", batches=np.stack([np.asarray(next(stream)) for _ in range(steps)]))
    params = init_params(cfg, config.seed)
    export_hf_llama(params, cfg, out / "hf")
    t = config.train
    schedule = learning_rate(t)
    hyper = {"lrs": [float(schedule(i)) for i in range(steps)], "b1": t.b1, "b2": t.b2, "eps": t.eps,
             "weight_decay": t.weight_decay, "grad_clip": t.grad_clip, "decayed": decayed_names(params, cfg)}
    return config, {"batches": str(out / "batches.npz"), "hf_dir": str(out / "hf"), "hyper": hyper}


# ============================================================================ 2. both sides, in subprocesses

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: list[str], what: str, log) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode:
        raise RuntimeError(f"the {what} side failed (exit {done.returncode}):\n{done.stdout[-3000:]}"
                           f"{done.stderr[-3000:]}")
    for line in done.stdout.splitlines():
        if line.startswith("  jaxpar "):
            log(line)
    return time.perf_counter() - start


def run_torch(inputs: dict, strategies: list[str], n: int, m: int, work: Path, log=print,
              check_transformers: bool = True) -> dict:
    """Every strategy on n gloo processes ("single": rank 0 alone, the one-device oracle); results by rank."""
    spec = {**inputs, "processes": n, "port": _free_port(), "microbatches": m, "strategies": strategies,
            "profile_step": PROFILED_STEP, "check_transformers": check_transformers,
            "comm_debug_mode": ["fsdp2", "tp", "tp-sp"]}     # the DTensor strategies
    (work / "torch_spec.json").write_text(json.dumps(spec))
    seconds = _run(["jaxpar.labs.pytorch.torch_worker", str(work / "torch_spec.json"), str(work)], "PyTorch", log)
    ranks = [json.loads((work / f"torch-rank{r}.json").read_text()) for r in range(n)]
    return {"ranks": ranks, "seconds": seconds}


def run_jaxpar(config_path, overrides: list[str], inputs: dict, runs: dict, n: int, work: Path, log=print) -> dict:
    spec = {"config": config_path, "overrides": overrides, "batches": inputs["batches"], "variants": runs}
    (work / "jaxpar_spec.json").write_text(json.dumps(spec))
    seconds = _run(["jaxpar.labs.pytorch.jax_side", str(work / "jaxpar_spec.json"), str(work / "jaxpar.json"), str(n)],
                   "jaxpar", log)
    return {"runs": json.loads((work / "jaxpar.json").read_text()), "seconds": seconds}


# ============================================================================ 3. comparing

def median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times[1:] if len(times) > 1 else times)


def torch_summary(ranks: list[dict], key: str, n: int) -> dict:
    """One torch strategy across ranks: rank 0's losses, the mean bytes per rank, the largest memory."""
    runs = [r[key] for r in ranks if key in r]
    sent: dict[str, float] = {}
    calls: dict[str, float] = {}
    asked: dict[str, float] = {}
    for r in runs:
        for kind, value in r["trace"]["sent"].items():
            sent[kind] = sent.get(kind, 0.0) + value / len(runs)
        for kind, value in r["trace"]["calls"].items():
            calls[kind] = calls.get(kind, 0.0) + value / len(runs)
        for kind, value in r["trace"]["asked"].items():
            asked[kind] = asked.get(kind, 0.0) + value / len(runs)
    return {"losses": runs[0]["losses"], "grad_norms": runs[0]["grad_norms"],
            "step_ms": max(median_ms(r["step_s"]) for r in runs),
            "sent": sent, "calls": calls, "asked": asked, "comm_debug_mode": runs[0]["trace"].get("comm_debug_mode"),
            "state_bytes": max(sum(r["state"].values()) for r in runs),
            "state": runs[0]["state"],
            "peak_step_bytes": max(r["trace"]["peak_allocated"] for r in runs)}


def formulas(pairs, counts: dict, config, n: int) -> dict:
    """Per pair: the course's bytes per rank per step (fp32, ring model) and what the PyTorch code as written
    sends on gloo (reduce-scatters run as all-reduces), each as (bytes, how it is made)."""
    W, W_L = 4 * counts["total"], 4 * counts["blocks"]
    b, s, h, L = config.train.batch_size, config.data.seq_len, config.model.d_model, config.model.layers
    r = (n - 1) / n
    u = r * 4 * b * s * h                     # one all-gather or reduce-scatter of the [b, s, h] stream
    p2p = 2 * (n - 1) * b * s * h * 4 / n     # activations forward, their gradients backward, per rank
    tp = (8 * L + 4) * u
    table = {
        "ddp": ((2 * r * W, "all-reduce of the gradient: 2(N-1)/N·4Ψ"), (2 * r * W, "the same")),
        "fsdp2": ((3 * r * W, "3(N-1)/N·4Ψ: params gathered forward and backward, gradients reduce-scattered"),
                  (r * (W + W_L) + 2 * r * W, "(N-1)/N·(4Ψ_o + 2·4Ψ_L) gathers (the root module stays "
                   "gathered after forward) + 2(N-1)/N·4Ψ (reduce-scatter run as all-reduce)")),
        "tp": ((tp, "(8L+4)·u: 4 all-reduces of b·s·h per layer, embedding and head 1 each"),
               (tp, "the same (+ the vocabulary-parallel loss: 3 all-reduces of b·s numbers)")),
        "tp-sp": ((tp, "(8L+4)·u: the same bytes as all-gathers + reduce-scatters of b·s·h"),
                  ((4 * L + 2) * u * 3, "(4L+2)·u all-gathers + (4L+2)·2u reduce-scatters run as all-reduces")),
        "gpipe": ((p2p, "2(p-1)·b·s·h·4 / p: every microbatch's activations and gradients once"),
                  (p2p, "the same")),
        "1f1b": ((p2p, "the same as GPipe"), (p2p, "the same")),
    }
    return {key: table[key] for key in pairs} | {"_u": u, "_W": W}


def compare(pairs, torch_runs: dict, jax_runs: dict, n: int) -> dict:
    """Every row of every table: per pair the PyTorch run and jaxpar's automatic and hand-written one."""
    t_single, j_single = torch_runs["single"], jax_runs["single"]
    rows = {"single": [dict(side="PyTorch", name="one process", **t_single),
                       dict(side="jaxpar", name="one device", **j_single)]}
    for key in pairs:
        api = PAIRS[key][0]
        rows[key] = [dict(side="PyTorch", name=api, **torch_runs[key])]
        for kind in ("auto", "manual"):
            if f"{key}/{kind}" in jax_runs:
                run = jax_runs[f"{key}/{kind}"]
                rows[key].append(dict(side="jaxpar", name=" ".join(run["overrides"]), **run))
    for group in rows.values():
        for row in group:
            own, other = (t_single, j_single) if row["side"] == "PyTorch" else (j_single, t_single)
            row["dev_own"] = report.max_rel_dev(row["losses"], own["losses"])
            row["dev_other"] = report.max_rel_dev(row["losses"], other["losses"])
            row["dev_pair"] = report.max_rel_dev(row["losses"], group[0]["losses"])   # group[0]: PyTorch's run
            row["within"] = max(row["dev_own"], row["dev_other"], row["dev_pair"]) <= TOLERANCE
    return rows


def jax_summary(run: dict) -> dict:
    return {**run, "step_ms": median_ms(run["step_s"]), "sent": run["comm"]["sent"], "calls": run["comm"]["calls"]}


# ============================================================================ the whole lab

def check(config, pairs, steps: int, n: int, m: int, vocab: int) -> None:
    """Every bad argument or config, one line (ConfigError), before anything is run or written."""
    from jaxpar.config import validate
    if steps < PROFILED_STEP + 2:
        raise ConfigError("--steps", f"is {steps}; must be at least {PROFILED_STEP + 2} (step {PROFILED_STEP + 1} "
                          "is profiled and left out of the times)")
    if n < 2:
        raise ConfigError("--processes", f"is {n}; must be at least 2")
    if m < n:
        raise ConfigError("--microbatches", f"is {m}; must be at least --processes={n} (1F1B's warm-up)")
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        raise ConfigError("--pairs", f"{','.join(unknown)} unknown; choose from {','.join(PAIRS)}")
    base = lab_config(config, steps, vocab)
    for overrides in variants(pairs, n, m).values():
        c = copy.deepcopy(base)
        apply_overrides(c, overrides)
        validate(c, n if overrides else 1)
        if c.train.batch_size % (n * m):
            raise ConfigError("train.batch_size", f"is {c.train.batch_size}; must divide by --processes x "
                              f"--microbatches = {n * m}")


def run_lab(config_path, overrides: list[str], out=None, *, steps: int = 10, processes: int = 2,
            microbatches: int = 4, pairs=tuple(PAIRS), log=print) -> dict:
    """Run both sides of every pair; write raw/ (inputs, each side's results), report.md, results.json, then
    losses.png and bytes.png into `out`."""
    from jaxpar.data.pipeline import build_token_data
    from jaxpar.model.counting import param_count
    from jaxpar.model.transformer import ModelConfig
    start, n, m, pairs = time.perf_counter(), processes, microbatches, list(pairs)
    config = load_config(config_path)
    apply_overrides(config, overrides)
    data = build_token_data(config.data)
    vocab = model_vocab_size(config, data.stats["vocab_size"], 1)
    check(config, pairs, steps, n, m, vocab)
    out = run_directory(out, "pytorch")
    work = out / "raw"                 # the inputs and each side's raw results stay: a failure later loses nothing
    work.mkdir(parents=True, exist_ok=True)
    parts = {}
    t0 = time.perf_counter()
    config, inputs = prepare(config, data, steps, work)
    parts["inputs"] = time.perf_counter() - t0
    log(f"lab pytorch: {n} processes / devices, {steps} steps, pairs {', '.join(pairs)}")
    torch_side = run_torch(inputs, ["single", *(PAIRS[k][1] for k in pairs)], n, m, work, log)
    parts["PyTorch side"] = torch_side["seconds"]
    lab_sets = [*overrides, *lab_overrides(steps, vocab)]
    jax_side = run_jaxpar(config_path, lab_sets, inputs, variants(pairs, n, m), n, work, log)
    parts["jaxpar side"] = jax_side["seconds"]
    torch_runs = {key: torch_summary(torch_side["ranks"], PAIRS[key][1] if key != "single" else key, n)
                  for key in ["single", *pairs]}
    jax_runs = {key: jax_summary(run) for key, run in jax_side["runs"].items() if key != "_process"}
    rows = compare(pairs, torch_runs, jax_runs, n)
    cfg = ModelConfig.from_config(config.model)
    predicted = formulas(pairs, param_count(cfg), config, n)
    results = {"config": config.name, "processes": n, "microbatches": m, "steps": steps,
               "torch": torch_side["ranks"][0]["_process"]["torch"],
               "date": time.strftime("%Y-%m-%d"), "rows": rows, "formulas": predicted,
               "transformers_max_abs_logit_dev": torch_side["ranks"][0]["_transformers_max_abs_logit_dev"],
               "ru_maxrss_bytes": {"torch_ranks": [r["_process"]["ru_maxrss_bytes"] for r in torch_side["ranks"]],
                                   "jaxpar_process": jax_side["runs"]["_process"]["ru_maxrss_bytes"]},
               "code_lines": code_lines(), "hyper": inputs["hyper"]}
    sections = [header(results, config, cfg), md_equivalence(rows, steps), md_communication(rows, predicted, n),
                md_memory(rows) + "\n\n" + rss_line(results), md_time(rows), md_lines(pairs, n, m), NOTES]
    log(write_report(out, sections, results, parts, time.perf_counter() - start))
    draw_plots(results, out, PLOTS, "pytorch")     # after results.json: a failed plot can be redrawn
    log(f"wrote {out / 'report.md'}, results.json, {', '.join(PLOTS)} and the inputs and raw results in {work}")
    return results


# ============================================================================ command line

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", default="configs/test.py",
                   help="config file (default: configs/test.py, the tiny test model)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a config field (repeatable)")
    p.add_argument("--out", metavar="DIR", help="run directory (default: runs/lab-pytorch-<time>)")
    p.add_argument("--steps", type=int, default=10, help="training steps per run (default 10)")
    p.add_argument("--processes", type=int, default=2,
                   help="PyTorch processes = jaxpar virtual devices = the mesh size (default 2)")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches (default 4)")
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated subset of {','.join(PAIRS)}")
    add_quick(p, steps=PROFILED_STEP + 2, microbatches=2, pairs=",".join(QUICK_PAIRS))


def require_torch() -> None:
    """torch and transformers are the optional extra `torch`: without them one line says what to install (the
    CPU-only wheel: the default one from the package index is CUDA's, gigabytes), before anything runs."""
    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(" and ".join(missing), "not installed; the PyTorch lab needs torch and transformers: "
                          f"pip install torch --index-url {TORCH_CPU_INDEX} (CPU-only), then pip install transformers")


def run_from_args(args) -> int:
    """`jaxpar lab pytorch` and run.py: both sides run in subprocesses, so this process's devices do not matter."""
    require_torch()
    run_lab(args.config, args.overrides, args.out, steps=args.steps, processes=args.processes,
            microbatches=args.microbatches, pairs=[p for p in args.pairs.split(",") if p])
    return 0


def main(argv=None) -> int:
    """Standalone entry (experiments/06_pytorch/run.py): parse, run; bad input exits 2."""
    return standalone_main(__doc__.splitlines()[0], add_arguments, run_from_args, argv)
