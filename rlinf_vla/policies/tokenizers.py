"""Tokenizers shared by the policy families.

- :class:`ActionTokenizer`: OpenVLA's 256-bin action tokenizer on the last ``n_bins`` ids of the
  base vocabulary, operating on ids directly (``prismatic/vla/action_tokenizer.py``).
- :func:`build_offline_tokenizer`: a small real SentencePiece-style tokenizer (character pieces
  with byte fallback, built with the ``tokenizers`` library) with the special-token layout of the
  Llama-2 or Gemma tokenizers. No tokenizer can be downloaded on these machines, so the ``tiny``
  presets use it; it is saved with the checkpoint (``tokenizer.json``) and reloaded with
  ``AutoTokenizer`` exactly like an official tokenizer.
- :func:`load_text_tokenizer`: ``AutoTokenizer`` on a folder with ``tokenizer.json`` or
  ``tokenizer.model``.
- :func:`save_tokenizer`: ``save_pretrained`` with a ``tokenizer_config.json`` that older
  ``transformers`` releases (the official code's pins) can read.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "GEMMA_SPECIALS",
    "LLAMA_SPECIALS",
    "ActionTokenizer",
    "build_offline_tokenizer",
    "has_tokenizer_files",
    "load_text_tokenizer",
    "save_tokenizer",
]

#: Special tokens of the Llama-2 SentencePiece vocabulary, by id.
LLAMA_SPECIALS = ("<unk>", "<s>", "</s>")
#: Special tokens of the Gemma/PaliGemma SentencePiece vocabulary, by id.
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")

_CHARS = string.ascii_letters + string.digits + string.punctuation


@dataclass(frozen=True)
class ActionTokenizer:
    """Continuous actions in ``[-1, 1]`` <-> the last ``n_bins`` token ids of the base vocab.

    ``bins = linspace(-1, 1, n_bins)``; encode: ``id = vocab_size - digitize(clip(a), bins)``
    (``numpy.digitize``, values ``1..n_bins``), so ids lie in ``[vocab_size - n_bins,
    vocab_size)``; decode: ``bin_centers[clip(vocab_size - id - 1, 0, n_bins - 2)]`` with the
    ``n_bins - 1`` centers of consecutive bins.

    Attributes:
        vocab_size: the base vocabulary size without added tokens (32000 for Llama-2).
        n_bins: number of action token ids (256).
    """

    vocab_size: int = 32000
    n_bins: int = 256

    @property
    def first_id(self) -> int:
        """The smallest action token id (31744 for Llama-2)."""
        return self.vocab_size - self.n_bins

    def bins(self, device: torch.device | str = "cpu") -> Tensor:
        return torch.linspace(-1.0, 1.0, self.n_bins, dtype=torch.float64, device=device)

    def bin_centers(self, device: torch.device | str = "cpu") -> Tensor:
        b = self.bins(device)
        return (b[:-1] + b[1:]) / 2

    def encode(self, actions: Tensor) -> Tensor:
        """Normalised actions ``[...]`` -> token ids ``[...]`` (long)."""
        a = actions.to(torch.float64).clamp(-1.0, 1.0)
        d = torch.bucketize(a, self.bins(a.device), right=True)  # == numpy.digitize
        return (self.vocab_size - d).long()

    def decode(self, ids: Tensor) -> Tensor:
        """Token ids ``[...]`` -> normalised actions ``[...]`` (float32)."""
        idx = (self.vocab_size - ids.long() - 1).clamp(0, self.n_bins - 2)
        return self.bin_centers(ids.device)[idx].float()

    def to_index(self, ids: Tensor) -> Tensor:
        """Token ids -> positions ``0..n_bins-1`` among the action ids."""
        return ids.long() - self.first_id

    def from_index(self, index: Tensor) -> Tensor:
        return index.long() + self.first_id


def build_offline_tokenizer(
    vocab_size: int,
    layout: str = "llama",
    pad_token: str | None = None,
) -> Any:
    """A small SentencePiece-style tokenizer (a ``transformers`` fast tokenizer).

    Pieces: the special tokens of ``layout`` (``"llama"``: ``<unk> <s> </s>`` at ids 0-2, BOS
    ``<s>`` prepended; ``"gemma"``: ``<pad> <eos> <bos> <unk>`` at ids 0-3, BOS ``<bos>``
    prepended), the 256 byte-fallback pieces ``<0x00>..<0xFF>``, the word-boundary piece ``▁``,
    single ASCII letters, digits and punctuation, then filler pieces ``<extra_i>`` up to
    ``vocab_size`` (so action ids at the end of the vocabulary never occur in text). Text is
    normalised as SentencePiece does (spaces -> ``▁``; Llama also prepends ``▁``).

    Args:
        vocab_size: size of the base vocabulary (without ``pad_token``).
        layout: ``"llama"`` or ``"gemma"``.
        pad_token: an extra special token added after the base vocabulary (OpenVLA's
            ``<PAD>`` at id ``vocab_size``), or ``None``.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    if layout == "llama":
        specials, bos, eos, unk, pad, prepend = LLAMA_SPECIALS, "<s>", "</s>", "<unk>", None, True
    elif layout == "gemma":
        specials, bos, eos, unk, pad, prepend = (
            GEMMA_SPECIALS,
            "<bos>",
            "<eos>",
            "<unk>",
            "<pad>",
            False,
        )
    else:
        raise ValueError(f"unknown tokenizer layout {layout!r}; known: 'llama', 'gemma'")
    pieces = [*specials, *(f"<0x{b:02X}>" for b in range(256)), "▁", *_CHARS]
    if vocab_size < len(pieces):
        raise ValueError(f"vocab_size must be >= {len(pieces)} (got {vocab_size})")
    pieces += [f"<extra_{i}>" for i in range(vocab_size - len(pieces))]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk, byte_fallback=True))
    norm = [normalizers.Replace(" ", "▁")]
    if prepend:
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prepend:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
    )
    tok.add_special_tokens(list(specials))
    kwargs: dict[str, Any] = {"bos_token": bos, "eos_token": eos, "unk_token": unk}
    if pad is not None:
        kwargs["pad_token"] = pad
    if pad_token is not None:
        tok.add_special_tokens([pad_token])
        kwargs["pad_token"] = pad_token
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


def has_tokenizer_files(path: str | Path) -> bool:
    path = Path(path)
    return (path / "tokenizer.json").exists() or (path / "tokenizer.model").exists()


def load_text_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in ``path``: ``tokenizer.json`` through the fast-tokenizer class (no
    remote code, no ``config.json`` lookup), else ``AutoTokenizer`` on ``tokenizer.model``
    (official SentencePiece files need the ``sentencepiece`` package)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if (path / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    if (path / "tokenizer.model").exists():
        # without the package transformers falls back to tiktoken and reports that one missing
        try:
            import sentencepiece  # noqa: F401
        except ImportError:
            raise ImportError(
                f"{path / 'tokenizer.model'} is a SentencePiece model and reading it needs the "
                "`sentencepiece` package, a dependency of rlinf-vla: pip install sentencepiece"
            ) from None
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {path}")


#: ``tokenizer_config.json`` keys that only transformers >= 5 writes and reads.
_TRANSFORMERS5_KEYS = ("backend",)


def save_tokenizer(tokenizer: Any, path: str | Path, tokenizer_class: str) -> None:
    """``tokenizer.save_pretrained(path)``, then ``tokenizer_config.json`` names
    ``tokenizer_class`` instead of what transformers 5 writes (``TokenizersBackend``, a class
    that transformers 4.x, the official OpenVLA code's pin, does not know), and loses the
    transformers-5-only keys. With ``tokenizer.json`` saved, transformers 4.x's
    ``AutoTokenizer`` builds the fast class of that name from it (``LlamaTokenizer`` ->
    ``LlamaTokenizerFast``), as for a released checkpoint.
    """
    path = Path(path)
    tokenizer.save_pretrained(str(path))
    file = path / "tokenizer_config.json"
    config = json.loads(file.read_text())
    config["tokenizer_class"] = tokenizer_class
    for key in _TRANSFORMERS5_KEYS:
        config.pop(key, None)
    file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
