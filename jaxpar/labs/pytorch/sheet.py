"""Lab 06's sheet: its tables, notes and figures, from the compared runs."""
from __future__ import annotations

import time
from pathlib import Path

from jaxpar import figures, units
from jaxpar.labs.base import report
from jaxpar.labs.pytorch.pairs import PAIRS, TOLERANCE, code_lines


def _kinds(sent: dict, calls: dict) -> str:
    return ", ".join(f"{k} {units.fmt_bytes(v)} ({calls.get(k, 0):g}x)" for k, v in sorted(sent.items())
                     if v or calls.get(k)) or "none"


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
                          asked, units.fmt_bytes(total), units.fmt_bytes(want), units.ratio(total, want)])
        table.append(["", f"*course: {how}; PyTorch on gloo: {gloo_how}*", "", "", "", "", ""])
    return "\n".join([
        f"## b. Bytes sent per rank per step, by collective kind (ring model, N = {n}, fp32)",
        "",
        f"4Ψ = {units.fmt_bytes(predicted['_W'])}, u = (N-1)/N·4·b·s·h = {units.fmt_bytes(predicted['_u'])}. "
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
                          units.fmt_bytes(state), what[0], units.fmt_bytes(step), what[1]])
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
        "PyTorch: the lines between `# parallel: NAME` and `# end parallel` in "
        "`jaxpar/labs/pytorch/torch_parallel.py`, what the user adds to the one-process program "
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
  (`mesh.tensor=N`, part b) holds the projections' shared input once per tensor shard for the same reason,
  so XLA sums the gradients before one all-reduce (lab 03: why XLA's automatic TP sent 7).
- **The embedding's gradient comes back replicated.** A `RowwiseParallel` embedding's weight is split by
  vocabulary, but its gradient is a full replicated tensor on every rank; the loop slices it to the
  parameter's placement (no bytes sent) before the optimizer.
- **PyTorch's SP keeps the gathered input** of q/k/v and gate/up for the backward pass (autograd saves it),
  as jaxpar's manual TP+SP with `regather=False` (lab 03): 8u per layer. jaxpar's `parallel.sequence=true`
  gathers it again in the backward pass as Megatron-LM does (+2u per layer, less memory).
- **Pipeline schedules.** GPipe and 1F1B run here on both sides. PyTorch also has `ScheduleInterleaved1F1B`
  and `ScheduleInterleavedZeroBubble` (several stages per rank); jaxpar has `interleaved` and `zb-h1` (lab 04);
  they are not paired in this lab. jaxpar's automatic pipeline counterpart is `parallel.pipe=circular`
  (the compiler-driven pipeline); no automatic 1F1B exists. jaxpar's executor sends only the useful
  buffers, as torch.distributed.pipelining does (each tick over just the pairs that send; part b). jaxpar's
  pipeline also keeps the embedding and the head on every stage and all-reduces their gradients over `pipe`
  (the all-reduce of its pipeline rows); PyTorch's stages hold them only on the first and last rank.
- **Clipping.** Both sides clip with optax's formula (g·max/‖g‖ when ‖g‖ ≥ max): torch's `clip_grad_norm_`
  would add 1e-6 to the norm, and with DTensor gradients of mixed placements (TP) its norm needs the
  placements reconciled first, which `torch_train.clip_by_global_norm` does."""


def kinds(group: list[dict]) -> tuple[str, ...]:
    """What each row of a pair is: PyTorch's run first, then jaxpar's automatic (where the pair has one) and
    hand-written counterpart (`compare`'s order)."""
    return ("torch", "auto", "manual") if len(group) == 3 else ("torch", "manual")


def plot_losses(rows: dict, path: Path):
    """Each side against its own one-device run, and PyTorch's one process against jaxpar's one device."""
    ref = {"PyTorch": "PyTorch one process", "jaxpar": "jaxpar one device"}
    runs = [(ref["jaxpar"], rows["single"][1]["losses"], None), (ref["PyTorch"], rows["single"][0]["losses"], None),
            ("PyTorch one process vs jaxpar's", rows["single"][0]["losses"], ref["jaxpar"])]
    for key, group in rows.items():
        if key != "single":
            runs += [(f"{r['side']} {key}" + (f" {kind}" if kind != "torch" else ""), r["losses"], ref[r["side"]])
                     for r, kind in zip(group, kinds(group))]
    return report.plot_equivalence(path, runs, TOLERANCE, reference="oracle",
                                   title="PyTorch and jaxpar: same batches, weights and optimizer, same losses?")


KIND_COLOURS = {"all-reduce": "C1", "all-gather": "C0", "reduce-scatter": "C6", "all-to-all": "C2",
                "collective-permute": "C4", "send": "C9", "broadcast": "C3"}
SLOTS = {"torch": ("T", 0), "auto": ("A", 1), "manual": ("M", 2)}     # a pair's bars, left to right; the formula last


@figures.styled
def plot_bytes(results: dict, path: Path):
    """Per pair: PyTorch, jaxpar automatic and hand-written (stacked by kind), and the course's formula."""
    rows, predicted = results["rows"], results["formulas"]
    pairs = [k for k in rows if k != "single"]
    collectives = sorted({k for key in pairs for r in rows[key] for k in r["sent"]})
    fig = figures.figure(10, 5.2)
    ax = fig.add_subplot()
    width, labelled = 0.2, set()
    for i, key in enumerate(pairs):
        for r, kind in zip(rows[key], kinds(rows[key])):
            name, slot = SLOTS[kind]
            x, bottom = i + (slot - 1.5) * width, 0.0
            for op in collectives:
                value = r["sent"].get(op, 0.0) / 2**10
                ax.bar(x, value, width, bottom=bottom, color=KIND_COLOURS.get(op, "C5"), edgecolor="k",
                       linewidth=0.3, label=None if op in labelled or not value else op)
                labelled |= {op} if value else set()
                bottom += value
            ax.text(x, bottom, name, fontsize=10, ha="center", va="bottom")
        ax.bar(i + 1.5 * width, predicted[key][0][0] / 2**10, width, color="0.85", hatch="//", edgecolor="0.4",
               label="course formula" if i == 0 else None)
    ax.set_xticks(range(len(pairs)), pairs)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.1)       # room for the bar names
    ax.set(ylabel="KiB sent per rank per step", title="Bytes per collective kind and pair: T PyTorch, "
           "A jaxpar automatic,\nM jaxpar hand-written, hatched: the course's formula")
    figures.legend_below(ax, ncols=4, gap=0.1)
    return figures.save(fig, path)


# The sheet's figures for report.draw_plots ({file: (results key, plot)}): the lab and `jaxpar.labs.replot` draw them.
PLOTS = {"losses.png": ("rows", plot_losses), "bytes.png": (None, plot_bytes)}


# ============================================================================ the whole lab

def header(results: dict, config, cfg) -> str:
    import jax
    return "\n".join([
        f"# Lab 06: PyTorch beside jaxpar, config {config.name}, {results['processes']} CPU processes / devices",
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
            f"PyTorch ranks {', '.join(units.fmt_bytes(b) for b in rss['torch_ranks'])}; the jaxpar process "
            f"(all {results['processes']} virtual devices) {units.fmt_bytes(rss['jaxpar_process'])}. For a model "
            "this small the libraries dominate.")
