"""Lab 08: the same Llama in PyTorch and in jaxpar, side by side: DDP, FSDP2, tensor (and sequence) parallelism
and a pipeline on N local CPU processes, each beside jaxpar's automatic and hand-written counterpart.

experiments/08_pytorch/README.md is the sheet. The lab:

1. makes the inputs once, with jaxpar: the token batches (jaxpar's data pipeline), the initial weights
   (jaxpar's init, exported as a Hugging Face Llama, `model/hf.py`), the learning rate of every step
   (jaxpar's schedule) and the weight-decay mask (jaxpar's, mapped to Hugging Face names);
2. runs the PyTorch side (`torch_worker`: N gloo processes, `torch_parallel`'s strategies) and the
   jaxpar side (`pytorch_jax`: one process with N virtual CPU devices), each in a subprocess;
3. compares per pair: losses (fp32, against each side's one-device run and across frameworks), bytes
   per collective kind beside the formula, memory per rank, step time (CPU), and the lines of
   parallelism-specific code each side's user writes. Files: report.md, results.json, losses.png,
   bytes.png in --out.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jaxpar import figures
from jaxpar.config import ConfigError, apply_overrides, load_config, model_vocab_size
from jaxpar.labs import report

TOLERANCE = 1e-4
PROFILED_STEP = 2          # the torch step run under the profiler (bytes, memory), left out of the times
REPO = Path(__file__).resolve().parents[2]
TORCH_CODE = (Path(__file__).with_name("torch_parallel.py"), Path(__file__).with_name("torch_worker.py"))

# key: (PyTorch API, torch strategy, jaxpar automatic, jaxpar hand-written); {n}, {m}: processes, microbatches
PAIRS = {
    "ddp": ("DistributedDataParallel", "ddp", ["mesh.data={n}"], ["mesh.data={n}", "parallel.data=ddp"]),
    "fsdp2": ("fully_shard (FSDP2)", "fsdp2", ["mesh.fsdp={n}"], ["mesh.data={n}", "parallel.data=zero3"]),
    "tp": ("parallelize_module: ColwiseParallel / RowwiseParallel", "tp", ["mesh.tensor={n}"],
           ["mesh.tensor={n}", "parallel.tensor=manual"]),
    "tp-sp": ("... + SequenceParallel", "tp-sp", ["mesh.tensor={n}", "parallel.rules=length=tensor"],
              ["mesh.tensor={n}", "parallel.tensor=manual", "parallel.sequence=true"]),
    "gpipe": ("pipelining: ScheduleGPipe", "gpipe",
              ["mesh.pipe={n}", "parallel.pipe=circular", "parallel.pipe_microbatches={m}"],
              ["mesh.pipe={n}", "parallel.pipe=gpipe", "parallel.pipe_microbatches={m}"]),
    "1f1b": ("pipelining: Schedule1F1B", "1f1b", None,
             ["mesh.pipe={n}", "parallel.pipe=1f1b", "parallel.pipe_microbatches={m}"]),
}


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
    out = {"single": []}
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


def prepare(config, data, steps: int, out: Path) -> tuple[object, dict]:
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
    seconds = _run(["jaxpar.labs.torch_worker", str(work / "torch_spec.json"), str(work)], "PyTorch", log)
    ranks = [json.loads((work / f"torch-rank{r}.json").read_text()) for r in range(n)]
    return {"ranks": ranks, "seconds": seconds}


def run_jaxpar(config_path, overrides: list[str], inputs: dict, runs: dict, n: int, work: Path, log=print) -> dict:
    spec = {"config": config_path, "overrides": overrides, "batches": inputs["batches"], "variants": runs}
    (work / "jaxpar_spec.json").write_text(json.dumps(spec))
    seconds = _run(["jaxpar.labs.pytorch_jax", str(work / "jaxpar_spec.json"), str(work / "jaxpar.json"), str(n)],
                   "jaxpar", log)
    return {"runs": json.loads((work / "jaxpar.json").read_text()), "seconds": seconds}


# ============================================================================ 3. comparing

def code_lines(paths=TORCH_CODE) -> dict[str, int]:
    """Lines a PyTorch user writes per strategy: between `# parallel: NAME` and `# end parallel` (every
    block of that name) in torch_parallel.py, and the process group's (`setup`) in torch_worker.py;
    blank and comment-only lines left out."""
    counts, name = {}, None
    for line in (line for path in paths for line in path.read_text().splitlines()):
        marker = re.match(r"\s*# parallel: (\S+)", line)
        if marker:
            name = marker.group(1)
            counts.setdefault(name, 0)
        elif re.match(r"\s*# end parallel", line):
            name = None
        elif name and line.strip() and not line.strip().startswith("#"):
            counts[name] += 1
    return counts


def median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times[1:] if len(times) > 1 else times)


def torch_summary(ranks: list[dict], key: str, n: int) -> dict:
    """One torch strategy across ranks: rank 0's losses, the mean bytes per rank, the largest memory."""
    runs = [r[key] for r in ranks if key in r]
    sent, calls, asked = {}, {}, {}
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


def _kinds(sent: dict, calls: dict) -> str:
    return ", ".join(f"{k} {report.fmt_bytes(v)} ({calls.get(k, 0):g}x)" for k, v in sorted(sent.items())
                     if v or calls.get(k)) or "none"


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


# ============================================================================ the sheet's tables

def md_equivalence(rows: dict, steps: int) -> str:
    table = [[r["side"], f"`{r['name']}`" if r["side"] == "jaxpar" else r["name"], f"{r['losses'][0]:.6f}",
              f"{r['losses'][-1]:.6f}", f"{r['dev_own']:.1e}", f"{r['dev_other']:.1e}",
              f"{r['dev_pair']:.1e}" if r["side"] == "jaxpar" else "-",
              "yes" if r["within"] else "**NO**"] for group in rows.values() for r in group]
    return "\n".join([
        f"## a. Losses: {steps} steps, same batches, same initial weights, fp32",
        "",
        report.md_table(["side", "strategy", "loss step 1", f"loss step {steps}", "max rel. dev. vs own one device",
                         "vs the other framework's one device", "vs the pair's PyTorch run",
                         f"within {TOLERANCE:g}"], table, "llrrrrrl"),
        "",
        "Deviation = max over steps of |loss - oracle| / oracle (measured). Predicted: 0 up to fp32 rounding: "
        "every strategy computes the same sums in another order. Step 1 and 2 have equal losses: jaxpar's "
        "warm-up schedule starts at a learning rate of 0, and the PyTorch side follows it step by step.",
    ])


def md_communication(rows: dict, predicted: dict, n: int) -> str:
    table = []
    for key, group in rows.items():
        if key == "single":
            continue
        (course, how), (gloo, gloo_how) = predicted[key]
        for r in group:
            total = sum(r["sent"].values())
            torch_side = r["side"] == "PyTorch"
            asked = "-"
            if torch_side and r["comm_debug_mode"]:   # under it the profiler records each c10d call twice
                asked = "CommDebugMode: " + ", ".join(f"{k} {v}x" for k, v in sorted(r["comm_debug_mode"].items()))
            elif torch_side:
                asked = ", ".join(f"{k} {v:g}x" for k, v in sorted(r["asked"].items()))
            want = gloo if torch_side else course
            table.append([r["side"], r["name"] if torch_side else f"`{r['name']}`", _kinds(r["sent"], r["calls"]),
                          asked, report.fmt_bytes(total), report.fmt_bytes(want), report.ratio(total, want)])
        table.append(["", f"*course: {how}; PyTorch on gloo: {gloo_how}*", "", "", "", "", ""])
    return "\n".join([
        f"## b. Bytes sent per rank per step, by collective kind (ring model, N = {n}, fp32)",
        "",
        f"4Ψ = {report.fmt_bytes(predicted['_W'])}, u = (N-1)/N·4·b·s·h = {report.fmt_bytes(predicted['_u'])}. "
        "PyTorch: the gloo calls of one profiled step (torch.profiler: `gloo:*` events are what ran, `c10d::*` "
        "what the torch.distributed API was asked for; for the DTensor strategies the counts of DTensor's "
        "`CommDebugMode` instead, rank 0), mean over ranks. jaxpar: the compiled step's collectives "
        "(`measure.hlo`), per device (a pipeline's: per stage as executed, averaged). Both under "
        "`hlo.ring_factor`'s model; a send counts once, a receive 0. Formula column: the course's for jaxpar's "
        "rows, what the PyTorch code as written sends on gloo for PyTorch's (both named below each pair).",
        "",
        report.md_table(["side", "strategy", "sent, by kind (calls per step)", "torch API asked", "total",
                         "formula", "total / formula"], table, "lllrrrr"),
    ])


def md_memory(rows: dict) -> str:
    table = []
    for group in rows.values():
        for r in group:
            if r["side"] == "PyTorch":
                state, step = r["state_bytes"], r["peak_step_bytes"]
                what = "params + grads + Adam (local shards)", "allocator peak during a step"
            else:
                state, step = r["memory"]["argument"], r["memory"]["temp"]
                what = "compiled arguments (params + Adam + batch)", "compiled temp (activations, grads)"
            table.append([r["side"], f"`{r['name']}`" if r["side"] == "jaxpar" else r["name"],
                          report.fmt_bytes(state), what[0], report.fmt_bytes(step), what[1]])
    return "\n".join([
        "## c. Memory per rank",
        "",
        "PyTorch (largest rank): the bytes of the tensors each rank stores after a step, measured from the tensors "
        "(DTensor: the local shard), and the peak of torch's CPU allocator during the profiled step (profiler "
        "`[memory]` events: what the step allocates above what existed before it). jaxpar: per device, from the "
        "compiled step's memory analysis. The two are not the same accounting (jaxpar's gradients are temporaries, "
        "PyTorch's persist in `.grad`); compare within a column down a side, and across sides with that in mind.",
        "",
        report.md_table(["side", "strategy", "stored", "what", "step", "what"], table, "llrlrl"),
    ])


def md_time(rows: dict) -> str:
    t_single = rows["single"][0]["step_ms"]
    j_single = rows["single"][1]["step_ms"]
    table = []
    for group in rows.values():
        for r in group:
            base = t_single if r["side"] == "PyTorch" else j_single
            table.append([r["side"], f"`{r['name']}`" if r["side"] == "jaxpar" else r["name"], f"{r['step_ms']:.1f}",
                          f"{r['step_ms'] / base:.2f}"])
    return "\n".join([
        "## d. Step time on CPU (one run, this machine)",
        "",
        "Median over the steps after the first (PyTorch: the profiled step left out; the slowest rank). "
        "CPU timings of a tiny model measure framework overhead, not accelerator speed: PyTorch runs N "
        "processes with one thread each, jaxpar one process with N virtual devices. The ratios are what "
        "compares (each side against its own one-device run), not the milliseconds across sides.",
        "",
        report.md_table(["side", "strategy", "ms per step (CPU)", "vs own one device"], table, "llrr"),
    ])


def md_lines(pairs, n: int, m: int) -> str:
    lines = code_lines()
    block = {"ddp": "ddp", "fsdp2": "fsdp2", "tp": "tp", "tp-sp": "tp", "gpipe": "pipeline", "1f1b": "pipeline"}
    table = []
    for key in pairs:
        api, _, auto, manual = PAIRS[key]
        table.append([api, lines[block[key]], f"`{' '.join(auto).format(n=n, m=m)}`" if auto else "-",
                      len(auto) if auto else "-", f"`{' '.join(manual).format(n=n, m=m)}`", len(manual)])
    return "\n".join([
        "## e. Lines of parallelism-specific code a user writes",
        "",
        "PyTorch: the lines between `# parallel: NAME` and `# end parallel` in `jaxpar/labs/torch_parallel.py`, "
        "what the user adds to the one-process program "
        "(blank and comment lines left out; TP and TP+SP share one block, SP adds its lines to it; both pipeline "
        f"schedules share one). Every PyTorch strategy also needs the process group ({lines['setup']} lines in "
        "`torch_worker.py`: the rendezvous address and `init_process_group`) and a launcher (`mp.spawn` or "
        "`torchrun`); jaxpar runs N devices of one process with `--cpu-devices N`, several processes with "
        "`jaxpar launch`. jaxpar: "
        "the `--set` lines of each run (the model code is unchanged).",
        "",
        report.md_table(["PyTorch API", "PyTorch lines", "jaxpar automatic", "lines", "jaxpar hand-written", "lines"],
                        table, "lrlrlr"),
    ])


NOTES = """## f. What runs, what does not, and why

- **gloo has no reduce-scatter.** `reduce_scatter_tensor` on a gloo group runs an all-reduce of the whole buffer
  and keeps this rank's slice (the `gloo:all_reduce` events under a `c10d::_reduce_scatter_base_` or
  `reduce_scatter_tensor_coalesced_` call, part b): FSDP2's gradient reduce-scatter and SP's reduce-scatters
  cost 2(N-1)/N instead of (N-1)/N of their buffer. This is the PyTorch twin of XLA:CPU spelling the automatic
  FSDP's reduce-scatter as all-reduce + slice (lab 02). On NCCL both are real reduce-scatters.
- **Counting PyTorch's bytes.** The profiler's `gloo:*` events carry each call's buffer on every strategy.
  DTensor's `CommDebugMode` counts the DTensor strategies' collectives (FSDP2, TP, SP: the same calls, by the
  name the API was asked for); under `DistributedDataParallel` its module-tracking hook raised an IndexError
  in torch 2.13 while this lab was built, so DDP and the pipelines are counted by the profiler alone.
- **DDP broadcasts its buffers every forward** (`broadcast_buffers=True`): the RoPE frequency buffer, 32 B
  per step here. jaxpar has no such buffer: RoPE tables are computed in the step.
- **TP's first plan sent 7 all-reduces per layer, not 4.** With only `ColwiseParallel` on q, k, v (and gate,
  up), each projection turns the same input into a DTensor on its own, so the backward pass all-reduces the
  input gradient once per projection (measured while building this lab, torch 2.13, this model, N = 2: 20
  all-reduces, 2.006 MiB per step, against 14 and 1.256 MiB now). `PrepareModuleInput` on the attention and
  MLP modules makes the input one DTensor: Megatron's f, one all-reduce. jaxpar's automatic TP
  (`mesh.tensor=N`, part b) is XLA:CPU making the per-projection choice: 2 forward + 5 backward all-reduces
  per layer (lab 03).
- **The embedding's gradient comes back replicated.** A `RowwiseParallel` embedding's weight is split by
  vocabulary, but its gradient is a full replicated tensor on every rank; the loop slices it to the
  parameter's placement (no bytes sent) before the optimizer.
- **PyTorch's SP keeps the gathered input** of q/k/v and gate/up for the backward pass (autograd saves it),
  as jaxpar's manual TP+SP with `regather=False` (lab 03): 8u per layer. jaxpar's `parallel.sequence=true`
  gathers it again in the backward pass as Megatron-LM does (+2u per layer, less memory).
- **Pipeline schedules.** GPipe and 1F1B run here on both sides. PyTorch also has `ScheduleInterleaved1F1B`
  and `ScheduleInterleavedZeroBubble` (several stages per rank); jaxpar has `interleaved` and `zb-h1` (lab 03);
  they are not paired in this lab. jaxpar's automatic pipeline counterpart is `parallel.pipe=circular`
  (the compiler-driven pipeline); no automatic 1F1B exists. jaxpar's lock-step executor sends a buffer on
  every tick, bubbles included; torch.distributed.pipelining sends only the useful ones (part b). jaxpar's
  pipeline also keeps the embedding and the head on every stage and all-reduces their gradients over `pipe`
  (the all-reduce of its pipeline rows); PyTorch's stages hold them only on the first and last rank.
- **Clipping.** Both sides clip with optax's formula (g·max/‖g‖ when ‖g‖ ≥ max): torch's `clip_grad_norm_`
  would add 1e-6 to the norm, and with DTensor gradients of mixed placements (TP) its norm needs the
  placements reconciled first, which `torch_train.clip_by_global_norm` does."""


def plot_losses(rows: dict, path: Path) -> None:
    t_single, j_single = rows["single"][0]["losses"], rows["single"][1]["losses"]
    runs = [("jaxpar one device", j_single, None), ("PyTorch one process (vs jaxpar's)", t_single, j_single)]
    for key, group in rows.items():
        if key != "single":
            runs += [(f"{r['side']} {key}" + ("" if r["side"] == "PyTorch" else
                                              (" auto" if r is group[1] and len(group) == 3 else " manual")),
                      r["losses"], t_single if r["side"] == "PyTorch" else j_single) for r in group]
    report.plot_equivalence(path, runs, TOLERANCE)


KIND_COLOURS = {"all-reduce": "C1", "all-gather": "C0", "reduce-scatter": "C6", "all-to-all": "C2",
                "collective-permute": "C4", "send": "C9", "broadcast": "C3"}


def plot_bytes(rows: dict, predicted: dict, path: Path) -> None:
    """Per pair: PyTorch, jaxpar automatic and hand-written (stacked by kind), and the formula."""
    pairs = [k for k in rows if k != "single"]
    kinds = sorted({k for key in pairs for r in rows[key] for k in r["sent"]})
    colours = {kind: KIND_COLOURS.get(kind, "C5") for kind in kinds}
    fig = figures.figure(11, 4.8)
    ax = fig.add_subplot()
    width, labelled = 0.2, set()
    for i, key in enumerate(pairs):
        names = ("torch", "auto", "manual") if len(rows[key]) == 3 else ("torch", "manual")
        for j, (r, name) in enumerate(zip(rows[key], names)):
            x, bottom = i + (j - 1.5) * width, 0.0
            for kind in kinds:
                value = r["sent"].get(kind, 0.0) / 2**10
                ax.bar(x, value, width, bottom=bottom, color=colours[kind], edgecolor="k", linewidth=0.3,
                       label=None if kind in labelled or not value else kind)
                labelled |= {kind} if value else set()
                bottom += value
            ax.text(x, bottom, name, rotation=90, fontsize=6, ha="center", va="bottom")
        ax.bar(i + 1.5 * width, predicted[key][0][0] / 2**10, width, color="0.85", hatch="//", edgecolor="0.4",
               label="course formula" if i == 0 else None)
    ax.set_xticks(range(len(pairs)), pairs)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)       # room for the bar names
    ax.set(ylabel="KiB sent per rank per step",
           title="bytes per collective kind: PyTorch, jaxpar auto, jaxpar hand-written, course formula (hatched)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    """Run both sides of every pair; write report.md, results.json, losses.png, bytes.png into `out`."""
    import tempfile

    from jaxpar.data.pipeline import build_token_data
    from jaxpar.model.counting import param_count
    from jaxpar.model.transformer import ModelConfig
    start, n, m, pairs = time.perf_counter(), processes, microbatches, list(pairs)
    config = load_config(config_path)
    apply_overrides(config, overrides)
    data = build_token_data(config.data)
    vocab = model_vocab_size(config, data.stats["vocab_size"], 1)
    check(config, pairs, steps, n, m, vocab)
    out = Path(out or f"runs/lab-pytorch-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    parts = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
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
    plot_losses(rows, out / "losses.png")
    plot_bytes(rows, predicted, out / "bytes.png")
    log(report.write_report(out, sections, results, start, parts))
    log(f"wrote {out / 'report.md'}, results.json, losses.png, bytes.png")
    return results


def header(results: dict, config, cfg) -> str:
    import jax
    return "\n".join([
        f"# Lab 08: PyTorch beside jaxpar, config {config.name}, {results['processes']} CPU processes / devices",
        "",
        f"torch {results['torch']} (gloo), jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M')}. Model: d_model "
        f"{cfg.d_model}, {cfg.layers} layers, {cfg.heads} heads ({cfg.kv_heads} kv), mlp {cfg.mlp_dim}, vocab "
        f"{cfg.vocab_size}; batch {config.train.batch_size} x {config.data.seq_len} tokens of '{config.data.corpus}' "
        f"(jaxpar's data pipeline); AdamW lr {config.train.lr} (warm-up {config.train.warmup_steps}, cosine), clip "
        f"{config.train.grad_clip}, weight decay {config.train.weight_decay}; {results['microbatches']} pipeline "
        "microbatches. Both sides start from jaxpar's initial weights (exported as a Hugging Face Llama). The "
        f"PyTorch module's logits on batch 1 differ from transformers' LlamaForCausalLM's on the same checkpoint by "
        f"at most {results['transformers_max_abs_logit_dev']:.1e} (measured).",
    ])


def rss_line(results: dict) -> str:
    rss = results["ru_maxrss_bytes"]
    return (f"Process peak RSS (`ru_maxrss`, whole process: interpreter, libraries, every strategy of the run): "
            f"PyTorch ranks {', '.join(report.fmt_bytes(b) for b in rss['torch_ranks'])}; the jaxpar process "
            f"(all {results['processes']} virtual devices) {report.fmt_bytes(rss['jaxpar_process'])}. For a model "
            "this small the libraries dominate.")


# ============================================================================ command line

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", default=str(REPO / "configs" / "test.py"),
                   help="config file (default: configs/test.py, the tiny test model)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a config field (repeatable)")
    p.add_argument("--out", metavar="DIR", help="run directory (default: runs/lab-pytorch-<time>)")
    p.add_argument("--steps", type=int, default=10, help="training steps per run (default 10)")
    p.add_argument("--processes", type=int, default=2,
                   help="PyTorch processes = jaxpar virtual devices = the mesh size (default 2)")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches (default 4)")
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated subset of {','.join(PAIRS)}")


def run_from_args(args) -> int:
    """`jaxpar lab pytorch` and run.py: both sides run in subprocesses, so this process's devices do not matter."""
    run_lab(args.config, args.overrides, args.out, steps=args.steps, processes=args.processes,
            microbatches=args.microbatches, pairs=[p for p in args.pairs.split(",") if p])
    return 0


def main(argv=None) -> int:
    """Standalone entry (experiments/08_pytorch/run.py): parse, run; bad input exits 2."""
    return report.standalone_main(__doc__.splitlines()[0], add_arguments, run_from_args, argv)
