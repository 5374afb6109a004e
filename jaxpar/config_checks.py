"""What a valid config is: the allowed values, the mesh sizes, and every check made before JAX compiles anything.

Split from config.py (which builds and loads configs) so that each file holds one concept; both stay free of JAX,
since the command line validates before importing it. Bad input raises `ConfigError`, which names the field and
what would be valid: one clear line, never a traceback from deep inside XLA.
"""
from __future__ import annotations

import math

from jaxpar.strategies import mesh_axes

COMPUTE_DTYPES = ("float32", "bfloat16", "float8")
REMAT_POLICIES = ("none", "full", "dots", "names")
# What train.remat="names" can keep: the activations model/transformer.py tags with checkpoint_name.
REMAT_NAMES = ("attn_out", "mlp_out")
FAULT_SIGNALS = ("SIGKILL", "SIGTERM", "SIGUSR1")
MOE_ROUTERS = ("softmax", "noisy", "sigmoid")
MOE_DISPATCH = ("dropless", "capacity")
EXPERT_EXCHANGES = ("auto", "ragged", "capacity", "padded")   # parallel/expert_exchange.py


class ConfigError(ValueError):
    """Bad input: `field` names the config field (or argument), the message says what is valid."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


def mesh_shape(config, num_devices: int, platform: str | None = None) -> dict[str, int]:
    """Mesh axis sizes with a single -1 filled from the device count. `platform`: the devices' (one process's
    run), so that a CPU run is told the `--cpu-devices N` that gives it the devices the mesh asks for."""
    sizes = {axis: int(config.mesh[axis]) for axis in mesh_axes()}
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}", f"is {size}; use a positive size or -1 (fill)")
    fill = [axis for axis, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ConfigError(f"mesh.{fill[1]}", f"only one mesh axis may be -1, got {', '.join(fill)}")
    fixed = 1
    for size in sizes.values():
        fixed *= size if size > 0 else 1
    if fill:
        if num_devices % fixed:
            raise ConfigError(f"mesh.{fill[0]}", f"cannot fill: the other axes use {fixed} devices, "
                              f"which does not divide the {num_devices} devices available")
        sizes[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        product = " x ".join(f"{a}={s}" for a, s in sizes.items() if s > 1) or "1"
        cpu = f", or on CPU run with --cpu-devices {fixed}" if platform == "cpu" else ""
        raise ConfigError("mesh", f"{product} uses {fixed} devices but {num_devices} are available; "
                          f"make the product equal the device count or set one axis to -1{cpu}")
    return sizes


def head_dim(model) -> int:
    return model.head_dim or model.d_model // model.heads


KERNEL_CHOICES = {"attention": ("dot", "xla", "cudnn", "pallas", "auto"), "norm": ("xla", "pallas", "auto"),
                  "loss": ("full", "chunked", "auto")}
FUSED_ATTENTION = ("cudnn", "pallas")    # the model.attention values that run a fused (flash) kernel


def fused_attention(kernel: str, platform: str) -> bool:
    """Whether `model.attention` (or the implementation it resolved to) is a fused flash kernel on `platform`:
    cudnn and pallas are; auto is on GPU."""
    return kernel in FUSED_ATTENTION or (kernel == "auto" and platform == "gpu")


def flash_tileable(size: int) -> bool:
    """Whether jaxpar's Pallas flash attention takes `size` as its head dimension or a block: a power of two
    >= 16 (the rule `auto` follows in kernels/kernel_ops.py and the config check refuses by)."""
    return size >= 16 and not size & (size - 1)


def check_kernel_choices(m) -> None:
    """model.attention / norm / loss each name a kernel jaxpar has (ConfigError naming the field)."""
    for field, valid in KERNEL_CHOICES.items():
        if m[field] not in valid:
            raise ConfigError(f"model.{field}", f"is '{m[field]}'; valid: {', '.join(valid)}")


def _validate_kernels(m) -> None:
    """model.attention / norm / loss and the kernels' sizes (the backend is checked in kernels/kernel_ops.py)."""
    check_kernel_choices(m)
    for field in ("attention_block_q", "attention_block_kv"):
        size = m[field]
        if not flash_tileable(size):
            raise ConfigError(f"model.{field}", f"is {size}; flash attention blocks are powers of two >= 16")
    dh = head_dim(m)
    if m.attention == "pallas" and not flash_tileable(dh):
        raise ConfigError("model.head_dim", f"is {dh}; model.attention=pallas needs a power of two >= 16 "
                          "(64 and 128 are the tuned sizes); use xla or dot attention")
    if m.loss_chunk < 1:
        raise ConfigError("model.loss_chunk", f"is {m.loss_chunk}; must be at least 1 sequence position")


def _finite_in(value, field: str, low: float, high: float = math.inf, *, low_open=False, high_open=False,
               valid: str = "") -> None:
    """`value` is a finite number in the interval low..high (open where said)."""
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if not math.isfinite(value) or below or above:
        raise ConfigError(field, f"is {value}; {valid}")


def _validate_optimizer(t) -> None:
    """train.* of AdamW, the schedule and clipping: values that would train nothing, or NaN, at once."""
    _finite_in(t.lr, "train.lr", 0, low_open=True, valid="must be a finite positive number, e.g. 3e-3")
    _finite_in(t.eps, "train.eps", 0, low_open=True, valid="Adam's epsilon must be positive, e.g. 1e-8")
    for field in ("b1", "b2"):
        _finite_in(t[field], f"train.{field}", 0, 1, high_open=True, valid="Adam's betas are in [0, 1), e.g. 0.9")
    _finite_in(t.min_lr_ratio, "train.min_lr_ratio", 0, 1, valid="the final lr as a fraction of train.lr: 0..1")
    _finite_in(t.weight_decay, "train.weight_decay", 0, valid="must be 0 (off) or positive, e.g. 0.1")
    _finite_in(t.grad_clip, "train.grad_clip", 0, low_open=True, valid="the global-norm clip must be positive, "
               "e.g. 1.0 (a huge value turns clipping off)")
    if t.warmup_steps < 0:
        raise ConfigError("train.warmup_steps", f"is {t.warmup_steps}; must be 0 (no warmup) or positive")


def _validate_run_options(config) -> None:
    """Fault injection, the end-of-run sample, the data order, the distributed timeouts."""
    t = config.train
    if not config.name or config.name.startswith(".") or any(c in config.name for c in "/\\\0"):
        raise ConfigError("name", f"is {config.name!r}; the run's folder under runs/ is named after it: give a "
                          "plain name (no '/', not starting with '.'), or choose the folder with --run-dir")
    if t.fault_at_step < 0:
        raise ConfigError("train.fault_at_step", f"is {t.fault_at_step}; must be 0 (off) or a step number")
    if t.fault_process < -1:
        raise ConfigError("train.fault_process", f"is {t.fault_process}; -1 (every process) or a process index")
    if t.fault_signal not in FAULT_SIGNALS:
        raise ConfigError("train.fault_signal", f"is '{t.fault_signal}'; valid: {', '.join(FAULT_SIGNALS)}")
    if t.max_bad_steps < 0:
        raise ConfigError("train.max_bad_steps", f"is {t.max_bad_steps}; must be 0 (stop at once) or positive")
    if t.sample_tokens < 0:
        raise ConfigError("train.sample_tokens", f"is {t.sample_tokens}; must be 0 (no sample) or positive")
    if t.sample_tokens and not t.sample_prompt.strip():
        raise ConfigError("train.sample_prompt", "is empty; give text to continue, or train.sample_tokens=0")
    if config.data.shuffle_seed < 0:
        raise ConfigError("data.shuffle_seed", f"is {config.data.shuffle_seed}; must be 0 or positive")
    for field in ("heartbeat_timeout_s", "shutdown_timeout_s"):
        if config.distributed[field] < 1:
            raise ConfigError(f"distributed.{field}", f"is {config.distributed[field]}; must be at least 1 second")


def validate_fields(config) -> None:
    """Every check that needs no devices; the command line makes these before JAX is imported."""
    m, t, d = config.model, config.train, config.data
    for field in ("d_model", "layers", "heads", "kv_heads", "mlp_dim", "max_seq_len"):
        if m[field] <= 0:
            raise ConfigError(f"model.{field}", f"is {m[field]}; must be positive")
    if m.vocab_size < 0:
        raise ConfigError("model.vocab_size", "must be positive, or 0 to take the tokenizer's size")
    if m.head_dim == 0 and m.d_model % m.heads:
        raise ConfigError("model.head_dim", f"is 0 (d_model // heads) but d_model={m.d_model} is not "
                          f"divisible by heads={m.heads}; set head_dim or change heads")
    if m.heads % m.kv_heads:
        raise ConfigError("model.kv_heads", f"kv_heads={m.kv_heads} must divide heads={m.heads}")
    if head_dim(m) % 2:
        raise ConfigError("model.head_dim", f"is {head_dim(m)}; RoPE needs an even head dimension")
    _finite_in(m.rope_theta, "model.rope_theta", 0, low_open=True, valid="RoPE's base must be positive, e.g. 1e4")
    _finite_in(m.norm_eps, "model.norm_eps", 0, low_open=True, valid="must be positive, e.g. 1e-5")
    _finite_in(m.init_std, "model.init_std", 0, low_open=True, valid="the weights' initial spread must be positive, "
               "e.g. 0.02")
    _validate_kernels(m)
    if d.seq_len <= 0 or d.seq_len > m.max_seq_len:
        raise ConfigError("data.seq_len", f"is {d.seq_len}; must be in 1..model.max_seq_len={m.max_seq_len}")
    if not 0 < d.val_fraction < 1:
        raise ConfigError("data.val_fraction", f"is {d.val_fraction}; must be between 0 and 1")
    if d.vocab_size < 260 and d.tokenizer == "bpe":
        raise ConfigError("data.vocab_size", f"is {d.vocab_size}; a byte-level BPE needs at least 260")
    if t.compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError("train.compute_dtype", f"is '{t.compute_dtype}'; valid: {', '.join(COMPUTE_DTYPES)}")
    if t.remat not in REMAT_POLICIES:
        raise ConfigError("train.remat", f"is '{t.remat}'; valid: {', '.join(REMAT_POLICIES)}")
    names = [n.strip() for n in str(t.remat_names).split(",") if n.strip()]
    if t.remat == "names" and (not names or set(names) - set(REMAT_NAMES)):
        raise ConfigError("train.remat_names", f"is '{t.remat_names}'; give a comma-separated list of activations "
                          f"to keep from: {', '.join(REMAT_NAMES)}")
    for field in ("steps", "batch_size", "microbatches", "log_every", "eval_every",
                  "eval_batches", "checkpoint_every", "keep_checkpoints"):
        if t[field] <= 0:
            raise ConfigError(f"train.{field}", f"is {t[field]}; must be positive")
    _validate_optimizer(t)
    _validate_run_options(config)
    exchange = config.parallel.expert_exchange
    if exchange not in EXPERT_EXCHANGES:
        raise ConfigError("parallel.expert_exchange", f"is '{exchange}'; valid: {', '.join(EXPERT_EXCHANGES)}")


def validate_tensor_overlap(config) -> None:
    """parallel.tensor_overlap decomposes sequence parallelism's collectives (parallel/collective_matmul.py)."""
    mode = config.parallel.tensor_overlap
    valid = ("none", "collective_matmul", "bidirectional")
    if mode not in valid:
        raise ConfigError("parallel.tensor_overlap", f"is '{mode}'; valid: {', '.join(valid)}")
    if mode != "none" and not (config.parallel.tensor == "manual" and config.parallel.sequence):
        raise ConfigError("parallel.tensor_overlap", f"'{mode}' overlaps sequence parallelism's all-gather and "
                          "reduce-scatter: set parallel.tensor=manual and parallel.sequence=true, or 'none'")
    if config.parallel.prefetch and config.parallel.data != "zero3":
        raise ConfigError("parallel.prefetch", f"prefetches ZeRO-3's layer gathers, but parallel.data="
                          f"{config.parallel.data}; set parallel.data=zero3 or parallel.prefetch=false")
    if mode == "bidirectional" and config.model.d_model % 2:
        raise ConfigError("parallel.tensor_overlap", f"'bidirectional' splits d_model={config.model.d_model} in "
                          "halves (one ring each way); use an even d_model or 'collective_matmul'")


def validate_grad_buckets(config) -> None:
    """parallel.grad_buckets cuts the manual DDP / ZeRO-2 layer loop into buckets (parallel/buckets.py)."""
    buckets, layers = config.parallel.grad_buckets, config.model.layers
    if buckets == 0:
        return
    if buckets < 0 or layers % buckets:
        raise ConfigError("parallel.grad_buckets", f"is {buckets}; valid: 0 (one reduction after the backward "
                          f"pass) or a number of buckets that divides model.layers={layers}")
    if config.parallel.data not in ("ddp", "zero2"):
        raise ConfigError("parallel.grad_buckets", f"buckets the gradients of parallel.data=ddp or zero2, but "
                          f"parallel.data={config.parallel.data}; set one of those or parallel.grad_buckets=0")
    if config.model.moe.experts:
        raise ConfigError("parallel.grad_buckets", "buckets the dense layer stack only, but model.moe.experts="
                          f"{config.model.moe.experts}; use parallel.grad_buckets=0 with MoE")


def validate(config, num_devices: int, processes: int | None = None, platform: str | None = None) -> dict[str, int]:
    """Check everything that can be checked before compiling; return the mesh sizes.

    `processes`: the job's process count, when the mesh is the run's own (bounds train.fault_process);
    `platform`: the devices' platform in a one-process run (the mesh error then names --cpu-devices on CPU)."""
    validate_fields(config)
    m, t, d = config.model, config.train, config.data
    if processes is not None and t.fault_process >= processes:
        raise ConfigError("train.fault_process", f"is {t.fault_process} but the job has {processes} process(es); "
                          f"use -1 (every process) or 0..{processes - 1}")
    sizes = mesh_shape(config, num_devices, platform)
    if sizes["pipe"] > 1 and config.parallel.pipe == "auto":
        raise ConfigError("parallel.pipe", f"is 'auto' but mesh.pipe={sizes['pipe']}; choose a schedule: "
                          "gpipe, 1f1b, interleaved, zb-h1, dualpipev, pipedream-2bw, or circular (the compiler-driven "
                          "pipeline)")
    for field in ("pipe_microbatches", "pipe_virtual"):
        if config.parallel[field] < 0:
            raise ConfigError(f"parallel.{field}", f"is {config.parallel[field]}; must be positive, or 0 (default)")
    validate_moe(config, sizes)
    if platform == "cpu" and config.parallel.expert_exchange == "ragged" and sizes["expert"] > 1:
        raise ConfigError("parallel.expert_exchange", "is 'ragged', which XLA:CPU cannot compile "
                          "(no ragged-all-to-all); use auto, capacity or padded on CPU")
    validate_context(config, sizes)
    tp = sizes["tensor"]
    if m.heads % tp:
        raise ConfigError("model.heads", f"heads={m.heads} is not divisible by mesh.tensor={tp}")
    if m.kv_heads % tp:
        raise ConfigError("model.kv_heads", f"kv_heads={m.kv_heads} is not divisible by mesh.tensor={tp}; "
                          "use a tensor size that divides kv_heads")
    if m.mlp_dim % tp:
        raise ConfigError("model.mlp_dim", f"mlp_dim={m.mlp_dim} is not divisible by mesh.tensor={tp}")
    if config.parallel.sequence:
        if config.parallel.tensor != "manual":
            raise ConfigError("parallel.sequence", "sequence parallelism is part of the manual Megatron strategy: "
                              "set parallel.tensor=manual (the automatic strategy: parallel.rules=length=tensor)")
        if tp == 1:
            raise ConfigError("parallel.sequence", "splits the sequence over mesh.tensor, which is 1; "
                              "set mesh.tensor > 1 or parallel.sequence=false")
        if d.seq_len % tp:
            raise ConfigError("data.seq_len", f"seq_len={d.seq_len} is not divisible by mesh.tensor={tp} "
                              "(parallel.sequence splits the sequence over tensor)")
    validate_tensor_overlap(config)
    validate_grad_buckets(config)
    if m.d_model % sizes["fsdp"]:
        raise ConfigError("model.d_model", f"d_model={m.d_model} is not divisible by mesh.fsdp={sizes['fsdp']}")
    batch_shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if t.batch_size % t.microbatches:
        raise ConfigError("train.microbatches", f"{t.microbatches} does not divide train.batch_size={t.batch_size}")
    micro = t.batch_size // t.microbatches
    if micro % batch_shards:
        raise ConfigError("train.batch_size", f"batch_size={t.batch_size} (microbatch {micro}) is not divisible "
                          f"by the data-parallel size data x fsdp x expert = {batch_shards}")
    moe = m.moe
    if moe.experts and moe.dispatch == "capacity" and (micro // batch_shards) % moe.group_sequences:
        raise ConfigError("model.moe.group_sequences", f"{moe.group_sequences} does not divide the "
                          f"{micro // batch_shards} sequences each device holds per microbatch; capacity groups "
                          "must not straddle devices")
    return sizes


def validate_moe(config, sizes: dict[str, int]) -> None:
    """The MoE fields (model.moe.*) and the `expert` mesh axis."""
    m, moe, ep = config.model, config.model.moe, sizes["expert"]
    if moe.experts < 0:
        raise ConfigError("model.moe.experts", f"is {moe.experts}; use 0 (a dense model) or a positive count")
    if not moe.experts:
        if ep > 1:
            raise ConfigError("mesh.expert", f"is {ep} but the model is dense; expert parallelism needs "
                              "model.moe.experts > 0")
        return
    if moe.experts % ep:
        raise ConfigError("model.moe.experts", f"{moe.experts} experts are not divisible by mesh.expert={ep}")
    if not 1 <= moe.top_k <= moe.experts:
        raise ConfigError("model.moe.top_k", f"is {moe.top_k}; must be in 1..model.moe.experts={moe.experts}")
    if not 0 <= moe.dense_layers < m.layers:
        raise ConfigError("model.moe.dense_layers", f"is {moe.dense_layers}; must be in 0..model.layers-1="
                          f"{m.layers - 1} (at least one MoE layer)")
    if moe.expert_mlp_dim < 0:
        raise ConfigError("model.moe.expert_mlp_dim",
                          f"is {moe.expert_mlp_dim}; use 0 (model.mlp_dim) or a positive size")
    if (moe.expert_mlp_dim or m.mlp_dim) % sizes["tensor"]:
        raise ConfigError("model.moe.expert_mlp_dim", f"{moe.expert_mlp_dim or m.mlp_dim} is not divisible by "
                          f"mesh.tensor={sizes['tensor']}")
    if moe.shared_experts < 0:
        raise ConfigError("model.moe.shared_experts", f"is {moe.shared_experts}; must be 0 or positive")
    if moe.shared_experts and not 0 < moe.expert_mlp_dim < m.mlp_dim:
        raise ConfigError("model.moe.shared_experts", f"{moe.shared_experts} shared experts need fine-grained "
                          f"experts (DeepSeek-MoE): set model.moe.expert_mlp_dim below model.mlp_dim={m.mlp_dim}")
    if moe.router not in MOE_ROUTERS:
        raise ConfigError("model.moe.router", f"is '{moe.router}'; valid: {', '.join(MOE_ROUTERS)}")
    if moe.dispatch not in MOE_DISPATCH:
        raise ConfigError("model.moe.dispatch", f"is '{moe.dispatch}'; valid: {', '.join(MOE_DISPATCH)}")
    if moe.capacity_factor <= 0:
        raise ConfigError("model.moe.capacity_factor", f"is {moe.capacity_factor}; must be > 0")
    if moe.group_sequences < 1:
        raise ConfigError("model.moe.group_sequences", f"is {moe.group_sequences}; must be at least 1")
    for field in ("balance_loss", "z_loss", "bias_rate"):
        if moe[field] < 0:
            raise ConfigError(f"model.moe.{field}", f"is {moe[field]}; must be >= 0")


CONTEXT_IMPLS = ("ring", "all_to_all")


def validate_context(config, sizes: dict[str, int]) -> None:
    """mesh.context and parallel.context (parallel/context.py): what the sequence split needs of the shapes."""
    impl, cp, tp = config.parallel.context, sizes.get("context", 1), sizes["tensor"]
    if impl not in ("auto", *CONTEXT_IMPLS):
        raise ConfigError("parallel.context", f"is '{impl}'; valid: auto, {', '.join(CONTEXT_IMPLS)}")
    if cp == 1:
        return
    if impl == "auto":
        raise ConfigError("parallel.context", f"is 'auto' but mesh.context={cp}; choose how attention crosses the "
                          "split: ring or all_to_all")
    seq, m = config.data.seq_len, config.model
    chunks = 2 * cp if impl == "ring" else cp
    if seq % chunks:
        raise ConfigError("data.seq_len", f"is {seq}; parallel.context={impl} cuts it into {chunks} equal chunks "
                          f"(mesh.context={cp}{' x 2, load-balanced' if impl == 'ring' else ''}): use a multiple "
                          f"of {chunks}")
    if impl == "all_to_all":
        for field in ("heads", "kv_heads"):
            if m[field] % (cp * tp):
                raise ConfigError(f"model.{field}", f"{field}={m[field]} is not divisible by mesh.context x "
                                  f"mesh.tensor = {cp * tp}: all_to_all gives each device whole heads; use "
                                  "parallel.context=ring")
    if m.moe.experts:
        raise ConfigError("mesh.context", f"is {cp} but the model has experts (model.moe.experts="
                          f"{m.moe.experts}); context parallelism is built for dense models: set mesh.context=1")
