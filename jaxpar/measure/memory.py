"""Per-device memory of a training step: what the compiler allocates, next to what theory predicts.

Three views of the same bytes, so a lab can put them side by side:

1. compiled   `compiled.memory_analysis()`: argument, output, alias (donated inputs
              reused as outputs) and temp (everything else: gradients, gathered
              weights, activations) buffers of one device's program.
2. shardings  the abstract train state (ShapeDtypeStructs with shardings): each leaf's
              bytes on one device = bytes of its shard (`sharding.shard_shape`), summed
              by role (params, Adam mu/nu, counters) and dtype. Exact for the state.
3. formula    the ZeRO paper's closed form: fp32 params 4Ψ, fp32 grads 4Ψ, Adam mu+nu
              8Ψ, each divided by the number of devices that part is split over.

Plus the Korthikanti et al. 2022 activation formula, the paper's (not jaxpar's prediction, which is
the strategy's: jaxpar.parallel.memory), for the labs that compare the paper with the compiled program,
and (`model_state_table`, behind `jaxpar memory`) the ZeRO table for any model size and device count,
in the paper's accounting and in jaxpar's own.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxpar.config import ConfigError
from jaxpar.units import GB

# ----------------------------------------------------------------------------- 1. compiled

@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """`memory_analysis()` of one device's program, plus a peak estimate that means the same on every backend."""

    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int
    host_temp: int
    peak_reported: int      # the backend's `peak_memory_in_bytes`, as reported
    peak: int               # our estimate of the live peak (see `peak_method`)
    peak_method: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def compiled_memory(compiled, platform: str) -> CompiledMemory:
    """Read `compiled.memory_analysis()`; estimate the peak correctly for `platform` ('cpu' or 'gpu').

    XLA:CPU's `peak_memory_in_bytes` is args + out - alias and leaves temporaries out,
    so on CPU the peak is estimated as args + out - alias + temp (an upper bound: not
    every temp is live at once). The deviceless XLA:GPU compile reports a peak that
    already includes temporaries (its buffer assignment's heap simulation); we take it.
    """
    ma = compiled.memory_analysis()
    arg, out, alias, temp = (int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes),
                             int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes))
    reported = int(ma.peak_memory_in_bytes)
    if platform == "cpu":
        peak, method = arg + out - alias + temp, "args + out - alias + temp (XLA:CPU's peak leaves temps out)"
    else:
        peak, method = reported, "peak_memory_in_bytes (XLA:GPU buffer assignment, temps included)"
    return CompiledMemory(argument=arg, output=out, alias=alias, temp=temp,
                          generated_code=int(ma.generated_code_size_in_bytes),
                          host_temp=int(getattr(ma, "host_temp_size_in_bytes", 0) or 0),
                          peak_reported=reported, peak=peak, peak_method=method)


# ----------------------------------------------------------------------------- 2. from the shardings

def leaf_bytes_per_device(leaf) -> int:
    """Bytes of one device's shard of a ShapeDtypeStruct (or array) that carries a sharding."""
    shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def _role(path) -> str:
    """Role of a train-state leaf from its pytree path: params, adam_mu, adam_nu or counters."""
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if keys and keys[0] == "params":
        return "params"
    if "mu" in keys:
        return "adam_mu"
    if "nu" in keys:
        return "adam_nu"
    return "counters"   # optimizer step counts, the train step, anything scalar-like


def state_bytes(abstract_state) -> dict:
    """Per-device bytes of the train state, by role and by dtype, read from each leaf's sharding.

    Gradients are not part of the state (they live in temp buffers), but in the
    automatic strategies they take their parameter's sharding and dtype, so their
    per-device size is reported as `grads` = that of `params`.
    """
    by_role = {"params": 0, "adam_mu": 0, "adam_nu": 0, "counters": 0}
    unsharded = dict.fromkeys(by_role, 0)
    by_dtype: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        role = _role(path)
        size = leaf_bytes_per_device(leaf)
        by_role[role] += size
        unsharded[role] += int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
        by_dtype[str(np.dtype(leaf.dtype))] = by_dtype.get(str(np.dtype(leaf.dtype)), 0) + size
    total = sum(by_role.values())
    return {**by_role, "optimizer": by_role["adam_mu"] + by_role["adam_nu"], "grads": by_role["params"],
            "state_total": total, "by_dtype": by_dtype, "unsharded_total": sum(unsharded.values())}


# ----------------------------------------------------------------------------- 3. the ZeRO formula

def shard_counts(config, sizes: dict[str, int]) -> dict[str, int]:
    """How many devices each part of the model state is split over, by strategy.

    auto: the `fsdp` and `tensor` axes split params, grads and Adam state alike
      (ZeRO-3 over fsdp, Megatron over tensor); `data` replicates everything.
    parallel.data = ddp / zero1 / zero2 / zero3: `data` splits what ZeRO's stage splits (parallel/zero.py's
      `split_over`), times the model axes.
    Norm weights are replicated in practice; the formula ignores that (<0.1% of a 7B).
    """
    from jaxpar.parallel.zero import STAGES, split_over
    model = sizes.get("fsdp", 1) * sizes.get("tensor", 1)
    if config.parallel.data in STAGES:
        return {part: model * n for part, n in split_over(config.parallel.data, sizes.get("data", 1)).items()}
    return dict.fromkeys(("params", "grads", "optimizer"), model)


def zero_formula(psi: float, shards: dict[str, int], *, param_bytes: int = 4, grad_bytes: int = 4,
                 optimizer_bytes: int = 8) -> dict:
    """Closed-form model-state bytes per device: K·Ψ/N for each part (ZeRO, Rajbhandari et al. 2020).

    Defaults follow jaxpar's step: fp32 master params (4Ψ), fp32 grads (4Ψ: gradients of
    fp32 params; pass 2 for bf16 gradient buffers), Adam mu + nu in fp32 (8Ψ).
    Classic ZeRO (fp16 params and grads, K=12) is param_bytes=2, grad_bytes=2, optimizer_bytes=12.
    """
    parts = {"params": param_bytes * psi / shards["params"],
             "grads": grad_bytes * psi / shards["grads"],
             "optimizer": optimizer_bytes * psi / shards["optimizer"]}
    parts["state"] = parts["params"] + parts["optimizer"]          # what the step takes as arguments
    parts["total"] = parts["state"] + parts["grads"]
    return parts


# ----------------------------------------------------------------------------- the paper's activations

def korthikanti_layer_bytes(*, seq_len: int, micro_batch: int, d_model: int, heads: int, tensor: int = 1,
                            sequence_parallel: bool = False) -> dict:
    """Korthikanti et al. 2022 (eq. 1-3, 5), one GPT layer's activations in bf16 bytes, per device:
    34·s·b·h + 5·a·s²·b without parallelism; with tensor parallelism t the 24·s·b·h + 5·a·s²·b of the
    attention and MLP are split and the 10·s·b·h of the layer norms, the inputs of the first linear
    layers and the dropout masks are not; sequence parallelism splits those too: s·b·h·(34 + 5·a·s/h)/t."""
    s, b, h, a, t = seq_len, micro_batch, d_model, heads, tensor
    sequence_region = 10 * s * b * h / (t if sequence_parallel else 1)
    tensor_region = (24 * s * b * h + 5 * a * s * s * b) / t
    return {"sequence_region": sequence_region, "tensor_region": tensor_region,
            "per_layer": sequence_region + tensor_region}


def jaxpar_layer_bytes(*, seq_len: int, micro_batch: int, d_model: int, heads: int, kv_heads: int, head_dim: int,
                       mlp_dim: int, tensor: int = 1, sequence_parallel: bool = False,
                       gathered_kept: bool = False) -> dict:
    """Korthikanti's count redone for jaxpar's fp32 block: the tensors JAX's autodiff keeps for the backward
    pass of one layer (no remat), 4 bytes each, per device. Term by term (b·s tokens, t = tensor):

      sequence region (replicated under TP, split by SP): per RMSNorm its input, x·rsqrt and its output
        (the next matmul's input), 3·h, and two per-token scalars, 2: two norms, (6·h + 4) per token.
        (Korthikanti, GPT: 10·h in bf16 = LN input and output, 2 + 2 each, and two 1-byte dropout masks.)
      tensor region (split by TP): q and the attention output a·d_h each, k and v kv·d_h each (GQA);
        SwiGLU gate, up, their product and three SiLU intermediates, 6·F (GPT: 4h GeLU MLP);
        attention: two fp32 s x s tensors per head (exponentials and probabilities) + two per-row
        scalars, a·(2s + 2) per token (GPT: softmax output, dropout mask and output, 5·a·s bytes).

    `gathered_kept` (SP only): the two norms' outputs are kept as the gathered [b, s, h] inputs of the
    column-parallel matmuls instead of their s/t shards (2·h per token not divided by t).

    The number of SiLU intermediates and s x s tensors is what `jax.ad_checkpoint.print_saved_residuals`
    lists for jaxpar's block; a different jax version may keep a different set."""
    s, b, h, t = seq_len, micro_batch, d_model, tensor
    tokens = b * s
    if not sequence_parallel:
        sequence_region: float = 4 * tokens * (6 * h + 4)
    elif gathered_kept:
        sequence_region = 4 * tokens * ((4 * h + 4) / t + 2 * h)
    else:
        sequence_region = 4 * tokens * (6 * h + 4) / t
    attention_projections = 2 * heads * head_dim + 2 * kv_heads * head_dim
    tensor_region = 4 * tokens * (attention_projections + 6 * mlp_dim + heads * (2 * s + 2)) / t
    return {"sequence_region": sequence_region, "tensor_region": tensor_region,
            "per_layer": sequence_region + tensor_region}


def korthikanti_activations(*, layers: int, seq_len: int, micro_batch: int, d_model: int, heads: int,
                        vocab_size: int, tensor: int = 1, compute_bytes: int = 2, remat: str = "none",
                        flash: bool = False, loss_chunk: int | None = None,
                        sequence_parallel: bool = False) -> dict:
    """The paper's activation bytes per device for one microbatch (Korthikanti et al. 2022, "Reducing
    Activation Recomputation in Large Transformer Models"), adapted, for a lab to set beside the compiled
    program and jaxpar's own prediction (jaxpar.parallel.memory). Assumptions, stated:

    - Per layer, bf16, tensor parallel t without sequence parallelism:
      s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes (= s·b·h·(34 + 5·a·s/h) at t=1); with sequence
      parallelism s·b·h·(34 + 5·a·s/h)/t (`korthikanti_layer_bytes`). The constants
      are GPT-3's (GeLU 4h MLP, dropout masks); jaxpar's block (SwiGLU, no dropout, fp32
      softmax) differs, so treat this as +-30%, not exact (`jaxpar_layer_bytes` is its fp32 count).
    - Other compute dtypes: every term scaled by compute_bytes / 2 (fp32 doubles it).
    - remat 'none': all L layers' activations are kept.
      remat 'full' (nothing saveable): only each layer's input is kept (s·b·h·compute_bytes,
      replicated over tensor; split by sequence parallelism), plus one layer's full activations while that layer is
      recomputed and differentiated in the backward pass.
      remat 'dots'/'names': not modelled; reported as the 'none' figure (an upper bound).
    - Output layer (not in Korthikanti): fp32 logits and their gradient, 2·4·s·b·V/t.
    - flash=True (flash attention: pallas, cudnn): the 5·a·s/h term (scores, softmax, its
      dropout mask: the [S, S] arrays) disappears; the kernel keeps a fp32 log-sum-exp per
      query and head instead, 4·a·s·b/t bytes.
    - loss_chunk=c (chunked cross-entropy): one chunk's logits and their gradient,
      2·4·c·b·V/t, plus the gradient of the head's input kept for the backward pass, s·b·h.
    """
    s, b, h, a, t = seq_len, micro_batch, d_model, heads, tensor
    k = korthikanti_layer_bytes(seq_len=s, micro_batch=b, d_model=h, heads=a, tensor=t,
                                sequence_parallel=sequence_parallel)
    if flash:   # no [S, S] arrays: a fp32 log-sum-exp per query and head instead
        per_layer = (k["sequence_region"] + 24 * s * b * h / t) * compute_bytes / 2 + 4 * a * s * b / t
    else:
        per_layer = k["per_layer"] * compute_bytes / 2
    layer_inputs = layers * s * b * h * compute_bytes / (t if sequence_parallel else 1)
    if remat == "full":
        layers_total, note = layer_inputs + per_layer, "remat full: L layer inputs + one layer recomputed"
    elif remat == "none":
        layers_total, note = layers * per_layer, "no remat: L x per-layer activations"
    else:
        layers_total, note = layers * per_layer, f"remat '{remat}' not modelled: no-remat upper bound"
    if loss_chunk:
        logits = 2 * 4 * min(loss_chunk, s) * b * vocab_size / t + s * b * h * compute_bytes
    else:
        logits = 2 * 4 * s * b * vocab_size / t
    return {"per_layer": per_layer, "layers": layers_total, "logits": logits,
            "total": layers_total + logits, "note": note}


# ----------------------------------------------------------------------------- 4. any model size

PRECISIONS = ("mixed", "fp32", "bf16")
# moment tensors per parameter: Adam mu and nu; SGD's momentum buffer; Adafactor (optax's default:
# no momentum) keeps only factored second moments, O(rows + cols) per matrix, counted as 0
OPTIMIZER_MOMENTS = {"adam": 2, "sgd": 1, "adafactor": 0}
_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text, field: str, *, integer: bool = False) -> float:
    """'7.5e9', '7.5B', '350M', '64' -> a positive number; anything else is a ConfigError naming `field`."""
    raw = str(text).strip()
    scale = _SUFFIX.get(raw[-1:].lower(), 1.0) if raw else 1.0
    try:
        value = float(raw[:-1] if scale != 1.0 else raw) * scale
    except ValueError:
        raise ConfigError(field, f"'{text}' is not a number (e.g. 7.5e9, 7.5B, 350M)") from None
    if not np.isfinite(value) or value <= 0:
        raise ConfigError(field, f"is {text}; must be positive")
    if integer and value != int(value):
        raise ConfigError(field, f"is {text}; must be a whole number")
    return int(value) if integer else value


def bytes_per_param(optimizer: str, precision: str, accounting: str) -> dict[str, int]:
    """Bytes per parameter of (params, grads, optimizer state) in one of two accountings.

    paper   (ZeRO, Rajbhandari et al. 2020): mixed = fp16 params and grads (2 + 2) and fp32
            optimizer state K = 4 (master weights) + 4 per moment (Adam: K = 12); fp32 = 4 + 4,
            K = 4 per moment (the params are the master copy); bf16 = everything in bf16,
            no master copy (2 + 2, K = 2 per moment).
    jaxpar  what jaxpar's step holds whatever the precision: the fp32 params *are* the master
            weights (4), their gradients are fp32 (4: the transpose of the bf16 cast), the
            moments are fp32 (4 each); `train.compute_dtype` changes only the temporaries
            (a bf16 copy of the weights, activations) and, in ZeRO-3, the bytes on the wire.
    """
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ConfigError("--optimizer", f"unknown optimizer '{optimizer}'; valid: {', '.join(OPTIMIZER_MOMENTS)}")
    if precision not in PRECISIONS:
        raise ConfigError("--precision", f"unknown precision '{precision}'; valid: {', '.join(PRECISIONS)}")
    moments = OPTIMIZER_MOMENTS[optimizer]
    if accounting == "jaxpar":
        return {"params": 4, "grads": 4, "optimizer": 4 * moments}
    return {"mixed": {"params": 2, "grads": 2, "optimizer": 4 + 4 * moments},
            "fp32": {"params": 4, "grads": 4, "optimizer": 4 * moments},
            "bf16": {"params": 2, "grads": 2, "optimizer": 2 * moments}}[precision]


def _stage_formula(sizes: dict[str, int], shards: dict[str, int]) -> str:
    """'2Ψ + 2Ψ + 12Ψ/N' (parts split over N get /N), with the replicated and split sums merged."""
    whole = sum(sizes[k] for k in ("params", "grads", "optimizer") if shards[k] == 1)
    split = sum(sizes[k] for k in ("params", "grads", "optimizer") if shards[k] > 1)
    parts = ([f"{whole}Ψ"] if whole else []) + ([f"{split}Ψ/N"] if split else [])
    return " + ".join(parts) or "0"


def model_state_table(params: float, devices: int, optimizer: str = "adam", precision: str = "mixed") -> dict:
    """Model-state bytes per device of DDP and ZeRO-1/2/3 (data parallel over `devices`), both accountings.

    Stage s splits what parallel/zero.py's `split_over` says (optimizer state from 1, grads from 2, params at 3);
    each part is `zero_formula`'s K·Ψ/N. Activations, temporaries and fragmentation are not counted.
    """
    from jaxpar.parallel.zero import STAGE_NAMES, split_over
    psi = parse_count(params, "--params")
    n = int(parse_count(devices, "--devices", integer=True))
    out = {"params": psi, "devices": n, "optimizer": optimizer, "precision": precision, "unit": "GB (1e9 bytes)"}
    for accounting in ("paper", "jaxpar"):
        sizes = bytes_per_param(optimizer, precision, accounting)
        rows = []
        for stage, (impl, name) in enumerate(STAGE_NAMES.items()):
            shards = split_over(impl, n)
            f = zero_formula(psi, shards, param_bytes=sizes["params"], grad_bytes=sizes["grads"],
                             optimizer_bytes=sizes["optimizer"])
            rows.append({"stage": stage, "name": name, "formula": _stage_formula(sizes, shards),
                         **{k: f[k] for k in ("params", "grads", "optimizer", "total")}})
        out[accounting] = {"bytes_per_param": sizes, "rows": rows}
    return out


def model_state_markdown(t: dict) -> str:
    """`model_state_table` as the markdown `jaxpar memory` prints (predictions: formulas, nothing measured)."""
    psi, n = t["params"], t["devices"]
    def row(r):
        cells = " | ".join(f"{r[k] / GB:,.3f}" for k in ("params", "grads", "optimizer", "total"))
        return f"| {r['name']} | {r['formula']} | {cells} |"

    pp, jp = t["paper"]["bytes_per_param"], t["jaxpar"]["bytes_per_param"]
    moments = OPTIMIZER_MOMENTS[t["optimizer"]]
    lines = [f"# Model-state memory per device: {psi:,.0f} params ({psi / 1e9:.3g} B), N = {n} data-parallel "
             f"devices, {t['optimizer']}, {t['precision']} precision",
             "",
             "Predictions from the ZeRO formulas (GB = 1e9 bytes; activations, temporaries and fragmentation "
             "not included). Measure a real config with `jaxpar dryrun`.",
             ""]
    header = ["| stage | formula | params | grads | optimizer state | **total** |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"## ZeRO paper's accounting: {pp['params']} + {pp['grads']} bytes, K = {pp['optimizer']}", "",
              *header, *(row(r) for r in t["paper"]["rows"]), "",
              f"## jaxpar's accounting: {jp['params']} + {jp['grads']} bytes, optimizer {jp['optimizer']}", "",
              *header, *(row(r) for r in t["jaxpar"]["rows"]), "", "Notes:", ""]
    paper_note = {"mixed": "fp16/bf16 params and grads, fp32 master weights + moments in the optimizer state",
                  "fp32": "fp32 params (they are the master weights) and grads, fp32 moments",
                  "bf16": "params, grads and moments all bf16, no master copy"}[t["precision"]]
    lines.append(f"- Paper: {paper_note}; K = {pp['optimizer']} bytes per parameter of optimizer state "
                 f"({moments} moment(s)).")
    lines.append("- jaxpar: fp32 params are the master weights (4), fp32 grads (4), fp32 moments "
                 f"({4 * moments}). `train.compute_dtype=bfloat16` casts a bf16 copy of the weights inside the "
                 "step (a temporary, per layer in ZeRO-3, where it also halves the gathered bytes) and takes the "
                 "gradient back to fp32; it changes no stored byte.")
    if t["precision"] == "bf16":
        lines.append("- jaxpar has no pure-bf16 storage (its bfloat16 is compute only): its column is the same "
                     "for every --precision.")
    if t["optimizer"] != "adam":
        lines.append(f"- jaxpar trains with AdamW only; its column applies jaxpar's fp32 layout to "
                     f"{t['optimizer']} ({moments} fp32 moment(s) per parameter"
                     + ("; Adafactor's factored second moments, O(rows + cols), counted as 0"
                        if t["optimizer"] == "adafactor" else "") + ").")
    lines.append("- Gradients are temporaries of jaxpar's step, not stored state. Its ZeRO-1 holds the full local "
                 "gradient until one reduce-scatter after the backward pass; its ZeRO-2 reduce-scatters each "
                 "layer's gradient inside the backward pass, so only one layer's full gradient exists at a time.")
    return "\n".join(lines)
