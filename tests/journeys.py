"""The commands the README, the docs pages (docs/*.md) and the lab sheets print, read from their fenced code
blocks, and each one's smoke size.

A journey is one documented command run as a user runs it (tests/test_journeys.py). The commands come from the
documents, so a command added to them is covered by construction: its subcommand must have an entry in SMOKE (the
arguments that make it small), or the journeys fail. Lines that are not whole commands (`...`, a `<placeholder>`,
`[--option]`, a shell loop's `$s`) are elided, not run. `jaxpar lab NAME ...` lines are run once per lab, as
`jaxpar lab NAME --quick` (the lab names they use must be ones `jaxpar lab --help` lists). One journey per program,
subcommand and GPU target (shape): the first such command in document order: the README, then docs/, then the labs.
"""
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
             *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "experiments").glob("*/README.md")))
SEPARATORS = {"&&", "||", ";", "|", "&"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")

TRAIN = ["--set", "train.steps=2", "--set", "train.warmup_steps=1", "--set", "train.log_every=1",
         "--set", "train.eval_every=2", "--set", "train.eval_batches=1", "--set", "train.checkpoint_every=2",
         "--set", "train.sample_tokens=4"]
# The GPU-sized presets, cut to a CPU smoke size (the preset file is still read from wherever jaxpar finds it).
BIG_PRESETS = ("configs/llama_1b.py", "configs/arabic_7b.py", "configs/mixtral_8x7b.py", "configs/deepseek_moe_16b.py")
SHRUNK = ["--set", "model.layers=1", "--set", "model.d_model=64", "--set", "model.heads=4", "--set", "model.kv_heads=2",
          "--set", "model.mlp_dim=128", "--set", "model.max_seq_len=64", "--set", "model.vocab_size=0",
          "--set", "data.vocab_size=512", "--set", "data.seq_len=32", "--set", "train.batch_size=8"]


class Skip(Exception):
    """This journey cannot run on this machine (it needs a GPU or the CUDA plugin): the reason."""


@dataclass
class Command:
    """One documented command: `jaxpar ARGV` (or `sbatch FILE`), where it is printed, its environment and redirect."""
    program: str                       # "jaxpar" or "sbatch"
    argv: list[str]
    where: str                         # "README.md:25"
    env: dict[str, str] = field(default_factory=dict)
    stdout: str | None = None          # `> FILE`

    @property
    def text(self) -> str:
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        out = [">", self.stdout] if self.stdout else []
        return " ".join([*env, self.program, *map(shlex.quote, self.argv), *out])


def logical_lines(path: Path):
    """(line number, text) of every line inside a fenced code block, continuation lines (`\\`) joined."""
    fenced, pending, start = False, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced, pending = not fenced, ""
            continue
        if not fenced:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def words(text: str) -> list[str]:
    """Shell words and operators of one line, comments dropped (quotes removed, as the shell does)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:                  # an unbalanced quote: prose in a fenced block, not a command
        return []


def commands_of(text: str, where: str) -> list[Command]:
    """The `jaxpar ...` and `sbatch ...` commands of one shell line (`a && jaxpar ...`, `ENV=x jaxpar ...`).

    A segment with parentheses is prose in a fenced table (`jaxpar (XLA) ...`), not a command.
    """
    found, segment = [], []
    for word in [*words(text), ";"]:
        if word not in SEPARATORS:
            segment.append(word)
            continue
        env = {}
        while segment and ENV_ASSIGNMENT.match(segment[0]):
            name, value = segment.pop(0).split("=", 1)
            env[name] = value
        if segment and Path(segment[0]).name in ("jaxpar", "sbatch") and not {"(", ")"} & set(segment):
            argv, stdout = segment[1:], None
            if ">" in argv:
                at = argv.index(">")
                argv, stdout = argv[:at], argv[at + 1]
            found.append(Command(Path(segment[0]).name, argv, where, env, stdout))
        segment = []
    return found


def elided(command: Command) -> bool:
    """Not a whole command: `...`, `<jobid>`, `[--out DIR]`, or a shell variable (`$s`, not `$(...)`)."""
    return any("..." in w or w.startswith(("<", "[")) or re.search(r"\$(?!\()", w) for w in command.argv)


def documented(documents=DOCUMENTS) -> list[Command]:
    """Every command the documents print, in their order (the README first)."""
    return [c for doc in documents for number, line in logical_lines(ROOT / doc)
            for c in commands_of(line, f"{doc}:{number}")]


def option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def replaced(argv: list[str], name: str, value: str) -> list[str]:
    """argv with option `name` set to `value` (added when absent)."""
    if name in argv[:-1]:
        at = argv.index(name)
        return [*argv[:at + 1], value, *argv[at + 2:]]
    return [*argv, name, value]


def split_at_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
    return (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])


@dataclass(frozen=True)
class Machine:
    """What a smoke size depends on: GPUs here, why no deviceless GPU compile can run, devices from `launch`."""
    gpu: bool = False
    plugin_problem: str | None = None
    launched: bool = False


def smoke_train(argv, machine):
    """2 steps, one eval, one checkpoint; GPU presets and Pallas kernels (interpreted on CPU: slow) on a tiny model."""
    if "model.attention=cudnn" in argv and not machine.gpu:
        raise Skip("cuDNN attention needs an NVIDIA GPU")
    tiny = option(argv, "--config") in BIG_PRESETS or (not machine.gpu and "model.attention=pallas" in argv)
    return [*argv, *(SHRUNK if tiny else []), *TRAIN]


def smoke_launch(argv, machine):
    ours, inner = split_at_dashes(argv)
    return [*ours, "--", *smoke(inner, Machine(machine.gpu, machine.plugin_problem, launched=True))]


def smoke_emitter(argv, machine):
    """slurm, k8s: the train arguments after `--` made small too, so the job they write stays small."""
    ours, train = split_at_dashes(argv)
    return [*ours, "--", *train, *TRAIN] if "--" in argv else argv


def smoke_dryrun(argv, machine):
    if "--target" in argv and machine.plugin_problem:
        raise Skip(f"a deviceless GPU dry run needs the CUDA plugin: {machine.plugin_problem}")
    return argv


def smoke_bench(argv, machine):
    assert argv[:1] == ["collectives"], f"no smoke size for `jaxpar bench {argv[:1]}`"
    if "--cpu-devices" not in argv and not (machine.gpu or machine.launched):
        raise Skip("without --cpu-devices the collectives run on this machine's GPUs")
    return replaced(replaced(argv, "--min-bytes", "1K"), "--max-bytes", "4K")


def smoke_plan(argv, machine):
    if argv[:1] == ["collect"]:
        return argv
    if "--verify" in argv and machine.plugin_problem:
        raise Skip(f"--verify compiles deviceless for GPUs and needs the CUDA plugin: {machine.plugin_problem}")
    if "--sweep" in argv:
        argv = replaced(replaced(argv, "--sweep", "2"), "--steps", "2")
        return [*argv, "--set", "model.layers=1", "--global-batch", "8", "--seq-len", "16"]
    return argv


# subcommand -> (argv after it, Machine) -> the smoke-size argv, or Skip. A documented subcommand missing here fails.
SMOKE = {
    "train": smoke_train,
    "sample": lambda argv, machine: [*argv, "--max-tokens", "4"],
    "launch": smoke_launch,
    "dryrun": smoke_dryrun,
    "memory": lambda argv, machine: argv,
    "bench": smoke_bench,
    "plan": smoke_plan,
    "slurm": smoke_emitter,
    "k8s": smoke_emitter,
}


def subcommand(argv: list[str]) -> str:
    return next((w for w in argv if not w.startswith("-")), "")


def smoke(argv: list[str], machine: Machine = Machine()) -> list[str]:
    """The smoke-size argv of `jaxpar argv`, or Skip; a subcommand without an entry in SMOKE is an AssertionError."""
    name = argv[0] if argv else ""
    assert name in SMOKE, (f"`jaxpar {name}` is documented but has no smoke size: add an entry to SMOKE in "
                           f"tests/journeys.py (journeys: {sorted(SMOKE)})")
    return [name, *SMOKE[name](argv[1:], machine)]


def shape(command: Command) -> tuple:
    """What makes two commands one journey: program, subcommands, GPU target, what it writes for a later command
    (`--out`); not the preset, other options or --set.

    A journey checks that a documented entry point runs from an installed wheel in another folder with the files it
    names; the strategies a `--set` picks, each option's effect and each preset's contents are the unit tests' work
    (tests/test_config.py loads every preset from another folder), and every journey costs a process start and,
    mostly, a compile.
    """
    argv = command.argv
    positional = tuple(w for w in argv[:2] if not w.startswith("-"))
    inner = split_at_dashes(argv)[1] if argv[:1] == ["launch"] else []
    deviceless = option(argv, "--target")               # a deviceless GPU compile (where the CUDA plugin is)
    made = option(argv, "--out")                        # a file or folder a later command (sbatch, collect) reads
    return command.program, positional, deviceless, tuple(inner[:2]), made


def journeys(documents=DOCUMENTS) -> tuple[list[Command], list[str]]:
    """The documented non-lab commands to run (one per shape, in document order), and the lab names documented."""
    chosen, seen, labs = [], set(), []
    for command in documented(documents):
        if command.program == "jaxpar" and command.argv[:1] == ["lab"]:
            labs.append(subcommand(command.argv[1:]))
            continue
        if elided(command) or shape(command) in seen:
            continue
        seen.add(shape(command))
        chosen.append(command)
    return chosen, labs


def lab_names(help_text: str) -> list[str]:
    """The labs `jaxpar lab --help` lists: its `{a,b,...}` choice."""
    choice = re.search(r"\{([a-z0-9_,-]+)\}", help_text)
    assert choice, f"no list of labs in `jaxpar lab --help`:\n{help_text}"
    return choice.group(1).split(",")
