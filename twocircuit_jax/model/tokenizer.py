"""Tokenizers: the built-in character-level one (tiny demo models) and local Hugging Face tokenizer folders.

`load_tokenizer(spec)` returns a `Tokenizer` wrapper with one small surface for the rest of the code:
`encode(text) -> list[int]` (no special tokens added), `decode(ids) -> str` (stops at the first EOS, drops the
other specials), `eos_id`, `pad_id`, `bos_id`, `vocab_size`, `save(dir)`.

The char vocabulary is fixed (not learned), so the in-memory tokenizer and a saved folder agree by construction:
ids 0..3 are `<pad> <bos> <eos> <unk>`, 4 is newline, 5.. are printable ASCII (space .. `~`); 100 ids in all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
CHAR_VOCAB = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARS))}
CHAR_VOCAB_SIZE = len(CHAR_VOCAB)  # 100

HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _char_backend():
    """The char tokenizer as a `tokenizers.Tokenizer`: a BPE with no merges is exactly one token per character."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models

    tok = HFTokenizer(models.BPE(vocab=dict(CHAR_VOCAB), merges=[], unk_token=UNK))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    # Fuse concatenates tokens; the default decoder would put spaces between characters.
    tok.decoder = decoders.Fuse()
    return tok


def build_char_tokenizer(out_dir) -> Path:
    """Write the char tokenizer to `out_dir` in Hugging Face format (loadable by AutoTokenizer and vLLM)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _char_backend().save(str(out / "tokenizer.json"))
    specials = {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        # No BOS is prepended by default: prompts are encoded exactly as given (see Tokenizer.encode).
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return out


class Tokenizer:
    """Thin wrapper; `spec` is 'char' or the local folder it came from."""

    def __init__(self, spec: str, *, hf=None):
        self.spec = spec
        self._hf = hf  # None for the char tokenizer (pure-python table, no files)
        if hf is None:
            self.eos_id, self.pad_id, self.bos_id = CHAR_VOCAB[EOS], CHAR_VOCAB[PAD], CHAR_VOCAB[BOS]
            self.unk_id = CHAR_VOCAB[UNK]
            self.vocab_size = CHAR_VOCAB_SIZE
            self._inv = {i: t for t, i in CHAR_VOCAB.items()}
            self._specials = {CHAR_VOCAB[t] for t in SPECIAL_TOKENS}
        else:
            if hf.eos_token_id is None:
                raise ValueError(f"tokenizer at {spec}: no eos_token defined; set eos_token in tokenizer_config.json")
            self.eos_id = int(hf.eos_token_id)
            # Many HF tokenizers have no pad token; padding positions are masked anyway, so EOS serves.
            self.pad_id = int(hf.pad_token_id) if hf.pad_token_id is not None else self.eos_id
            self.bos_id = int(hf.bos_token_id) if hf.bos_token_id is not None else None
            self.unk_id = int(hf.unk_token_id) if hf.unk_token_id is not None else None
            self.vocab_size = len(hf)
            self._specials = set(int(i) for i in hf.all_special_ids)

    @property
    def is_char(self) -> bool:
        return self._hf is None

    def encode(self, text: str) -> list[int]:
        if self._hf is None:
            return [CHAR_VOCAB.get(c, self.unk_id) for c in text]
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        ids = [i for i in ids if i not in self._specials]
        if self._hf is None:
            return "".join(self._inv.get(i, "") for i in ids)
        return self._hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def save(self, out_dir) -> Path:
        """Write Hugging Face files to `out_dir` (what vLLM and `load_tokenizer(out_dir)` read)."""
        if self._hf is None:
            return build_char_tokenizer(out_dir)
        self._hf.save_pretrained(str(out_dir))
        return Path(out_dir)

    def __repr__(self):
        return f"Tokenizer({self.spec!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, pad_id={self.pad_id})"


def load_tokenizer(spec: Optional[str]) -> Tokenizer:
    """'char' (or empty) -> the built-in char tokenizer; otherwise a local Hugging Face tokenizer folder.

    Never downloads: a missing or malformed folder raises FileNotFoundError / ValueError naming the path.
    """
    if spec is None or spec == "" or spec == "char":
        return Tokenizer("char")
    path = Path(os.path.expanduser(str(spec)))
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer: {spec!r} is neither 'char' nor an existing local folder")
    if not any(
        (path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    ):
        raise FileNotFoundError(
            f"tokenizer: folder {path} has no tokenizer files (expected tokenizer.json and "
            f"tokenizer_config.json, e.g. from build_char_tokenizer or a Hugging Face model)"
        )
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types (OSError, JSONDecodeError, KeyError, ...)
        raise ValueError(f"tokenizer: cannot load {path}: {type(e).__name__}: {e}") from e
    return Tokenizer(str(path), hf=hf)
