"""`--help` of every command is fast and never imports JAX (the import check is the guard, the time a smoke check).

Each help runs in a fresh interpreter, as a shell runs it. The bound is generous (3 s) so
that a loaded CI machine does not fail it; the measured times print with `-s`.
"""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxpar.cli import LAB_ALIASES, LABS, SUBCOMMANDS

HELP_BOUND_S = 3.0
PROBE = ("import sys; from jaxpar.cli import main\n"
         "try:\n    main(sys.argv[1:])\nexcept SystemExit as exit_:\n    assert exit_.code in (0, None), exit_.code\n"
         "print('jax imported' if 'jax' in sys.modules else 'jax not imported', file=sys.stderr)")
COMMANDS = [[], *[[name] for name, *_ in SUBCOMMANDS], ["bench", "collectives"],
            *[["lab", name] for name, *_ in (*LAB_ALIASES, *LABS)]]


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(words) or "jaxpar" for words in COMMANDS])
def test_help_is_fast_and_never_imports_jax(words):
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PROBE, *words, "--help"], capture_output=True, text=True,
                            timeout=60)
    seconds = time.perf_counter() - start
    print(f"jaxpar {' '.join(words)} --help: {seconds:.2f} s")
    assert result.returncode == 0, result.stderr
    assert "usage: jaxpar" in result.stdout
    assert result.stderr.strip().splitlines()[-1] == "jax not imported"
    assert seconds < HELP_BOUND_S


def lab_modules() -> dict[str, int]:
    """Lab name -> course module, from each lab's one-line help ("module N: ...")."""
    return {name: int(m.group(1)) for name, summary, *_ in (*LAB_ALIASES, *LABS)
            if (m := re.match(r"module (\d+):", summary))}


def test_lab_help_names_all_eight_modules_with_their_command():
    result = subprocess.run([sys.executable, "-m", "jaxpar.cli", "lab", "--help"], capture_output=True, text=True,
                            timeout=60)
    listing = " ".join(result.stdout.split())
    assert set(lab_modules().values()) >= set(range(8))
    for name, module in lab_modules().items():
        assert f" {name} module {module}: " in listing, name   # `jaxpar lab NAME` beside its module


def test_the_readme_module_table_gives_the_same_commands():
    """The learning path: each lab once, numbered 00, 01, ... in the table's (the course's) order, beside its module."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("## Course modules"):]
    rows = [line.split(" | ") for line in section.splitlines() if re.match(r"\| \d\d \| ", line)]
    assert [int(row[0][2:]) for row in rows] == list(range(len(rows)))   # no number twice, none skipped
    assert {int(m) for row in rows for m in re.findall(r"\d+", row[1])} >= set(range(8))
    for name, module in lab_modules().items():   # a module may have several rows (module 3: tensor, pipeline)
        assert any(str(module) in re.findall(r"\d+", row[1]) and f"`jaxpar lab {name}`" in row[3] for row in rows), \
            (name, module)
    from jaxpar.cli import LAB_ALIASES, LABS
    commands = {re.search(r"`jaxpar lab (\w+)`", row[3]).group(1) for row in rows}
    assert commands == {lab[0] for lab in LABS + LAB_ALIASES}   # every lab has its row, and only labs


def test_the_readme_is_a_front_page():
    """At most 12 KB (issue 30): what jaxpar is, the two commands, the learning path, links; the rest is in docs/."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_bytes()
    assert len(readme) <= 12 * 1024, f"README.md is {len(readme)} bytes: move a section to docs/ (mkdocs.yml)"


def test_lab_aliases_are_the_module_commands():
    from jaxpar.cli import build_parser
    argv = ["lab", "dryrun", "--devices", "8"]
    args = build_parser(argv).parse_args(argv)
    assert (args.subcommand, args.devices) == ("dryrun", 8)
    for argv in (["lab", "collectives", "--ops", "psum", "--cpu-devices", "8"],
                 ["bench", "collectives", "--ops", "psum", "--cpu-devices", "8"]):
        args = build_parser(argv).parse_args(argv)
        assert (args.subcommand, args.bench, args.ops, args.cpu_devices) == ("bench", "collectives", "psum", 8)
