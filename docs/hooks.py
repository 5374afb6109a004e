"""MkDocs hooks (mkdocs.yml `hooks:`): the generated configuration reference and the lab sheets in the site.

The lab sheets live beside their labs (experiments/NN_name/README.md, with their figures), outside docs/. The pages
in docs/ link to them as `../experiments/...`, which is right when reading the repository; for the site, the sheets
and their files are added under `experiments/` and those links lose their `../`, so `mkdocs build --strict` checks
every one of them.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.structure.files import File

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
LABS = "experiments"                 # the lab sheets' folder, relative to the repository root
REFERENCE = "reference/configuration.md"


def _generator():
    """docs/gen_config_reference.py as a module (hooks are loaded by path, so docs/ is not on sys.path)."""
    spec = importlib.util.spec_from_file_location("gen_config_reference", DOCS / "gen_config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_config(config):
    """The nav's last section, Labs: every lab sheet, titled by its first heading."""
    sheets = sorted((ROOT / LABS).glob("*/README.md"))
    config.nav.append({"Labs": [{_title(sheet): sheet.relative_to(ROOT).as_posix()} for sheet in sheets]})
    return config


def _title(sheet: Path) -> str:
    """A sheet's first `# ` heading (its folder's name if it has none)."""
    heading = next((line for line in sheet.read_text().splitlines() if line.startswith("# ")), None)
    return heading[2:].strip() if heading else sheet.parent.name


def on_files(files, config):
    """Add the configuration reference and every lab sheet with its files, figures/ included (not the labs'
    Python)."""
    files.append(File.generated(config, REFERENCE, content=_generator().reference()))
    for path in sorted((ROOT / LABS).glob("*/**/*")):
        if path.is_file() and path.suffix != ".py" and "__pycache__" not in path.parts:
            files.append(File.generated(config, path.relative_to(ROOT).as_posix(), abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    """A top-level page's `../experiments/` links point at the sheets the site now holds."""
    if "/" not in page.file.src_uri:
        markdown = markdown.replace(f"](../{LABS}/", f"]({LABS}/")
    return markdown
