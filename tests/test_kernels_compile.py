"""Module 5's compilation and lab plumbing: the persistent cache across processes, the unrolled model the
depth comparison compiles, command-buffer flags, and bad input to `jaxpar lab kernels` and kernel choices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.measure.compilation import command_buffer_flags, step_compile_in_fresh_process, unrolled_loss
from jaxpar.model.transformer import ModelConfig, init_params, loss


def test_persistent_cache_serves_a_fresh_process(tmp_path):
    """The first process compiles and writes an entry; a second, fresh process finds it and writes nothing.
    (Times are reported by the lab, never asserted: they are noisy here.)"""
    cold = step_compile_in_fresh_process("configs/test.py", ["mesh.data=1"], tmp_path / "cache")
    warm = step_compile_in_fresh_process("configs/test.py", ["mesh.data=1"], tmp_path / "cache")
    assert cold["cache_files_before"] == 0 and cold["cache_files_after"] > 0
    assert warm["cache_files_after"] == warm["cache_files_before"] == cold["cache_files_after"]


def test_unrolled_model_is_the_same_function():
    cfg = ModelConfig(vocab_size=32, d_model=16, layers=3, heads=2, kv_heads=1, head_dim=8, mlp_dim=32, max_seq_len=8)
    params = init_params(cfg, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 9)), jnp.int32)
    scanned, unrolled = jax.jit(lambda p, t: (loss(p, t, cfg)[0], unrolled_loss(p, t, cfg)))(params, tokens)
    assert float(unrolled) == pytest.approx(float(scanned), rel=1e-6)


def test_command_buffer_flags():
    assert command_buffer_flags("default") == ""
    assert command_buffer_flags("off") == "--xla_gpu_enable_command_buffer="
    assert command_buffer_flags("+WHILE,-CUDNN", 2) == ("--xla_gpu_enable_command_buffer=+WHILE,-CUDNN "
                                                        "--xla_gpu_graph_min_graph_size=2")
    with pytest.raises(ValueError, match="unknown command buffer kind GRAPHS"):
        command_buffer_flags("GRAPHS")


def run_cli(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("argv, field", [
    (["lab", "kernels", "--steps", "0"], "--steps"),
    (["lab", "kernels", "--seq-lens", "128"], "--seq-lens"),
    (["lab", "kernels", "--depths", "two"], "--depths"),
    (["lab", "kernels", "--gpu-results", "/no/such/dir"], "--gpu-results"),
])
def test_lab_kernels_bad_input(capsys, tmp_path, argv, field):
    code, err = run_cli(capsys, [*argv, "--out", str(tmp_path / "lab")])
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {field}: "), err
    assert not (tmp_path / "lab").exists()


def test_train_refuses_cudnn_on_cpu(capsys, tmp_path):
    code, err = run_cli(capsys, ["train", "--config", "configs/test.py", "--run-dir", str(tmp_path / "run"),
                                 "--set", "model.attention=cudnn"])
    assert code == 2 and len(err) == 1 and err[0].startswith("error: model.attention: cudnn needs an NVIDIA GPU"), err
    assert not (tmp_path / "run").exists()
