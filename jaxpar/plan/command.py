"""`jaxpar plan`: arguments, inputs checked before anything runs, the ranked table and the defence."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxpar.checks import add_config_arguments
from jaxpar.config import REPOSITORY, ConfigError

DEFAULT_CONFIG = REPOSITORY / "configs" / "arabic_7b.py"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, config_help="model config (default: configs/arabic_7b.py)",
                         set_help="override a config field (repeatable)")
    p.add_argument("--nodes", type=int, default=8, help="nodes in the cluster (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, joined by NVLink (default 8)")
    p.add_argument("--gpu", default="h100", help="GPU type: h100, h100-pcie, h200, a100, a100-40gb (default h100)")
    p.add_argument("--nvlink-gbps", type=float, help="NVLink GB/s per GPU per direction (default: the datasheet's)")
    p.add_argument("--ib-gbps", type=float, help="InfiniBand GB/s per GPU per direction (default: 50, NDR 400G)")
    p.add_argument("--price", type=float, help="price per GPU-hour, for the cost column (optional)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--tokens", help="training budget in tokens, e.g. 1e12 or 1T")
    budget.add_argument("--words", help="training budget in Arabic words (converted with the tokenizer's measured "
                                        "tokens per word), e.g. 5e11")
    p.add_argument("--global-batch", type=int, help="global batch in sequences (default: the config's)")
    p.add_argument("--seq-len", type=int, help="sequence length (default: the config's data.seq_len)")
    p.add_argument("--headroom", type=float, default=0.1, help="fraction of device memory kept free (default 0.1)")
    p.add_argument("--top", type=int, default=10, help="rows of the ranked table (default 10)")
    p.add_argument("--verify", type=int, default=0, metavar="N",
                   help="compile the N best buildable candidates deviceless for the GPU (needs the CUDA plugin)")
    p.add_argument("--out", metavar="DIR", help="also write plan.md and plan.json into DIR")


def load_model_config(args):
    from jaxpar.config import apply_overrides, load_config
    path = args.config or (str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None)
    if path is None:
        raise ConfigError("--config", "configs/arabic_7b.py is not next to this installation; give --config FILE")
    config = load_config(path)
    apply_overrides(config, args.overrides)
    if config.model.vocab_size <= 0:
        raise ConfigError("model.vocab_size", "is 0 (the tokenizer's); a plan needs it: --set model.vocab_size=N")
    return config


def budget_tokens(args, config) -> tuple[float, str]:
    """Tokens to train on, and a note when they came from Arabic words through the measured fertility."""
    from jaxpar.measure.memory import parse_count
    if args.words is not None:
        from jaxpar.plan.fertility import fertility
        words = parse_count(args.words, "--words")
        f = fertility(config.data.corpus, config.data.vocab_size, config.data.normalize)
        return words * f["tokens_per_word"], (
            f" = {words:.3g} Arabic words x {f['tokens_per_word']:.3f} tokens/word (BPE {f['vocab_reached']} "
            f"tokens on '{config.data.corpus}', {'normalized' if f['normalize'] else 'with diacritics'}, "
            f"measured on held-out text)")
    if args.tokens is None:
        raise ConfigError("--tokens", "give the training budget: --tokens N (e.g. 1e12) or --words N")
    return parse_count(args.tokens, "--tokens"), ""


def check_inputs(args):
    """Everything that can be refused before planning: one ConfigError naming the argument."""
    from jaxpar.plan.fleet import gpu_cluster
    cluster = gpu_cluster(args.gpu, args.nodes, args.gpus_per_node, nvlink_gbps=args.nvlink_gbps,
                          ib_gbps=args.ib_gbps, price_per_gpu_hour=args.price)
    if args.verify < 0:
        raise ConfigError("--verify", f"is {args.verify}; give how many candidates to compile, e.g. 3")
    if args.top < 1:
        raise ConfigError("--top", f"is {args.top}; must be at least 1")
    config = load_model_config(args)
    tokens, note = budget_tokens(args, config)
    return config, cluster, tokens, note


def run(args) -> int:
    config, cluster, tokens, note = check_inputs(args)     # before JAX is imported (the model's counts import it)
    from jaxpar.model.counting import ModelShape
    from jaxpar.plan.planner import defence, plan, summary_line, table
    global_batch = args.global_batch if args.global_batch is not None else config.train.batch_size
    seq_len = args.seq_len if args.seq_len is not None else config.data.seq_len
    p = plan(ModelShape.from_config(config), cluster, global_batch=global_batch, seq_len=seq_len, tokens=tokens,
             headroom=args.headroom)
    p.budget_note = note
    lines = [f"# Plan: {config.name}", "", summary_line(p), ""]
    verified_text = []
    if args.verify:
        verified_text = verify_top(p, config, args.verify, args.gpu)
    from jaxpar.plan.verify import annotate, buildable_sentence
    annotate(p, config, args.top)
    lines += [table(p, args.top), "", "## Defence", "", defence(p) + " " + buildable_sentence(p, config)]
    if verified_text:
        lines += ["", "## Checked against the compiler", "", *verified_text]
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.md").write_text(text + "\n")
        (out / "plan.json").write_text(json.dumps(plan_json(p), indent=2) + "\n")
        print(f"\nwrote {out}/plan.md and plan.json")
    return 0


def verify_top(p, config, count: int, gpu: str) -> list[str]:
    """Compile the best buildable candidates deviceless (or say why not, and how to make it possible)."""
    from jaxpar.measure.targets import GPU_TARGETS, gpu_plugin_problem
    target = gpu.lower().removesuffix("-sxm").removesuffix("-80gb")
    if target not in GPU_TARGETS:
        return [f"Verification skipped: no deviceless compile target for '{gpu}' (targets: {', '.join(GPU_TARGETS)})."]
    problem = gpu_plugin_problem()
    if problem:
        return [f"Verification skipped: {problem}."]
    from jaxpar.plan.verify import verification_table, verify
    verified, skipped = verify(p, config, count, target, log=lambda line: None)
    out = [verification_table(verified), ""]
    out += ["Better-ranked candidates this checkout cannot build (formula only):", ""]
    out += [f"- {s}" for s in skipped]
    return out


def plan_json(p) -> dict:
    import dataclasses
    rows = []
    for r in p.ranked[:50]:
        rows.append({"strategy": r.label, "candidate": dataclasses.asdict(r.cand), "memory": r.memory.parts(),
                     "memory_total": r.memory.total, "step_s": r.time.total_s, "terms": r.time.terms(),
                     "comm_s": r.time.comm_s, "comm_bytes": r.comm_bytes, "tokens_per_s": r.tokens_per_s,
                     "mfu": r.mfu, "days": r.days, "gpu_hours": r.gpu_hours, "cost": r.cost, "note": r.note})
    return {"model_params": p.shape.params, "cluster": p.cluster.describe(), "global_batch": p.global_batch,
            "seq_len": p.seq_len, "tokens": p.tokens, "candidates": p.evaluated, "fit": len(p.ranked), "ranked": rows}
