"""The configuration reference, generated from jaxpar/config.py's base_config(): one table per section.

Field, type and default come from the config itself; the description is the field's comment in config.py (so the
reference cannot drift from the code); valid values come from the tuples config_checks.py validates against and, for
`parallel.<axis>`, from the strategy registry. The docs build calls `reference()` (docs/hooks.py); run this file to
print the page.
"""
from __future__ import annotations

import ast
import inspect
import io
import tokenize

import ml_collections

from jaxpar import config as config_module
from jaxpar.config_checks import (
    COMPUTE_DTYPES,
    FAULT_SIGNALS,
    KERNEL_CHOICES,
    MOE_DISPATCH,
    MOE_ROUTERS,
    REMAT_POLICIES,
)


def valid_values() -> dict[str, tuple[str, ...]]:
    """The fields whose values are one of a list the checks hold (the registry's for the parallel axes)."""
    from jaxpar.parallel.registry import implementations  # imports the strategies (JAX): only when building

    valid = {f"model.{field}": choices for field, choices in KERNEL_CHOICES.items()}
    valid |= {"train.compute_dtype": COMPUTE_DTYPES, "train.remat": REMAT_POLICIES,
              "train.fault_signal": FAULT_SIGNALS, "model.moe.router": MOE_ROUTERS,
              "model.moe.dispatch": MOE_DISPATCH}
    valid |= {f"parallel.{axis}": names for axis, names in implementations().items()}
    return valid


def comments() -> dict[str, str]:
    """Each `c.<path> = ...` line's comment in base_config(), with the comment-only lines that continue it."""
    source = inspect.getsource(config_module.base_config)
    by_line: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            by_line[token.start[0]] = token.string.lstrip("#").strip()
    assigned: dict[int, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            assigned[node.lineno] = ast.unparse(node.targets[0]).removeprefix("c.")
    found: dict[str, str] = {}
    lines = source.splitlines()
    for number, path in assigned.items():
        text = [by_line[number]] if number in by_line else []
        follow = number + 1
        while follow in by_line and lines[follow - 1].lstrip().startswith("#"):
            text.append(by_line[follow])
            follow += 1
        found[path] = " ".join(text)
    return found


def cell(text: str) -> str:
    """Markdown table cell: `|` escaped."""
    return text.replace("|", "\\|")


def sections(config: ml_collections.ConfigDict, notes: dict[str, str], valid: dict[str, tuple[str, ...]]):
    """(section, its comment, [(field, type, default, valid, description)]) in base_config()'s order."""
    out: dict[str, tuple[str, list]] = {}
    for path in notes:                                   # every assigned path, in source order
        value = config
        for part in path.split("."):
            value = value[part]
        section = path.rpartition(".")[0] or "run"
        if isinstance(value, ml_collections.ConfigDict):
            out[path] = (notes[path], [])
            continue
        choices = ", ".join(f"`{v}`" for v in valid.get(path, ()))
        row = (f"`{path}`", type(value).__name__, f"`{value!r}`", choices, cell(notes[path]))
        out.setdefault(section, ("", []))[1].append(row)
    return [(name, note, fields) for name, (note, fields) in out.items()]


def reference() -> str:
    """The page: one table per config section, in base_config()'s order."""
    out = ["# Configuration reference", "",
           "Every field of `jaxpar.config.base_config()` (what `configs/default.py` returns), generated from "
           "`jaxpar/config.py` when the docs are built: the type a `--set section.field=value` must parse as, "
           "the default, the values the checks accept where they are a list (`jaxpar/config_checks.py`; for "
           "`parallel.<axis>` the strategy registry, `jaxpar/parallel/registry.py`), and the field's comment in "
           "`config.py`. The other checks (ranges, divisibility by the mesh) are in `jaxpar/config_checks.py`; "
           "a value they refuse exits 2 with one line naming the field and what is valid.", ""]
    for section, note, fields in sections(config_module.base_config(), comments(), valid_values()):
        if not fields:
            continue
        out += [f"## {section}", ""]
        if note:
            out += [note, ""]
        out += ["| field | type | default | valid values | description |", "|---|---|---|---|---|"]
        out += ["| " + " | ".join(row) + " |" for row in fields]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(reference())
