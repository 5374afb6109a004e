"""Config loading, overrides and validation: bad input is one clear line, before any compile."""
import pytest

from jaxpar.config import (
    ConfigError,
    apply_overrides,
    base_config,
    config_from_dict,
    load_config,
    mesh_shape,
    to_json,
    validate,
)


def test_override_types_and_fields():
    c = load_config("configs/test.py")
    apply_overrides(c, ["model.layers=3", "train.lr=1", "data.normalize=true", "train.remat=dots"])
    assert c.model.layers == 3 and c.train.lr == 1.0 and isinstance(c.train.lr, float)
    assert c.data.normalize is True and c.train.remat == "dots"


@pytest.mark.parametrize("override, field", [
    ("model.layrs=4", "model.layrs"),
    ("modl.layers=4", "modl"),
    ("model.layers=four", "model.layers"),
    ("model.layers=4.5", "model.layers"),
    ("data.normalize=maybe", "data.normalize"),
    ("model=3", "model"),
    ("layers", "--set"),
])
def test_bad_override_names_the_field(override, field):
    c = base_config()
    c.lock()
    with pytest.raises(ConfigError) as err:
        apply_overrides(c, [override])
    assert err.value.field == field


def test_mesh_fill_and_product():
    c = base_config()
    assert mesh_shape(c, 8) == {"data": 8, "fsdp": 1, "pipe": 1, "expert": 1, "context": 1, "tensor": 1}
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, -1, 2
    assert mesh_shape(c, 8)["fsdp"] == 2
    c.mesh.fsdp = 3
    with pytest.raises(ConfigError, match="uses 12 devices but 8"):
        mesh_shape(c, 8)


@pytest.mark.parametrize("overrides, field", [
    (["mesh.data=3"], "mesh"),                            # product 3 != 8 devices
    (["mesh.tensor=8"], "model.heads"),
    (["model.kv_heads=3"], "model.kv_heads"),
    (["mesh.tensor=4"], "model.kv_heads"),               # kv_heads=2 cannot be split 4 ways
    (["train.batch_size=12"], "train.batch_size"),
    (["train.microbatches=3"], "train.microbatches"),
    (["mesh.pipe=2"], "parallel.pipe"),                 # a pipe axis needs a schedule, not auto
    (["mesh.expert=2"], "mesh.expert"),
    (["train.compute_dtype=float16"], "train.compute_dtype"),
    (["train.remat=some"], "train.remat"),
    (["data.seq_len=128"], "data.seq_len"),
])
def test_validation_names_the_field(overrides, field):
    c = load_config("configs/test.py")
    apply_overrides(c, overrides)
    with pytest.raises(ConfigError) as err:
        validate(c, 8)
    assert err.value.field == field


@pytest.mark.parametrize("path", ["configs/default.py", "configs/test.py", "configs/llama_1b.py",
                                  "configs/arabic_7b.py"])
def test_shipped_configs_validate(path):
    c = load_config(path)
    validate(c, 64 if "7b" in path or "1b" in path else 8)


def test_arabic_7b_has_llama2_7b_shape():
    from jaxpar.model.counting import param_count
    from jaxpar.model.transformer import ModelConfig
    m = load_config("configs/arabic_7b.py").model
    assert (m.layers, m.d_model, m.heads, m.mlp_dim) == (32, 4096, 32, 11008)
    # Llama-2-7B has 6.74e9 params at vocab 32000; 64000 adds 2 x 32000 x 4096 = 0.26e9.
    total = param_count(ModelConfig.from_config(m))["total"]
    assert total == 6_738_415_616 + 2 * 32000 * 4096


def test_automatic_vocabulary_is_refused_where_tensor_does_not_divide_it():
    from jaxpar.config import model_vocab_size
    config = base_config()
    for tensor in (1, 2, 4, 8, 128):
        assert model_vocab_size(config, 1000, tensor) == 1024     # padded to a multiple of 128, mesh-independent
    with pytest.raises(ConfigError, match=r"mesh.tensor=3 does not divide; set model.vocab_size=768 "):
        model_vocab_size(config, 512, 3)
    with pytest.raises(ConfigError, match=r"set model.vocab_size=1152 \(a multiple of 384\)"):
        model_vocab_size(config, 1000, 6)
    config.model.vocab_size = 1152
    assert model_vocab_size(config, 1000, 6) == 1152


def test_presets_resolve_from_any_working_directory(tmp_path, monkeypatch):
    """The presets ship in the package: their path (the README's spelling) or their name loads them anywhere."""
    from jaxpar.config import PRESETS, config_reference, preset_names
    monkeypatch.chdir(tmp_path)
    assert load_config("configs/mixtral_tiny.py").model.moe.experts == 8
    for given in ("configs/test.py", "test", "test.py"):
        assert load_config(given).name == "test" and config_reference(given) == "test"
    assert {"default", "test", "llama_1b", "arabic_7b", "mixtral_tiny"} <= set(preset_names())
    assert "__init__" not in preset_names() and PRESETS.parent.name == "jaxpar"
    with pytest.raises(ConfigError, match="no such config file 'configs/none.py'; presets .*: arabic_7b, .*test"):
        load_config("configs/none.py")
    with pytest.raises(ConfigError, match="no such config file 'nope'"):
        load_config("nope")


def test_a_users_file_wins_over_the_preset_of_its_name(tmp_path, monkeypatch):
    from jaxpar.config import config_reference
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "test.py").write_text(
        "from jaxpar.config import base_config\n\ndef get_config():\n    c = base_config()\n"
        "    c.name = 'mine'\n    return c\n")
    monkeypatch.chdir(tmp_path)
    assert load_config("configs/test.py").name == "mine"
    assert config_reference("configs/test.py") == str(tmp_path / "configs" / "test.py")   # loadable elsewhere
    assert load_config("test").name == "test"         # a bare name is the preset (no file 'test' here)


def test_a_saved_config_without_a_newer_field_loads_with_its_default():
    """Readers use `config.parallel.grad_buckets`, never `.get(field, default)`: a run directory saved before a
    field existed gets config.py's default where it is loaded (config_from_dict), the one place."""
    import json
    saved = json.loads(to_json(base_config()))
    for field in ("grad_buckets", "prefetch", "tensor_overlap", "pipe_virtual"):
        del saved["parallel"][field]
    del saved["model"]["attention"]
    config = config_from_dict(saved)
    defaults = base_config()
    assert config.parallel.grad_buckets == defaults.parallel.grad_buckets
    assert config.parallel.tensor_overlap == defaults.parallel.tensor_overlap
    assert config.model.attention == defaults.model.attention
