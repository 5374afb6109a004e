"""Hugging Face Llama interop: jaxpar's forward must reproduce LlamaForCausalLM's logits.

The reference is a tiny random transformers model (fp32, fixed seed) with norm
weights perturbed away from ones, so a mixed-up norm or transpose shows up.
"""
import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxpar.model.hf import config_from_hf, export_hf_llama, load_hf_llama  # noqa: E402
from jaxpar.model.transformer import forward  # noqa: E402

TOL = 1e-4

# tied: head_dim = hidden/heads, HF defaults otherwise; untied: a wider head_dim and non-default RoPE/eps.
VARIANTS = {
    "tied": dict(tie_word_embeddings=True),
    "untied": dict(tie_word_embeddings=False, head_dim=32, rope_theta=1000.0, rms_norm_eps=1e-5),
}


def tiny_llama(tie_word_embeddings, seed=0, **overrides):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=64, tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.1,  # large enough that logits are O(1) and the tolerance means something
        **overrides)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def tokens(seed=1, batch=2, seq=16):
    return np.random.default_rng(seed).integers(0, 256, size=(batch, seq), dtype=np.int32)


def torch_logits(model, toks):
    with torch.no_grad():
        return model(torch.from_numpy(toks.astype(np.int64))).logits.float().numpy()


def jax_logits(params, cfg, toks):
    return np.asarray(jax.jit(forward, static_argnums=2)(params, toks, cfg)[0])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_load_matches_transformers(variant, tmp_path):
    model = tiny_llama(**VARIANTS[variant])
    # the tied variant is saved sharded, to cover model.safetensors.index.json
    model.save_pretrained(tmp_path, max_shard_size="50KB" if variant == "tied" else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == (variant == "tied")

    cfg, params = load_hf_llama(tmp_path)
    assert cfg.tie_embeddings == (variant == "tied") and ("lm_head" in params) == (variant == "untied")
    assert cfg.head_dim == VARIANTS[variant].get("head_dim", 16)
    assert cfg.rope_theta == VARIANTS[variant].get("rope_theta", 10000.0)
    assert all(a.dtype == np.float32 for a in jax.tree.leaves(params))

    toks = tokens()
    expected = torch_logits(model, toks)
    got = jax_logits(params, cfg, toks)
    assert np.abs(expected).max() > 0.5  # a meaningful scale for the absolute tolerance
    assert np.abs(got - expected).max() < TOL


def test_swish_is_silu(tmp_path):
    """transformers maps hidden_act "swish" to the same SiLU as "silu", so it loads and matches."""
    model = tiny_llama(tie_word_embeddings=False, hidden_act="swish")
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["hidden_act"] == "swish"
    cfg, params = load_hf_llama(tmp_path)
    toks = tokens()
    assert np.abs(jax_logits(params, cfg, toks) - torch_logits(model, toks)).max() < TOL


def save_tied_with_head(model, path, head):
    """A tied model's checkpoint that also stores `head` as lm_head.weight, as some writers do."""
    from safetensors.numpy import load_file, save_file

    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    save_file({**tensors, "lm_head.weight": head(tensors["model.embed_tokens.weight"])},
              str(path / "model.safetensors"), metadata={"format": "pt"})


def test_tied_checkpoint_with_an_equal_head_copy_loads(tmp_path):
    model = tiny_llama(tie_word_embeddings=True)
    save_tied_with_head(model, tmp_path, lambda embed: embed.copy())
    cfg, params = load_hf_llama(tmp_path)
    assert cfg.tie_embeddings and "lm_head" not in params


def test_tied_checkpoint_with_a_different_head_is_refused(tmp_path):
    model = tiny_llama(tie_word_embeddings=True)
    save_tied_with_head(model, tmp_path, lambda embed: embed + 1.0)
    with pytest.raises(ValueError, match="^tie_word_embeddings: .*lm_head.weight .*differs") as err:
        load_hf_llama(tmp_path)
    assert "\n" not in str(err.value)


def test_load_bf16_checkpoint_widens_exactly(tmp_path):
    model = tiny_llama(tie_word_embeddings=False).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    _, params = load_hf_llama(tmp_path)
    assert all(a.dtype == np.float32 for a in jax.tree.leaves(params))
    embed = model.model.embed_tokens.weight.detach().float().numpy()
    down0 = model.model.layers[0].mlp.down_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(params["embed"]), embed)
    np.testing.assert_array_equal(np.asarray(params["blocks"]["w_down"][0]), down0.T)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_export_round_trip(variant, tmp_path):
    model = tiny_llama(**VARIANTS[variant])
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_hf_llama(tmp_path / "hf")

    export_hf_llama(params, cfg, tmp_path / "out")
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    toks = tokens(seed=2)
    assert np.abs(torch_logits(reloaded, toks) - torch_logits(model, toks)).max() < TOL

    cfg2, params2 = load_hf_llama(tmp_path / "out")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_export_writes_special_token_ids(tmp_path):
    """bos/eos go into config.json and generation_config.json, which transformers loads."""
    model = tiny_llama(tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_hf_llama(tmp_path / "hf")

    export_hf_llama(params, cfg, tmp_path / "out", bos_token_id=5, eos_token_id=7)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["bos_token_id"] == 5 and config["eos_token_id"] == 7
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert generation.bos_token_id == 5 and generation.eos_token_id == 7
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert hf_config.bos_token_id == 5 and hf_config.eos_token_id == 7

    export_hf_llama(params, cfg, tmp_path / "plain")        # no ids: still a loadable generation config
    transformers.GenerationConfig.from_pretrained(tmp_path / "plain")

    with pytest.raises(ValueError, match="^eos_token_id: 256 is not a token id"):
        export_hf_llama(params, cfg, tmp_path / "bad", eos_token_id=256)
    assert not (tmp_path / "bad").exists()


def test_export_into_empty_dir_is_allowed_nonempty_refused(tmp_path):
    model = tiny_llama(tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_hf_llama(tmp_path / "hf")

    (tmp_path / "empty").mkdir()
    export_hf_llama(params, cfg, tmp_path / "empty")
    assert (tmp_path / "empty" / "model.safetensors").exists()

    keep = tmp_path / "busy" / "notes.txt"
    keep.parent.mkdir()
    keep.write_text("do not touch")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        export_hf_llama(params, cfg, keep.parent)
    assert sorted(p.name for p in keep.parent.iterdir()) == ["notes.txt"]
    assert keep.read_text() == "do not touch"


BASE_HF = dict(model_type="llama", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64, rms_norm_eps=1e-6)


def test_config_both_rope_layouts():
    v4 = config_from_hf({**BASE_HF, "rope_theta": 500000.0, "rope_scaling": None})
    v5 = config_from_hf({**BASE_HF, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    assert v4 == v5 and v4.rope_theta == 500000.0 and v4.head_dim == 16


def test_config_rope_written_both_ways_loads_when_it_agrees():
    both = config_from_hf({**BASE_HF, "rope_theta": 500000.0, "rope_scaling": {"type": "default"},
                           "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    assert both.rope_theta == 500000.0


@pytest.mark.parametrize("overrides, field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_parameters"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
      "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_theta": 5e5}, "rope_theta"),
    ({"rope_scaling": {"rope_type": "default", "rope_theta": 1e4}, "rope_theta": 5e5}, "rope_theta"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_config_is_refused(overrides, field, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE_HF, **overrides}))
    with pytest.raises(ValueError, match=f"^{field}: "):
        load_hf_llama(tmp_path)
