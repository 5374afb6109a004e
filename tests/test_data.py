"""Corpus loading, tokenizer caching, packing and the Grain pipeline's determinism."""
import json
import unicodedata

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError, load_config
from jaxpar.data.corpus import load_documents, normalize_arabic, quran_path
from jaxpar.data.pipeline import build_token_data, local_rows, pack, train_dataset
from jaxpar.data.tokenizer import get_tokenizer


def test_quran_corpus_is_read_from_the_package_file():
    docs = load_documents("quran")
    assert len(docs) == 114                          # one document per sura
    assert sum(len(d.splitlines()) for d in docs) == 6236   # every aya
    assert normalize_arabic(docs[0]).startswith("بسم الله الرحمن الرحيم")
    assert quran_path().name == "quran-uthmani.xml"


def test_normalization_strips_diacritics_and_tatweel():
    assert normalize_arabic("بِسْمِ ٱللَّهِ") == "بسم الله"
    assert normalize_arabic("كـــتب") == "كتب"


def test_user_corpora(tmp_path):
    txt = tmp_path / "c.txt"
    txt.write_text("سطر أول\n\nسطر ثان\n", encoding="utf-8")
    assert load_documents(str(txt)) == ["سطر أول", "سطر ثان"]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"text": "نص"}) + "\n" + json.dumps({"text": "آخر"}) + "\n", encoding="utf-8")
    assert load_documents(str(jsonl)) == ["نص", "آخر"]


@pytest.mark.parametrize("content, suffix, message", [
    (None, ".txt", "no such file"),
    ("", ".txt", "holds no text"),
    ("\n  \n", ".txt", "holds no text"),
    ("{\"txt\": 1}\n", ".jsonl", "no string 'text'"),
    ("not json\n", ".jsonl", "not valid JSON"),
    ("x", ".csv", "must end in .txt or .jsonl"),
])
def test_bad_corpora_name_the_field(tmp_path, content, suffix, message):
    path = tmp_path / f"corpus{suffix}"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as err:
        load_documents(str(path))
    assert err.value.field == "data.corpus"


@pytest.mark.parametrize("content, suffix, message", [
    ("سطر".encode("cp1256") + b"\n", ".txt", "not UTF-8 text \\(invalid byte at offset 0\\)"),
    (b"ok\n\xff\xfe", ".txt", "not UTF-8 text \\(invalid byte at offset 3\\)"),
    (b'{"text": "ok"}\n\x89PNG\r\n', ".jsonl", "not UTF-8 text \\(invalid byte at offset 15\\)"),
    (b"ELF\x00\x01\x02 text\n", ".txt", "is binary, not text \\(NUL byte at offset 3\\)"),
], ids=["cp1256", "bad-tail", "jsonl-then-png", "nul-byte"])
def test_binary_or_non_utf8_corpora_are_refused(tmp_path, content, suffix, message):
    path = tmp_path / f"corpus{suffix}"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as err:
        load_documents(str(path))
    assert err.value.field == "data.corpus" and "\n" not in str(err.value)


def test_tokenizer_round_trips_arabic_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAR_CACHE", str(tmp_path))
    docs = load_documents("quran")[:20]
    tok = get_tokenizer(docs, "bpe", 400)
    assert tok.decode(tok.encode(docs[3]).ids) == unicodedata.normalize("NFC", docs[3])
    typed = "\u0628\u0650\u0633\u0652\u0645\u0650 \u0671\u0644\u0644\u064e\u0651\u0647\u0650"  # fatha, then shadda
    stored = "\u0628\u0650\u0633\u0652\u0645\u0650 \u0671\u0644\u0644\u0651\u064e\u0647\u0650"  # as Tanzil writes it
    assert tok.encode(typed).ids == tok.encode(stored).ids
    cached = list((tmp_path / "tokenizers").glob("*.json"))
    assert len(cached) == 1
    again = get_tokenizer(docs, "bpe", 400)
    assert again.to_str() == tok.to_str()
    get_tokenizer(docs, "bpe", 300)                       # another setting: another cache entry
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 2
    tok.save(str(tmp_path / "given.json"))
    assert get_tokenizer([], str(tmp_path / "given.json"), 0).to_str() == tok.to_str()


def test_pack_makes_overlapping_windows_with_eos():
    seqs = pack([[1, 2, 3], [4, 5]], eos=0, seq_len=3)
    # stream 1 2 3 0 4 5 0 -> windows of 4 tokens at stride 3
    np.testing.assert_array_equal(seqs, [[1, 2, 3, 0], [0, 4, 5, 0]])


def test_token_data_split_and_stats():
    c = load_config("configs/test.py")
    data = build_token_data(c.data)
    assert data.train.shape[1] == c.data.seq_len + 1
    assert data.stats["val_sequences"] == len(data.val) > 0
    assert data.stats["tokens_per_word"] > 1
    train_rows = {row.tobytes() for row in data.train}
    assert not any(row.tobytes() in train_rows for row in data.val)


def test_pipeline_is_deterministic_and_resumable():
    seqs = np.arange(40 * 5, dtype=np.int32).reshape(40, 5)
    rows = slice(0, 8)
    first = iter(train_dataset(seqs, 8, seed=3, rows=rows))
    batches = [next(first) for _ in range(7)]             # crosses an epoch boundary (5 batches per epoch)
    state = first.get_state()
    expected = [next(first) for _ in range(3)]
    second = iter(train_dataset(seqs, 8, seed=3, rows=rows))
    np.testing.assert_array_equal(next(second), batches[0])
    second.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(second), want)
    epoch1 = np.concatenate(batches[:5])[:, 0]
    epoch2 = np.concatenate([batches[5], batches[6], *expected])[:, 0]
    assert sorted(epoch1) == sorted(epoch2[:40]) == list(range(0, 200, 5))   # every sequence once per epoch
    assert list(epoch1) != list(epoch2[:40])                                  # reshuffled each epoch


def test_local_rows_follow_the_batch_sharding():
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, P("data", None))
    np.testing.assert_array_equal(local_rows(sharding, 16, 5), np.arange(16))   # one process holds every row
