"""Hugging Face Mixtral interop: jaxpar's MoE forward reproduces MixtralForCausalLM's logits (tiny random
model, fp32, tolerance 1e-4), exports back, and unsupported MoE checkpoints are refused with one line."""
import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from jaxpar.model.hf import config_from_hf, export_hf_mixtral, load_hf_mixtral  # noqa: E402
from jaxpar.model.moe import MoEConfig  # noqa: E402
from jaxpar.model.transformer import ModelConfig, forward, init_params  # noqa: E402

TOL = 1e-4


def tiny_mixtral(seed=0, **overrides):
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        initializer_range=0.1, **overrides)   # a large init: logits O(1), so the tolerance means something
    config._attn_implementation = "eager"
    model = transformers.MixtralForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)          # norms away from ones, so a mixed-up norm shows
    return model


def tokens(seed=1):
    return np.random.default_rng(seed).integers(0, 256, size=(2, 16), dtype=np.int32)


def torch_logits(model, toks):
    with torch.no_grad():
        return model(torch.from_numpy(toks.astype(np.int64))).logits.float().numpy()


def jax_logits(params, cfg, toks):
    return np.asarray(jax.jit(forward, static_argnums=2)(params, toks, cfg)[0])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral") / "hf"
    model = tiny_mixtral()
    model.save_pretrained(path)
    return model, path


def test_load_matches_transformers(saved):
    model, path = saved
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in load_file(path / "model.safetensors")
    cfg, params = load_hf_mixtral(path)
    assert cfg.moe == MoEConfig(experts=4, top_k=2, expert_mlp_dim=96, router="softmax", normalize_top_k=True,
                                dispatch="dropless", balance_loss=0.001, z_loss=0.0)
    assert params["moe_blocks"]["expert_gate"].shape == (2, 4, 64, 96) and "blocks" not in params
    toks = tokens()
    expected, got = torch_logits(model, toks), jax_logits(params, cfg, toks)
    assert np.abs(expected).max() > 0.5
    assert np.abs(got - expected).max() < TOL


def test_fused_expert_layout_loads_the_same(saved, tmp_path):
    """transformers >= 5 names the experts mlp.experts.gate_up_proj [E, 2F, D] / down_proj [E, D, F]."""
    _, path = saved
    tensors = load_file(path / "model.safetensors")
    fused = {}
    for name, value in tensors.items():
        if ".block_sparse_moe." not in name:
            fused[name] = value
        elif name.endswith("gate.weight"):
            fused[name.replace("block_sparse_moe.", "mlp.")] = value
    def stacked(i, w):
        return np.stack([tensors[f"model.layers.{i}.block_sparse_moe.experts.{j}.{w}.weight"] for j in range(4)])

    for i in range(2):
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate([stacked(i, "w1"), stacked(i, "w3")], 1)
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = stacked(i, "w2")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _, params = load_hf_mixtral(tmp_path)
    _, want = load_hf_mixtral(path)
    jax.tree.map(np.testing.assert_array_equal, params, want)


def test_export_round_trip(saved, tmp_path):
    model, path = saved
    cfg, params = load_hf_mixtral(path)
    export_hf_mixtral(params, cfg, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["MixtralForCausalLM"] and written["num_local_experts"] == 4
    reloaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    toks = tokens(seed=2)
    assert np.abs(torch_logits(reloaded, toks) - torch_logits(model, toks)).max() < TOL
    cfg2, params2 = load_hf_mixtral(tmp_path / "out")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)


BASE_HF = dict(model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=64, sliding_window=None)


@pytest.mark.parametrize("overrides, field", [
    ({"model_type": "qwen2_moe"}, "model_type"),
    ({"model_type": "deepseek_v3"}, "model_type"),
    ({"sliding_window": 4096}, "sliding_window"),
    ({"router_jitter_noise": 0.01}, "router_jitter_noise"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_moe_checkpoint_is_refused_with_one_line(overrides, field, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE_HF, **overrides}))
    with pytest.raises(ValueError, match=f"^{field}: ") as err:
        load_hf_mixtral(tmp_path)
    assert "\n" not in str(err.value)
    config_from_hf({**BASE_HF})                             # the unchanged config is accepted


@pytest.mark.parametrize("moe, field", [
    (dict(shared_experts=1, expert_mlp_dim=32), "model.moe.shared_experts"),
    (dict(dense_layers=1), "model.moe.dense_layers"),
    (dict(router="sigmoid"), "model.moe.router"),
])
def test_export_refuses_what_mixtral_cannot_express(moe, field, tmp_path):
    cfg = ModelConfig(vocab_size=256, d_model=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp_dim=96,
                      max_seq_len=64, moe=MoEConfig(experts=4, top_k=2, **{"expert_mlp_dim": 96, **moe}))
    with pytest.raises(ValueError, match=f"^{field}: "):
        export_hf_mixtral(jax.eval_shape(lambda: init_params(cfg, 0)), cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()
