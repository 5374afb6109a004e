"""`jaxpar plan --strategy TEXT`: one candidate written as the planner's labels write it.

Words, separated by spaces or commas (the label of any ranked row parses back to its candidate):
  data=8 fsdp=8 tp=2 pipe=4 ep=2      mesh sizes (tensor= and expert= also); <data implementation>=N, e.g.
                                      zero1=8 / zero3=8 / ddp=8: `data` run by that registered strategy
  cp=2 (context=2)                    context parallelism: the sequence split over a `context` axis inside
                                      attention (parallel/context.py); dense models, without pipe, ep, sp or a
                                      ZeRO/DDP data implementation (what the registry runs with it)
  ring / all_to_all (context_impl=)   how attention crosses the split (parallel.context); default ring
  sp (sequence)                       sequence parallelism over tensor (Megatron's; needs tp=N > 1)
  async-tp (async-tp=bidirectional)   async TP: parallel.tensor_overlap=collective_matmul (bidirectional), SP's
                                      gathers and reduce-scatters as rings inside the matmuls; needs tp=N > 1 and
                                      sp, and runs Megatron's hand-written tensor axis (parallel.tensor=manual)
  m=4 (microbatches=4)                gradient accumulation, or a pipeline's microbatches; left out with
                                      pipe > 1, the planner's rule chooses it (the fastest m that fits)
  1f1b / gpipe / interleaved / ...    the pipeline schedule (schedule=...): every one the strategy registry
                                      runs; default 1f1b when pipe > 1
  v=4 (virtual=4)                     chunks per stage of interleaved (default 2; must divide layers / pipe)
  dist-opt                            the distributed optimizer (plan/layouts.py): ZeRO-1 over data with
                                      Megatron's bf16 parameters, in any mesh (pipe, expert included)
  dist-opt=bf16-grads                 the same with bf16 gradients (NeMo's grad_sync_dtype=bf16)
  remat=none|dots|full                default full
  bf16 / fp8 / fp32 (precision=...)   default bf16
  dot / flash (attention=...)         default flash on GPU, dot on CPU
  <axis>=N / <implementation>=N       an axis a registered strategy adds (jaxpar/strategies.py): its size, run
                                      by that implementation (<axis>=N: the first its strategy lists)
Sizes the text leaves out are 1; `devices` (when given) must be their product.
"""
from __future__ import annotations

from jaxpar.config import ConfigError

AXIS_WORDS = {"data": "data", "fsdp": "fsdp", "tensor": "tensor", "tp": "tensor", "pipe": "pipe", "pp": "pipe",
              "expert": "expert", "ep": "expert", "context": "context", "cp": "context"}
PRECISION_WORDS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp8": "float8", "float8": "float8",
                   "fp32": "float32", "float32": "float32"}
ATTENTIONS = ("dot", "flash")
REMATS = ("none", "dots", "full")
TENSOR_OVERLAPS = ("none", "collective_matmul", "bidirectional")     # parallel.tensor_overlap (config_checks.py)
FLAGS = {"sp": ("sequence", True), "sequence": ("sequence", True),
         "dist-opt": ("layout", "distributed-optimizer"), "distributed-optimizer": ("layout", "distributed-optimizer"),
         "async-tp": ("tensor_overlap", "collective_matmul")}
FIELD = "--strategy"


def registered() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(data implementations, pipeline schedules, context implementations) the strategy registry runs
    (parallel/registry.py), auto aside."""
    from jaxpar.parallel.registry import implementations
    valid = implementations()
    data, pipe, context = (tuple(n for n in valid[axis] if n != "auto") for axis in ("data", "pipe", "context"))
    return data, pipe, context


def added_words() -> dict[str, tuple[str, str]]:
    """The words of the added axes (parallel/registry.py's `added_implementations`): each axis and each of its
    implementations -> (axis, implementation)."""
    from jaxpar.parallel.registry import added_implementations
    words = {}
    for axis, impls in added_implementations().items():
        words.update({impl: (axis, impl) for impl in impls})
        words[axis] = (axis, impls[0])
    return words


def _positive(word: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(FIELD, f"'{word}': the value must be a positive whole number")
    return int(value)


def _word(word: str, fields: dict) -> None:
    """The fields one word sets, into `fields`."""
    data_impls, schedules, context_impls = registered()
    added = added_words()
    key, _, value = word.partition("=")
    if not value and word in FLAGS:
        fields[FLAGS[word][0]] = FLAGS[word][1]
    elif not value and word in PRECISION_WORDS:
        fields["precision"] = PRECISION_WORDS[word]
    elif not value and word in ATTENTIONS:
        fields["attention"] = word
    elif not value and word in schedules:
        fields["schedule"] = word
    elif not value and word in context_impls or key == "context_impl" and value in context_impls:
        fields["context_impl"] = value or word
    elif value and key in AXIS_WORDS:
        fields[AXIS_WORDS[key]] = _positive(word, value)
    elif value and key in data_impls:
        fields["data"], fields["data_impl"] = _positive(word, value), key
    elif value and key in added:                 # gathered into the candidate's `added` by parse_strategy
        fields[added[key][0]] = (_positive(word, value), added[key][1])
    elif key in ("m", "microbatches") and value:
        fields["microbatches"] = _positive(word, value)
    elif key in ("v", "virtual") and value:
        fields["virtual"] = _positive(word, value)
    elif key in ("dist-opt", "distributed-optimizer") and value == "bf16-grads":
        fields["layout"] = "distributed-optimizer-bf16-grads"
    elif key in ("async-tp", "tensor_overlap") and value in TENSOR_OVERLAPS:
        fields["tensor_overlap"] = value
    elif key == "remat" and value in REMATS:
        fields["remat"] = value
    elif key == "precision" and value in PRECISION_WORDS:
        fields["precision"] = PRECISION_WORDS[value]
    elif key == "attention" and value in ATTENTIONS:
        fields["attention"] = value
    elif key == "schedule" and value in schedules:
        fields["schedule"] = value
    else:
        raise ConfigError(FIELD, f"'{word}' is not understood; valid: data|fsdp|tp|pipe|ep|cp|"
                          f"{'|'.join([*data_impls, *added])}=N, {'|'.join(context_impls)}, sp, "
                          f"async-tp[={'|'.join(TENSOR_OVERLAPS[1:])}], m=N, v=N, dist-opt[=bf16-grads], "
                          f"remat={'|'.join(REMATS)}, bf16|fp8|fp32, dot|flash, {'|'.join(schedules)}")


def _check_context(fields: dict) -> None:
    """cp=N: the context axis composes with data, fsdp and the compiler's tensor axis (parallel/context.py), as
    the space offers it (plan/space.py); ring / all_to_all need cp=N > 1, which defaults to ring."""
    context, impl = fields.get("context", 1), fields.get("context_impl")
    if context == 1:
        if impl:
            raise ConfigError(FIELD, f"'{impl}' says how attention crosses a context split: it needs cp=N with N > 1")
        return
    fields.setdefault("context_impl", "ring")
    others = [w for w, on in ((f"pipe={fields.get('pipe')}", fields.get("pipe", 1) > 1),
                              (f"ep={fields.get('expert')}", fields.get("expert", 1) > 1),
                              ("sp", fields.get("sequence"))) if on]
    if others:
        raise ConfigError(FIELD, f"cp={context} with {' '.join(others)}: context parallelism runs over data, fsdp "
                          "and tensor (without sp) only; no strategy of the registry builds it with "
                          f"{' or '.join(others)}")


def _check(fields: dict) -> None:
    """What the words say together: sp needs a tensor axis, async TP sp, v= an interleaved pipeline, dist-opt
    `data=`, cp what context parallelism composes with."""
    _check_context(fields)
    pipe, schedule = fields.get("pipe", 1), fields.get("schedule", "")
    if fields.get("sequence") and fields.get("tensor", 1) < 2:
        raise ConfigError(FIELD, "'sp' splits the activations over tensor: it needs tp=N with N > 1")
    overlap = fields.get("tensor_overlap", "none")
    if overlap != "none" and not fields.get("sequence"):
        raise ConfigError(FIELD, f"async TP (tensor_overlap={overlap}) overlaps sequence parallelism's all-gather "
                          "and reduce-scatter: it needs tp=N with N > 1 and sp")
    virtual = fields.get("virtual")
    if virtual is not None and not (pipe > 1 and (schedule == "interleaved" and virtual >= 2
                                                  or schedule == "dualpipev" and virtual == 2)):
        raise ConfigError(FIELD, f"'v={virtual}': chunks per stage need pipe=N > 1 with interleaved (v >= 2) "
                          "or dualpipev (v=2)")
    if fields.get("layout") and fields.get("data_impl", "auto") != "auto":
        raise ConfigError(FIELD, f"'dist-opt' splits the optimizer over data itself; write data={fields['data']}, "
                          f"not {fields['data_impl']}={fields['data']}")


def _check_predicted(cand) -> None:
    """A strategy of the registry must run (and so predict) the candidate: `zero1=8 pipe=4` has none."""
    from jaxpar.parallel.registry import strategy_for
    try:
        strategy_for(cand.impls)
    except ConfigError as err:
        hint = (f"; for ZeRO-1 over data in this mesh write data={cand.data} dist-opt (the distributed optimizer)"
                if cand.data_impl != "auto" else "")
        raise ConfigError(FIELD, f"'{cand.label()}': {err}{hint}") from None


def parse_strategy(text: str, devices: int | None = None, platform: str = "gpu"):
    """The `Candidate` `text` describes (see the module docstring); ConfigError naming --strategy otherwise.
    With pipe > 1 and no m= its microbatches are 0: `planner.plan` chooses them (`planner.choose_microbatches`)."""
    from jaxpar.parallel.theory import Candidate
    fields: dict = {"attention": "flash" if platform == "gpu" else "dot"}
    words = text.replace(",", " ").split()
    if not words:
        raise ConfigError(FIELD, "is empty; e.g. --strategy 'fsdp=64 m=2 remat=dots bf16 flash'")
    said: dict[str, tuple[str, object]] = {}   # field: (the word that set it, its value)
    for word in words:
        got: dict = {}
        _word(word, got)
        for field, setting in got.items():
            if field in said and said[field][1] != setting:   # `bf16 fp32`, `m=2 m=4`: the last used to win
                raise ConfigError(FIELD, f"'{word}' contradicts '{said[field][0]}'; say each setting once")
            said[field] = (word, setting)
        fields.update(got)
    if fields.get("pipe", 1) > 1:
        fields.setdefault("schedule", "1f1b")
        fields.setdefault("microbatches", 0)       # chosen by the planner's rule
    else:
        fields["schedule"] = ""
    _check(fields)
    if fields.get("tensor_overlap", "none") != "none":
        fields["tensor_impl"] = "manual"            # jaxpar's async TP is the hand-written tensor axis' rings
    from jaxpar.strategies import added_axes
    fields["added"] = tuple((axis, *fields.pop(axis)) for axis in added_axes() if axis in fields)
    cand = Candidate(**fields)
    _check_predicted(cand)
    if devices is not None and cand.devices != devices:
        raise ConfigError(FIELD, f"'{text}' uses {cand.devices} devices; the cluster has {devices} "
                          "(the mesh sizes' product must equal --nodes x --gpus-per-node)")
    return cand


def check_fits_model(cand, shape) -> None:
    """What only the model can refuse: pipe x chunks per stage (v) must divide the model's layers; cp needs a
    dense model, and all_to_all whole heads on each device (config_checks.validate_context)."""
    if cand.context > 1 and shape.moe and shape.moe.experts:
        raise ConfigError(FIELD, f"cp={cand.context}: the model has {shape.moe.experts} experts; context parallelism "
                          "is built for dense models: leave cp out")
    split = cand.context * cand.tensor
    if cand.context_impl == "all_to_all" and (shape.heads % split or shape.kv_heads % split):
        raise ConfigError(FIELD, f"all_to_all gives each device whole heads: cp={cand.context} x tp={cand.tensor} "
                          f"must divide the model's {shape.heads} heads and {shape.kv_heads} kv heads; use ring")
    if cand.pipe > 1 and shape.layers % (cand.pipe * cand.virtual):
        raise ConfigError(FIELD, f"pipe={cand.pipe} x v={cand.virtual} chunks per stage do not divide the model's "
                          f"{shape.layers} layers; use a pipe and a v whose product divides {shape.layers}")
