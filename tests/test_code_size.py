"""Readable sizes: no module over 450 lines, no function over 80 (the config literal excepted). What is over today
is listed with its size and may only shrink: the test fails on a new offender and on one that got under the limit
but is still listed."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "jaxpar"
MODULE_LINES, FUNCTION_LINES = 450, 80
EXCEPTED = {("config.py", "base_config")}        # the config literal: one field per line, each commented
KNOWN_MODULES: set[str] = set()
KNOWN_FUNCTIONS: set[tuple[str, str]] = set()


def sizes():
    modules, functions = set(), set()
    for file in PACKAGE.rglob("*.py"):
        name, source = str(file.relative_to(PACKAGE)), file.read_text()
        if source.count("\n") > MODULE_LINES:
            modules.add(name)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno + 1 > FUNCTION_LINES:
                functions.add((name, node.name))
    return modules, functions - EXCEPTED


def test_no_module_or_function_grows_past_the_limits():
    modules, functions = sizes()
    assert modules - KNOWN_MODULES == set() and functions - KNOWN_FUNCTIONS == set(), "new: split them"
    assert KNOWN_MODULES - modules == set() and KNOWN_FUNCTIONS - functions == set(), "under the limit: unlist them"
