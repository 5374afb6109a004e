"""`jaxpar` command line: parse, check, then import and run. Bad input exits 2 with one line naming the field.

Only the chosen subcommand's arguments are defined, from modules that do not import JAX,
and every value that can be refused is refused before JAX or a lab is imported: `--help`
and bad input answer in a fraction of a second. The entry point: only the standard library and jaxpar.env at
the top, so a `train` listens for preemption notices within milliseconds of start (jaxpar.config takes seconds).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from jaxpar.env import EXIT_BAD_INPUT, start_platform


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit status 2."""

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an unknown `--steps 10` that names a config field says `--set train.steps=10`."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            words = ["jaxpar", parsed.subcommand, getattr(parsed, NESTED_DEST.get(parsed.subcommand, ""), None)]
            hint = set_hint(extra) if hasattr(parsed, "overrides") else ""
            self.exit(EXIT_BAD_INPUT, f"error: unrecognized arguments: {' '.join(extra)}{hint} "
                                      f"(see {' '.join(filter(None, words))} --help)\n")
        return parsed


def set_hint(extra: list[str]) -> str:
    """`; train.steps is a config field: --set train.steps=10` for each unknown `--steps 10` naming a field."""
    from jaxpar.config import base_config, field_paths
    paths = field_paths(base_config())
    hints = []
    for i, word in enumerate(extra):
        if not word.startswith("--"):
            continue
        name, _, value = word[2:].partition("=")
        if not value:
            value = extra[i + 1] if i + 1 < len(extra) and not extra[i + 1].startswith("--") else "VALUE"
        fields = [p for p in paths if p.rsplit(".", 1)[-1] == name.replace("-", "_")]
        if fields:
            hints.append(f"{' or '.join(fields)} is a config field: "
                         f"{' or '.join(f'--set {field}={value}' for field in fields)}")
    return "".join(f"; {h}" for h in hints)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    from jaxpar.checks import add_config_arguments
    add_config_arguments(p)
    p.add_argument("--cpu-devices", type=int, metavar="N",
                   help="run on N virtual CPU devices (set before JAX starts; for meshes without GPUs)")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    from jaxpar.checks import non_negative_seconds
    add_run_arguments(p)
    p.add_argument("--run-dir", metavar="DIR", help="run directory (default: runs/<name>-<time>)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    group.add_argument("--overwrite", action="store_true", help="delete an existing --run-dir and start afresh")
    group.add_argument("--auto-resume", action="store_true",
                       help="resume --run-dir when it holds a checkpoint, else start it (restarts, requeued jobs)")
    p.add_argument("--profile", metavar="START:END", help="trace steps START..END with jax.profiler into the run dir")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on PORT + process index (e.g. 9400)")
    p.add_argument("--metrics-host", metavar="ADDRESS",
                   help="address the metrics server binds (default 127.0.0.1, this machine only; 0.0.0.0: every "
                        "interface, for a Prometheus on another host; the endpoint has no authentication)")
    p.add_argument("--metrics-linger", type=non_negative_seconds, default=0.0, metavar="SECONDS",
                   help="keep serving the final metrics this long after training (so the last scrape sees them)")


def add_sample_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, metavar="DIR", help="run directory written by `jaxpar train`")
    p.add_argument("--prompt", default="بِسْمِ ٱللَّهِ", help="text to continue")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; >0: sample")
    p.add_argument("--top-k", type=int, default=0, help="sample only from the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0)


def add_dryrun_arguments(p: argparse.ArgumentParser) -> None:
    from jaxpar.checks import add_config_arguments
    add_config_arguments(p, set_help="override a config field, e.g. --set mesh.fsdp=64 (repeatable)")
    p.add_argument("--target", choices=("cpu", "h100", "h200", "a100"), default="cpu",
                   help="cpu: N virtual CPU devices; h100/h200/a100: deviceless XLA:GPU compile "
                        "(needs the CUDA plugin)")
    p.add_argument("--devices", type=int, metavar="N", help="device count (cpu: set before JAX starts)")
    p.add_argument("--topology", metavar="PxHxG", help="GPU targets: partitions x hosts x GPUs per host, e.g. 1x8x8")
    p.add_argument("--out", metavar="DIR", help="also write dryrun.json, dryrun.md and memory.png into DIR")


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", required=True, metavar="N", help="parameter count, e.g. 7.5e9 or 7.5B")
    p.add_argument("--devices", required=True, metavar="N", help="data-parallel devices the state is split over")
    p.add_argument("--optimizer", default="adam", metavar="NAME", help="adam (default), sgd (momentum), adafactor")
    p.add_argument("--precision", default="mixed", metavar="NAME",
                   help="mixed (default: fp16/bf16 params and grads, fp32 optimizer state), fp32, bf16")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead of markdown")


def defined_in(module: str, function: str = "add_arguments"):
    """A `module.function(parser)` that adds arguments, imported only when its subcommand is chosen."""
    return lambda p: getattr(importlib.import_module(module), function)(p)


def alias_of(add, quick: dict, **defaults):
    """Arguments of another command, parsed as that command (`jaxpar lab dryrun` is `jaxpar dryrun`), plus
    the labs' `--quick` with the values `quick`."""
    def add_as(p):
        from jaxpar.labs.arguments import add_quick
        add(p)
        add_quick(p, **quick)
        p.set_defaults(**defaults)
    return add_as


# `jaxpar lab NAME`: jaxpar/labs/NAME/lab.py provides run_from_args(args) and add_arguments(parser); where the module
# imports JAX (or torch) at its top, add_arguments lives in jaxpar/labs/arguments.py as NAME(parser), so that
# `jaxpar lab NAME --help` stays fast. Add a lab with one line here.
LABS = (
    ("zero", "module 2: DDP, ZeRO-1/2/3, FSDP: losses, memory, bytes, remat, precision",
     "Lab 02 (experiments/02_zero): same losses, different memory, different bytes."),
    ("tensor", "module 3: Megatron tensor and sequence parallelism by hand: losses, bytes, memory",
     "Lab 03 (experiments/03_tensor): manual TP and TP+SP against one device and the formulas, beside XLA's "
     "automatic TP."),
    ("pipeline", "module 3: pipeline schedules: bubble, timeline, memory vs m, p2p bytes",
     "Lab 04 (experiments/04_pipeline): GPipe, 1F1B, interleaved, ZB-H1, circular."),
    ("overlap", "modules 2-3: communication hidden behind compute: XLA's scheduler, collective matmul, ZeRO-3 prefetch",
     "Lab 05 (experiments/05_overlap): per mesh axis, the communication each compiled schedule hides (7B on 64 H100, "
     "deviceless) and the hand-written versions on CPU (same losses, profiled timelines)."),
    ("pytorch", "modules 2-3: the same model in PyTorch and jaxpar: DDP, FSDP2, TP(+SP), pipelines on N CPU processes",
     "Lab 06 (experiments/06_pytorch): losses, bytes per collective, memory, step time and lines of code of "
     "each PyTorch strategy beside jaxpar's automatic and hand-written counterpart."),
    ("moe", "module 4: MoE routing, expert parallelism, all_to_all bytes, load balance",
     "Lab 07 (experiments/07_moe): expert parallelism by hand and by XLA, the same losses; all_to_all bytes vs "
     "formula; balancing methods; capacity; MoE vs dense."),
    ("kernels", "module 5: fused kernels (agreement, memory), compilation cache and depth",
     "Lab 08 (experiments/08_kernels): Pallas kernels vs references, activation memory with flash attention and "
     "the chunked loss, compile times."),
    ("operations", "module 6: failure drill (kill, restart, goodput) and reshard drill (8 -> 4)",
     "Lab 09 (experiments/09_operations): lost time, re-done steps, goodput, resharding."),
    ("capstone", "module 7: plan a 7B Arabic LM on H100s, checked by compiles and CPU runs",
     "Lab 10 (experiments/10_capstone): writes report.md and plots into --out."),
)


def add_bench_collectives_arguments(p: argparse.ArgumentParser) -> None:
    from jaxpar.bench.options import add_bench_arguments
    add_bench_arguments(p)
    p.add_argument("--cpu-devices", type=int, metavar="N", help="run on N virtual CPU devices")


# Modules 0 and 1 are commands of their own; `jaxpar lab` lists them too, so that it names every module's lab.
LAB_ALIASES = (
    ("dryrun", "module 0: read a dry run: per-device memory, collectives, FLOPs of a step (= jaxpar dryrun)",
     "Lab 00 (experiments/00_dryrun): the same as `jaxpar dryrun`, e.g. --config configs/test.py --set "
     "model.vocab_size=512 --devices 8 (= --quick).",
     alias_of(add_dryrun_arguments, {"config": "configs/test.py", "overrides": ["model.vocab_size=512"], "devices": 8},
              subcommand="dryrun")),
    ("collectives", "module 1: collectives' bandwidth and latency vs theory (= jaxpar bench collectives)",
     "Lab 01 (experiments/01_collectives): the same as `jaxpar bench collectives`, e.g. --cpu-devices 8.",
     alias_of(add_bench_collectives_arguments, {"cpu_devices": 8, "max_bytes": "16K", "budget": 0.01},
              subcommand="bench", bench="collectives")),
)


def lab_arguments(name: str):
    """jaxpar/labs/arguments.py defines the arguments of the labs whose module imports JAX; the others their own."""
    from jaxpar.labs import arguments
    return getattr(arguments, name, None) or defined_in(f"jaxpar.labs.{name}.lab")


def lab_table():
    return (*LAB_ALIASES, *((name, summary, description, lab_arguments(name)) for name, summary, description in LABS))


def bench_table():
    return (("collectives", "bandwidth and latency of collectives vs theory", None, add_bench_collectives_arguments),)


# (name, one-line help, description, what adds its arguments: a function, or a table of sub-subcommands)
SUBCOMMANDS = (
    ("train", "train a model on a device mesh",
     "Train the configured model. The mesh sizes (mesh.data, fsdp, pipe, expert, context, tensor) place it; "
     "parallel.<axis> chooses who runs each axis: auto (the compiler) or a hand-written strategy (ddp, zero1-3, "
     "manual TP, pipeline schedules, manual EP).", add_train_arguments),
    ("sample", "generate text from a trained run", None, add_sample_arguments),
    ("launch", "start N local processes joined by jax.distributed",
     "jaxpar launch --nproc 2 --cpu-devices 4 -- train --config configs/test.py",
     defined_in("jaxpar.launch", "add_launch_arguments")),
    ("slurm", "render an sbatch script for N nodes x G GPUs (preemption, requeue, restarts)",
     "jaxpar slurm --nodes 4 --gpus-per-node 8 --out train.sbatch -- --config FILE",
     defined_in("jaxpar.cluster.slurm")),
    ("k8s", "render Kubernetes manifests (JobSet, or Indexed Job + headless Service, + the checkpoint claim)",
     "jaxpar k8s --hosts 4 --gpus-per-host 8 --image IMAGE -- --config FILE", defined_in("jaxpar.cluster.k8s")),
    ("bench", "microbenchmarks", None, bench_table),
    ("dryrun", "compile a full training step for N devices without allocating it",
     "Per-device memory, collectives by mesh axis, FLOPs and predicted step time of a config's training step, "
     "compiled for a CPU mesh or (deviceless) GPUs.", add_dryrun_arguments),
    ("memory", "model-state memory per device of DDP and ZeRO-1/2/3, any model size",
     "The ZeRO formulas for any parameter count and device count, in the ZeRO paper's accounting and in "
     "jaxpar's own (what its step stores).", add_memory_arguments),
    ("plan", "choose and defend a parallel strategy for a model on a GPU cluster",
     "Enumerate data/fsdp/tensor/pipe/expert x microbatches x remat x precision x attention; predict memory, "
     "step time, MFU, days and cost; rank and explain (course module 7, experiments/10_capstone).",
     defined_in("jaxpar.plan.command")),
    ("lab", "run a course lab (eleven labs, eight modules: jaxpar lab --help)",
     "Run a course module's lab: modules 0-7, one command each (jaxpar lab NAME --help).", lab_table),
)
NESTED_DEST = {"bench": "bench", "lab": "lab"}   # the attribute a nested subcommand's name goes to


def _add_subcommands(parser, table, dest: str, words: list[str] | None) -> None:
    """Define `table`'s subcommands; only the one `words` chooses (every one when None) gets its arguments."""
    sub = parser.add_subparsers(dest=dest, required=True, parser_class=Parser)
    chosen = words[0] if words else None
    for name, summary, description, add in table:
        p = sub.add_parser(name, help=summary, description=description or summary)
        if words is not None and name != chosen:
            continue
        if name in NESTED_DEST and dest == "subcommand":
            _add_subcommands(p, add(), NESTED_DEST[name], None if words is None else words[1:])
        else:
            add(p)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given the command line `argv`, only its subcommand's arguments are defined (and imported)."""
    parser = Parser(prog="jaxpar", description="Distributed training in JAX, measured against theory.")
    words = None if argv is None else [a for a in argv if not a.startswith("-")][:2]
    _add_subcommands(parser, SUBCOMMANDS, "subcommand", words)
    return parser


def load(args):
    """The config from --config (or the embedded default) with --set overrides applied."""
    from jaxpar.config import apply_overrides, load_config
    config = load_config(args.config)
    apply_overrides(config, args.overrides)
    return config


def train_config(args):
    """The config a `train` command runs: --config/--set, or a resumed run's saved config (+ --set)."""
    from pathlib import Path

    from jaxpar.config import ConfigError, apply_overrides
    if args.auto_resume:
        if not args.run_dir:
            raise ConfigError("--auto-resume", "needs --run-dir DIR (the run to start or continue)")
        checkpoints = Path(args.run_dir) / "checkpoints"
        args.resume = checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())
    if args.resume:
        from jaxpar.train.rundir import resume_config  # imports JAX: only a resumed run needs it here
        if not args.run_dir:
            raise ConfigError("--resume", "needs --run-dir DIR naming the run to continue")
        saved = resume_config(Path(args.run_dir)) if (Path(args.run_dir) / "config.json").is_file() else None
        if args.config or saved is None:
            config = load(args)
        else:
            config = saved
            apply_overrides(config, args.overrides)
    else:
        config = load(args)
    return config


def check(args) -> None:
    """Refuse what can be refused before JAX or a lab is imported; `args.config_loaded`: train's config."""
    from jaxpar import checks
    args.config_loaded = None
    if getattr(args, "out", None):
        if args.subcommand in ("slurm", "k8s"):
            checks.writable_file(args.out, "--out")
        else:
            checks.writable_dir(args.out, "--out")
    if args.subcommand == "train":
        args.metrics_host = checks.metrics_address(args.metrics_port, args.metrics_host)
        args.config_loaded = train_config(args)   # then every check that needs no device, before JAX:
        checks.config_before_jax(args.config_loaded, args.cpu_devices, resumed=args.resume)
        if args.config_loaded.train.tensorboard:
            from jaxpar.cluster.metrics import summary_writer_class
            summary_writer_class()
    elif args.subcommand == "sample":
        checks.sample_arguments(args.run_dir, args.prompt, args.max_tokens, args.temperature, args.top_k)
    elif args.subcommand == "bench":
        from jaxpar.bench.options import parse_sweep
        parse_sweep(args.ops, args.min_bytes, args.max_bytes, args.budget)
    elif args.subcommand == "lab" and args.lab == "overlap":   # its CPU part's --set and devices: before JAX
        importlib.import_module("jaxpar.labs.overlap.lab").check_arguments(args)


def check_started(args) -> None:
    """What needs the started job: the metrics port of this process (PORT + process index) is free."""
    if args.subcommand == "train" and args.metrics_port is not None:
        from jaxpar.checks import port_free
        port_free(args.metrics_port + sys.modules["jax"].process_index(), "--metrics-port", args.metrics_host)


def cmd_train(args) -> int:
    from jaxpar.training import train
    train(args.config_loaded, args.run_dir, resume=args.resume, overwrite=args.overwrite, profile=args.profile,
          metrics_port=args.metrics_port, metrics_linger_s=args.metrics_linger, metrics_host=args.metrics_host,
          restart=args.auto_resume and not args.resume)
    return 0


def cmd_sample(args) -> int:
    from jaxpar.train.sample import sample_run
    step, text = sample_run(args.run_dir, args.prompt, args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, seed=args.seed, notice=lambda line: print(line, file=sys.stderr))
    print(f"[step {step}] {args.prompt}{text}")
    return 0


def cmd_launch(args) -> int:
    from jaxpar.launch import run_launch
    return run_launch(args)


def cmd_bench(args) -> int:
    from jaxpar.bench.collectives import run_bench
    return run_bench(args)


def cmd_dryrun(args) -> int:
    from jaxpar.dryrun import dryrun, markdown_report, write_json
    from jaxpar.measure.targets import prepare_process
    prepare_process(args.target, args.devices)   # before JAX starts a backend
    result = dryrun(load(args), args.target, devices=args.devices, topology=args.topology)
    print(markdown_report(result))
    if args.out:
        print(f"\nwrote {write_json(result, args.out)}")
    return 0


def cmd_memory(args) -> int:
    import json

    from jaxpar.measure.memory import model_state_markdown, model_state_table
    table = model_state_table(args.params, args.devices, args.optimizer, args.precision)
    print(json.dumps(table, indent=2) if args.json else model_state_markdown(table))
    return 0


def cmd_plan(args) -> int:
    from jaxpar.plan.command import run
    if args.verify:
        from jaxpar.measure.targets import prepare_process
        prepare_process("h100", None)   # keep JAX on CPU: the compile goes through a GPU topology
    return run(args)


def cmd_lab(args) -> int:
    return importlib.import_module(f"jaxpar.labs.{args.lab}.lab").run_from_args(args)


def cmd_slurm(args) -> int:
    from jaxpar.cluster.slurm import run_from_args
    return run_from_args(args)


def cmd_k8s(args) -> int:
    from jaxpar.cluster.k8s import run_from_args
    return run_from_args(args)


LOCAL_COMMANDS = ("launch", "slurm", "k8s", "memory", "plan")   # no JAX set-up here: they import what they use

COMMANDS = {"train": cmd_train, "sample": cmd_sample, "launch": cmd_launch, "bench": cmd_bench,
            "dryrun": cmd_dryrun, "memory": cmd_memory, "plan": cmd_plan, "lab": cmd_lab,
            "slurm": cmd_slurm, "k8s": cmd_k8s}


def main(argv=None) -> int:
    """`argv` None: this process is the command, which an early preemption notice ends at once (listen_from_start)."""
    from jaxpar.train.preemption import listen_from_start, stop_listening
    argv, exit_at_once = (sys.argv[1:], True) if argv is None else (list(argv), False)
    if argv[:1] == ["train"]:   # the first thing, before any heavy import
        listen_from_start(exit_at_once)
    try:
        from jaxpar.config import ConfigError
        args = build_parser(argv).parse_args(argv)
    except BaseException:
        stop_listening()
        raise
    try:
        start_platform(args)
        check(args)
        if args.subcommand not in LOCAL_COMMANDS:
            from jaxpar.mesh import init_distributed, set_cpu_devices
            set_cpu_devices(getattr(args, "cpu_devices", None))
            init_distributed(args.config_loaded.distributed if args.config_loaded else None)
            check_started(args)
        return COMMANDS[args.subcommand](args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return _exit(EXIT_BAD_INPUT)
    except BrokenPipeError:   # `jaxpar plan | head`: the reader has gone; end as a shell pipeline does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit's flush
        return 128 + 13   # SIGPIPE
    except BaseException as err:
        if isinstance(code := getattr(err, "exit_code", None), int):   # Preempted, NonFiniteError: one line, own status
            print(err, file=sys.stderr)
            return _exit(code)
        if _multi_process():
            traceback.print_exc()
            _exit(1)
        raise
    finally:
        stop_listening()


def _multi_process() -> bool:
    if "jax" not in sys.modules:   # refused before JAX was imported: a single process, nothing to wait for
        return False
    import jax
    return jax.distributed.is_initialized()


def _exit(code: int) -> int:
    """In a multi-process job, exit at once: a normal exit waits up to 300 s in JAX's shutdown barrier."""
    if _multi_process():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
