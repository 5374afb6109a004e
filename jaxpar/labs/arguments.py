"""The arguments of the labs whose modules import JAX, defined here without it.

`jaxpar lab NAME --help` and a bad argument then answer in a fraction of a second; each
lab module re-exports its function as `add_arguments` (for its standalone `run.py`). A lab
whose module imports nothing heavy keeps `add_arguments` in its own module (ops, capstone).
"""
from __future__ import annotations

import argparse
import sys

from jaxpar.checks import add_config_arguments

# Lab 07's own settings, applied before --set: configs/mixtral_tiny.py at 2 layers and 64-token sequences
# keeps the whole lab under 12 minutes on 2 CPU cores (measured: ~0.17 CPU-s per capacity step on one device).
MOE_SETTINGS = ("model.layers=2", "data.seq_len=64")
MOE_PARTS = ("equivalence", "communication", "balance", "capacity", "moe_vs_dense", "layouts")
ZERO_PARTS = ("equivalence", "memory", "communication", "remat", "precision")
TENSOR_PARTS = ("equivalence", "communication", "memory", "layouts", "context")
PIPELINE_PARTS = ("tables", "equivalence", "timeline", "memory", "p2p", "dryrun", "dualpipev", "pipedream", "moe")
# --quick runs on the tiny test model (configs/test.py) wherever a lab takes a config
TEST_CONFIG = "configs/test.py"


def add_quick(p: argparse.ArgumentParser, **values) -> None:
    """`--quick`: every part, every plot and the sheet at the smallest sizes, for a smoke run (CI's journeys).

    `values` ({dest: value}) become the parser's defaults when the command line holds --quick, so an option
    given explicitly still wins; `overrides` (the --set list) go first, before the user's own --set.
    """
    flags = {a.dest: a.option_strings[0] for a in p._actions if a.option_strings}
    shown = [f"{flags[dest]} {v}" for dest, value in values.items()
             for v in (value if isinstance(value, list | tuple) else [value])]
    p.add_argument("--quick", action="store_true",
                   help=f"a quick run of every part at the smallest sizes: {' '.join(shown)} (flags given win)")
    parse = p.parse_known_args

    def parse_known_args(args=None, namespace=None):
        words = sys.argv[1:] if args is None else list(args)
        if "--quick" in (words[:words.index("--")] if "--" in words else words):
            p.set_defaults(**{dest: list(v) if dest == "overrides" else v for dest, v in values.items()})
        return parse(args, namespace)

    # argparse has no hook for defaults that depend on another flag: this parser alone parses with them
    p.parse_known_args = parse_known_args  # type: ignore[method-assign]


def run_arguments(p: argparse.ArgumentParser, lab: str, parts: tuple[str, ...] = ()) -> None:
    """What every lab that runs on virtual CPU devices takes: --cpu-devices, --out and (with `parts`) --parts."""
    p.add_argument("--cpu-devices", type=int, metavar="N", help="run on N virtual CPU devices (8 for the lab)")
    p.add_argument("--out", metavar="DIR", help=f"run directory (default: runs/lab-{lab}-<time>)")
    if parts:
        p.add_argument("--parts", metavar="LIST", default=",".join(parts),
                       help=f"comma-separated parts to run (default all: {','.join(parts)})")


def zero(p: argparse.ArgumentParser) -> None:
    """`jaxpar lab zero`."""
    add_config_arguments(p, config_help="config file (default: the embedded default, ~3.4M params; configs/test.py: "
                                        "the tiny test model, ~2x faster)")
    run_arguments(p, "zero", ZERO_PARTS)
    p.add_argument("--steps", type=int, default=10, help="training steps of the equivalence part (default 10)")
    p.add_argument("--precision-steps", type=int, default=60,
                   help="training steps of each precision's loss curve (default 60)")
    p.add_argument("--remat-repeats", type=int, default=10, help="timed steps per remat policy (default 10)")
    p.add_argument("--precisions", metavar="LIST", default=None,
                   help="comma-separated compute dtypes (default: float32,bfloat16,float8)")
    add_quick(p, config=TEST_CONFIG, cpu_devices=8, steps=2, precision_steps=2, remat_repeats=1,
              precisions="float32,bfloat16")


def tensor(p: argparse.ArgumentParser) -> None:
    """`jaxpar lab tensor`."""
    add_config_arguments(p, config_help="config file (default: the embedded default; configs/test.py with --set "
                                        "model.kv_heads=4: the tiny test model)")
    run_arguments(p, "tensor", TENSOR_PARTS)
    p.add_argument("--steps", type=int, default=10, help="training steps of the equivalence part (default 10)")
    p.add_argument("--tensor", type=int, default=4, help="mesh.tensor (default 4); mesh.data takes the other devices")
    add_quick(p, config=TEST_CONFIG, overrides=["model.kv_heads=4"], cpu_devices=8, steps=2)


def pipeline(p: argparse.ArgumentParser) -> None:
    """`jaxpar lab pipeline`."""
    add_config_arguments(p, config=False,
                         set_help="override a field of the lab's model (configs/test.py + 8 layers, d_model 128)")
    run_arguments(p, "pipeline", PIPELINE_PARTS)
    p.add_argument("--steps", type=int, default=5, help="training steps of the equivalence part (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="steps run before the profiled one (default 2)")
    p.add_argument("--pipedream-steps", type=int, default=60, help="training steps of part h (default 60)")
    add_quick(p, cpu_devices=8, steps=1, warmup=1, pipedream_steps=3)


def moe(p: argparse.ArgumentParser) -> None:
    """`jaxpar lab moe`."""
    add_config_arguments(p, default="configs/mixtral_tiny.py",
                         config_help="an MoE config (default: configs/mixtral_tiny.py, 8 experts, top-2)",
                         set_help="override a config field, e.g. --set model.layers=4 (repeatable); applied after "
                                  f"the lab's own settings {', '.join(MOE_SETTINGS)}")
    run_arguments(p, "moe", MOE_PARTS)
    p.add_argument("--steps", type=int, default=5, help="steps of the equivalence part (default 5)")
    p.add_argument("--balance-steps", type=int, default=150, help="training steps per balancing method (default 150)")
    p.add_argument("--capacity-steps", type=int, default=30, help="steps per capacity factor (default 30)")
    p.add_argument("--compare-steps", type=int, default=150, help="steps of MoE and dense each (default 150)")
    p.add_argument("--bias-rate", type=float, default=0.01,
                   help="aux-free bias step per training step in the balance part (default 0.01)")
    add_quick(p, cpu_devices=8, steps=2, balance_steps=3, capacity_steps=2, compare_steps=3)


def kernels(p: argparse.ArgumentParser) -> None:
    """`jaxpar lab kernels`."""
    run_arguments(p, "kernels")
    p.add_argument("--steps", type=int, default=5, help="training steps of the model agreement (default 5)")
    p.add_argument("--seq-lens", default="128,256,512", help="sequence lengths of the memory part")
    p.add_argument("--depths", default="2,4,8,16", help="layer counts of the compile-time part")
    p.add_argument("--gpu-results", metavar="DIR",
                   help="--out directory of benchmarks/attention.py and mfu.py on a GPU")
    add_quick(p, cpu_devices=8, steps=2, seq_lens="16,32,64", depths="1,2")


OVERLAP_PARTS = ("gpu", "cpu")


def overlap(p: argparse.ArgumentParser) -> None:
    """`jaxpar lab overlap`."""
    p.add_argument("--out", metavar="DIR", help="run directory (default: runs/lab-overlap-<time>)")
    p.add_argument("--parts", metavar="LIST", default=",".join(OVERLAP_PARTS),
                   help="comma-separated parts: gpu (deviceless 7B compiles on 64 H100s, needs the CUDA plugin "
                        "wheels, ~2 min each) and cpu (the default model on 8 CPU devices); default both")
    p.add_argument("--layouts", metavar="LIST", default=None,
                   help="GPU part: comma-separated layout names (default all; see jaxpar/labs/overlap/lab.py LAYOUTS)")
    p.add_argument("--cpu-devices", type=int, metavar="N", help="run on N virtual CPU devices (8 for the lab)")
    p.add_argument("--steps", type=int, default=5, help="CPU part: training steps compared with one device "
                                                        "(default 5)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="CPU part: override a field of the default model, e.g. --set model.layers=2")
    add_quick(p, cpu_devices=8, steps=2, layouts="fsdp (XLA)")
