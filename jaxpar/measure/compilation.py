"""Compilation, measured: the persistent compilation cache, compile time vs depth, XLA command buffers.

PyTorch counterparts. torch.compile traces a model to a graph and compiles it on the first
call, keeping compiled artifacts in a cache (Inductor's FX graph cache) so a restarted job
skips the work; CUDA graphs record a step's kernel launches once and replay them with one
call. In JAX every step is traced and compiled by `jax.jit` anyway; what is left to choose:

persistent cache   `jax_compilation_cache_dir` (env JAX_COMPILATION_CACHE_DIR) keeps each
                   compiled XLA executable on disk, keyed by the HLO, the compile options and
                   the jax/jaxlib versions. A restarted job (a resumed run, the next process of
                   a multi-host job, a repeated dry run) loads it instead of compiling. Tracing
                   and lowering still run: the cache saves the XLA compile only. JAX caches
                   only compiles longer than `jax_persistent_cache_min_compile_time_secs`
                   (1 s by default); `enable_persistent_cache` sets it to 0.
compile vs depth   the model scans over its stacked layers (`lax.scan`), so XLA compiles one
                   layer body whatever the depth; an unrolled model (one `run_blocks` call per
                   layer: each a one-trip loop XLA inlines) compiles L copies.
command buffers    XLA:GPU records runs of consecutive thunks into CUDA graphs ("command
                   buffers") and launches each with one call: `--xla_gpu_enable_command_buffer`
                   in XLA_FLAGS lists the kinds of work that may be captured (COMMAND_BUFFER_TYPES
                   below; `+KIND`/`-KIND` edit the default list, an empty value turns it off),
                   and `--xla_gpu_graph_min_graph_size` (default 5) the fewest consecutive
                   commands worth a graph. A `while` loop (the layer scan) ends a captured
                   region unless WHILE is enabled. There is nothing to set on CPU.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# XLA's defaults (xla/debug_options_flags.cc: FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN; min graph size 5)
COMMAND_BUFFER_DEFAULT = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN")
COMMAND_BUFFER_TYPES = {
    "FUSION": "XLA's fused kernels (elementwise, reductions, Triton fusions) and memcpy/memset",
    "CUBLAS": "cuBLAS GEMM calls",
    "CUBLASLT": "cuBLASLt GEMM calls (FP8 matmuls)",
    "CUSTOM_CALL": "custom calls that support graph capture: the Triton kernels Pallas emits among them",
    "CUDNN": "cuDNN calls, e.g. the fused attention of model.attention=cudnn",
    "COLLECTIVES": "NCCL collectives (off by default: captured collectives can deadlock across streams)",
    "CONDITIONAL": "lax.cond/switch, as CUDA graph conditional nodes",
    "WHILE": "while loops (lax.scan over layers), as CUDA graph conditional nodes",
}


def command_buffer_flags(kinds: str = "default", min_graph_size: int | None = None) -> str:
    """XLA_FLAGS text for command buffers: 'default', 'off', or a comma list (e.g. '+WHILE', 'FUSION,CUBLAS')."""
    if kinds == "default":
        flags = []
    else:
        value = "" if kinds == "off" else kinds
        unknown = [k.lstrip("+-") for k in value.split(",") if k and k.lstrip("+-") not in COMMAND_BUFFER_TYPES]
        if unknown:
            raise ValueError(f"unknown command buffer kind {unknown[0]}; valid: {', '.join(COMMAND_BUFFER_TYPES)}")
        flags = [f"--xla_gpu_enable_command_buffer={value}"]
    if min_graph_size is not None:
        flags.append(f"--xla_gpu_graph_min_graph_size={min_graph_size}")
    return " ".join(flags)


def enable_persistent_cache(directory: str | Path) -> None:
    """Cache every compiled executable under `directory` (before the first compile of the process)."""
    import jax
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def timed_compile(jitted, *args) -> dict:
    """Seconds to trace + lower and to compile `jitted` for `args` (abstract or concrete), and the executable."""
    start = time.perf_counter()
    lowered = jitted.lower(*args)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    return {"lower_s": lowered_at - start, "compile_s": time.perf_counter() - lowered_at, "compiled": compiled}


# ----------------------------------------------------------------------------- cold vs warm cache

def step_compile_in_fresh_process(config_file: str | None, overrides: list[str], cache_dir: str | Path,
                                  devices: int = 1, timeout: float = 900) -> dict:
    """Compile a config's train step in a new Python process with the persistent cache at `cache_dir`.

    A fresh process is the honest measurement: in-process, jit's own caches would hide the work.
    Returns the child's report: lower_s, compile_s, cache files before and after.
    """
    command = [sys.executable, "-m", "jaxpar.measure.compilation", "--cache-dir", str(cache_dir),
               "--devices", str(devices)]
    if config_file:
        command += ["--config", config_file]
    for item in overrides:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).parents[2],
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"compile in a fresh process failed: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cache_files(directory: Path) -> int:
    return sum(1 for p in Path(directory).rglob("*") if p.is_file()) if Path(directory).exists() else 0


def _child(argv=None) -> int:
    """The fresh process: enable the cache, build the strategy, lower and compile its step, print JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args(argv)
    import jax
    jax.config.update("jax_num_cpu_devices", args.devices)
    before = cache_files(Path(args.cache_dir))
    enable_persistent_cache(args.cache_dir)

    from jaxpar.config import apply_overrides, load_config, model_vocab_size
    from jaxpar.mesh import make_mesh
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_strategy

    config = load_config(args.config)
    apply_overrides(config, args.overrides)
    mesh = make_mesh(config)
    vocab = model_vocab_size(config, config.data.vocab_size, mesh.shape["tensor"])   # the BPE's size, padded
    strategy = make_strategy(config, ModelConfig.from_config(config.model, vocab), mesh)
    with jax.set_mesh(strategy.mesh):
        timing = timed_compile(strategy.step_fn, strategy.abstract_state, strategy.abstract_batch())
    print(json.dumps({"lower_s": timing["lower_s"], "compile_s": timing["compile_s"],
                      "cache_files_before": before, "cache_files_after": cache_files(Path(args.cache_dir))}))
    return 0


# ----------------------------------------------------------------------------- depth, scanned vs unrolled

def unrolled_loss(params, tokens, model_cfg):
    """The model's cross-entropy with one `run_blocks` call per layer: one-layer scans that XLA inlines."""
    import jax

    from jaxpar.model.transformer import embed, head_loss, run_blocks
    x = embed(params, tokens[:, :-1])
    for i in range(model_cfg.layers):
        x, _ = run_blocks(jax.tree.map(lambda w, i=i: w[i:i + 1], params["blocks"]), x, model_cfg)
    return head_loss(params, x, tokens[:, 1:], model_cfg)


def loss_and_grad_compile(model_cfg, batch: int, seq_len: int, unrolled: bool) -> dict:
    """Compile value_and_grad of the model's loss: the layer scan, or one `run_blocks` per layer (unrolled)."""
    import jax
    import jax.numpy as jnp

    from jaxpar.model.transformer import init_params, loss

    objective = (lambda p, t: unrolled_loss(p, t, model_cfg)) if unrolled else (lambda p, t: loss(p, t, model_cfg)[0])
    params = jax.eval_shape(lambda: init_params(model_cfg, 0))
    tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
    timing = timed_compile(jax.jit(jax.value_and_grad(objective)), params, tokens)
    return {"lower_s": timing["lower_s"], "compile_s": timing["compile_s"],
            "hlo_bytes": len(timing["compiled"].as_text())}


if __name__ == "__main__":
    sys.exit(_child())
