"""`jaxpar plan --strategy TEXT`: one candidate written as the planner's labels write it.

Words, separated by spaces or commas (the label of any ranked row parses back to its candidate):
  data=8 fsdp=8 tp=2 pipe=4 ep=2      mesh sizes (tensor= and expert= also); zero1=8 / zero3=8 / ddp=8: `data`
                                      run by parallel/zero.py's stage
  m=4 (microbatches=4)                gradient accumulation, or a pipeline's microbatches
  1f1b / gpipe / interleaved / zb-h1  the pipeline schedule (schedule=...); default 1f1b when pipe > 1
  remat=none|dots|full                default full
  bf16 / fp8 / fp32 (precision=...)   default bf16
  dot / flash (attention=...)         default flash on GPU, dot on CPU
Sizes the text leaves out are 1; `devices` (when given) must be their product.
"""
from __future__ import annotations

from jaxpar.config import ConfigError

AXIS_WORDS = {"data": "data", "fsdp": "fsdp", "tensor": "tensor", "tp": "tensor", "pipe": "pipe", "pp": "pipe",
              "expert": "expert", "ep": "expert"}
DATA_IMPLS = ("ddp", "zero1", "zero2", "zero3")
PRECISION_WORDS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp8": "float8", "float8": "float8",
                   "fp32": "float32", "float32": "float32"}
ATTENTIONS = ("dot", "flash")
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")
REMATS = ("none", "dots", "full")
FIELD = "--strategy"


def _positive(word: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(FIELD, f"'{word}': the value must be a positive whole number")
    return int(value)


def _keyed(key: str, value: str, word: str, fields: dict) -> None:
    if key in AXIS_WORDS:
        fields[AXIS_WORDS[key]] = _positive(word, value)
    elif key in DATA_IMPLS:
        fields["data"], fields["data_impl"] = _positive(word, value), key
    elif key in ("m", "microbatches"):
        fields["microbatches"] = _positive(word, value)
    elif key == "remat" and value in REMATS:
        fields["remat"] = value
    elif key == "precision" and value in PRECISION_WORDS:
        fields["precision"] = PRECISION_WORDS[value]
    elif key == "attention" and value in ATTENTIONS:
        fields["attention"] = value
    elif key == "schedule" and value in SCHEDULES:
        fields["schedule"] = value
    else:
        raise ConfigError(FIELD, f"'{word}' is not understood; valid: data|fsdp|tp|pipe|ep|zero1|zero3=N, m=N, "
                          f"remat={'|'.join(REMATS)}, bf16|fp8|fp32, dot|flash, {'|'.join(SCHEDULES)}")


def parse_strategy(text: str, devices: int | None = None, platform: str = "gpu"):
    """The `Candidate` `text` describes (see the module docstring); ConfigError naming --strategy otherwise."""
    from jaxpar.parallel.theory import Candidate
    fields: dict = {"attention": "flash" if platform == "gpu" else "dot"}
    words = text.replace(",", " ").split()
    if not words:
        raise ConfigError(FIELD, "is empty; e.g. --strategy 'fsdp=64 m=2 remat=dots bf16 flash'")
    said: dict[str, tuple[str, object]] = {}   # field: (the word that set it, its value)
    for word in words:
        key, _, value = word.partition("=")
        got: dict = {}
        if not value:
            if word in PRECISION_WORDS:
                got["precision"] = PRECISION_WORDS[word]
            elif word in ATTENTIONS:
                got["attention"] = word
            elif word in SCHEDULES:
                got["schedule"] = word
            else:
                _keyed(word, "", word, got)
        else:
            _keyed(key, value, word, got)
        for field, setting in got.items():
            if field in said and said[field][1] != setting:   # `bf16 fp32`, `m=2 m=4`: the last used to win
                raise ConfigError(FIELD, f"'{word}' contradicts '{said[field][0]}'; say each setting once")
            said[field] = (word, setting)
        fields.update(got)
    if fields.get("pipe", 1) > 1:
        fields.setdefault("schedule", "1f1b")
    else:
        fields["schedule"] = ""
    cand = Candidate(**fields)
    if devices is not None and cand.devices != devices:
        raise ConfigError(FIELD, f"'{text}' uses {cand.devices} devices; the cluster has {devices} "
                          "(the mesh sizes' product must equal --nodes x --gpus-per-node)")
    return cand
