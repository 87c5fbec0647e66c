"""Char tokenizer: round trip, special-token handling, and that the saved folder loads through AutoTokenizer."""

import json
import string

import pytest

from twocircuit_jax.model.tokenizer import CHAR_VOCAB_SIZE, build_char_tokenizer, load_tokenizer

TEXT = "12+7-3=16\nWhat is (4 * -5)? ~{x}_|\\" + string.ascii_letters


def test_char_round_trip_and_ids():
    tok = load_tokenizer("char")
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == CHAR_VOCAB_SIZE <= 128
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT)  # one token per character, no specials added
    assert all(4 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == TEXT
    assert (
        len(
            set(
                tok.encode(string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "").replace("\x0c", ""))
            )
        )
        == 96
    )


def test_char_decode_stops_at_eos_and_skips_specials():
    tok = load_tokenizer("char")
    ids = [tok.bos_id] + tok.encode("42") + [tok.pad_id] + tok.encode("7") + [tok.eos_id] + tok.encode("junk")
    assert tok.decode(ids) == "427"
    assert tok.encode("\t") == [3]  # unknown characters map to <unk>, which decode drops
    assert tok.decode(tok.encode("a\tb")) == "ab"


def test_saved_folder_loads_with_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    out = build_char_tokenizer(tmp_path / "tok")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / f).is_file()
    hf = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    char = load_tokenizer("char")
    assert hf.encode(TEXT, add_special_tokens=False) == char.encode(TEXT)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == (0, 1, 2, 3)
    assert len(hf) == char.vocab_size
    assert hf.decode(char.encode(TEXT)) == TEXT
    # The wrapper over the saved folder behaves like the in-memory char tokenizer.
    wrapped = load_tokenizer(str(out))
    assert not wrapped.is_char
    assert (wrapped.eos_id, wrapped.pad_id, wrapped.bos_id, wrapped.vocab_size) == (2, 0, 1, char.vocab_size)
    ids = wrapped.encode(TEXT)
    assert ids == char.encode(TEXT)
    assert wrapped.decode(ids + [2] + ids) == TEXT
    # save() of a loaded folder round-trips too.
    again = load_tokenizer(str(wrapped.save(tmp_path / "again")))
    assert again.encode(TEXT) == ids


def test_char_save_writes_hf_files(tmp_path):
    load_tokenizer("char").save(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<eos>" and cfg["pad_token"] == "<pad>"


def test_missing_or_malformed_folder_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_tokenizer(str(empty))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    (bad / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    with pytest.raises(ValueError, match="bad"):
        load_tokenizer(str(bad))
