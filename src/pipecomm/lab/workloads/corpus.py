"""Character-level text: an English corpus available offline, its vocabulary, encoding and batches.

``load_text("pydoc")`` is the documentation topics that CPython ships in ``pydoc_data.topics``;
the text differs between Python versions, so every :class:`CharCorpus` carries the sha256 of the
exact text it was built from (:func:`text_sha256`).

Example::

    >>> from pipecomm.lab.workloads.corpus import CharCorpus, load_text
    >>> corpus = CharCorpus(load_text("pydoc"))
    >>> x, y = corpus.batch(16, 64, torch.Generator().manual_seed(0))
    >>> x.dtype, x.shape
    (torch.int64, torch.Size([16, 64]))
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["TEXTS", "CharCorpus", "load_text", "text_sha256"]

TEXTS = ("pydoc",)


def text_sha256(text: str) -> str:
    """sha256 of ``text`` encoded as UTF-8 (cite it with results trained on that text).

    Example::

        >>> text_sha256("abc")
        'ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad'
    """
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_text(name: str = "pydoc", *, path: str | os.PathLike | None = None) -> str:
    """An English text corpus available offline.

    ``"pydoc"``: the documentation topics shipped with CPython (``pydoc_data.topics``, the text
    of ``help('topic')``), joined in sorted key order with blank lines. About 465 KB on Python
    3.11; it changes with the Python version, so cite :func:`text_sha256` of it. With ``path=``,
    the UTF-8 text of that file instead (``name`` is then ignored).

    Example::

        >>> text = load_text("pydoc")
        >>> len(text) > 100_000, len(text_sha256(text))   # 465126, '71f2ff5d99bd...' on Python 3.11
        (True, 64)
    """
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    if name == "pydoc":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    raise ValueError(f"unknown text corpus {name!r}; choose one of {TEXTS} or pass path=")


class CharCorpus:
    """A character-level language-modelling corpus: vocabulary, encoding, train/val split, batches.

    The vocabulary is the sorted set of characters of ``text``; ids are their ranks. The first
    ``1 - val_fraction`` of the text (as ids) is the training split, the rest validation.
    ``sha256`` identifies the text exactly.

    Example::

        >>> from pipecomm.lab.workloads import models
        >>> corpus = CharCorpus(load_text("pydoc"))
        >>> g = torch.Generator().manual_seed(0)
        >>> x, y = corpus.batch(16, 64, g)             # int64 [16, 64]; y is x shifted by one
        >>> torch.equal(x[:, 1:], y[:, :-1])
        True
        >>> model = models.get_model("char_transformer", vocab_size=corpus.vocab_size)
    """

    def __init__(self, text: str, *, val_fraction: float = 0.1) -> None:
        if not isinstance(text, str) or len(text) < 2:
            raise ValueError("text must be a str of at least 2 characters")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
        self.text_length = len(text)
        self.sha256 = text_sha256(text)
        self.vocab: list[str] = sorted(set(text))
        self._stoi = {c: i for i, c in enumerate(self.vocab)}
        ids = self.encode(text)
        n_val = int(len(ids) * val_fraction)
        self.train = ids[: len(ids) - n_val]
        self.val = ids[len(ids) - n_val :]

    @classmethod
    def from_name(cls, name: str = "pydoc", *, val_fraction: float = 0.1) -> CharCorpus:
        """``CharCorpus(load_text(name))``. Example: ``CharCorpus.from_name("pydoc")``."""
        return cls(load_text(name), val_fraction=val_fraction)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, s: str) -> torch.Tensor:
        """Characters -> int64 ids. Example: ``corpus.encode("def")``."""
        try:
            return torch.tensor([self._stoi[c] for c in s], dtype=torch.int64)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the corpus vocabulary") from None

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """int ids -> characters. Example: ``corpus.decode(corpus.encode("def")) == "def"``."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        try:
            return "".join(self.vocab[i] for i in ids)
        except (IndexError, TypeError) as e:
            raise ValueError(f"ids must be integers in [0, {self.vocab_size}): {e}") from None

    def batch(
        self,
        batch_size: int,
        seq_len: int,
        generator: torch.Generator | None = None,
        *,
        split: str = "train",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows ``(x, y)``, each int64 ``[batch_size, seq_len]``, ``y[:, t] = x[:, t+1]``.

        Window starts are uniform over the split, drawn from ``generator`` (reproducible per seed).

        Example::

            >>> corpus = CharCorpus(load_text("pydoc"))
            >>> x, y = corpus.batch(8, 32, torch.Generator().manual_seed(0), split="val")
            >>> x.shape
            torch.Size([8, 32])
        """
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        data = self.train if split == "train" else self.val
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if seq_len + 1 > len(data):
            raise ValueError(
                f"seq_len {seq_len} needs at least {seq_len + 1} characters; the {split} split has {len(data)}"
            )
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        offsets = starts[:, None] + torch.arange(seq_len + 1)[None, :]
        window = data[offsets]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
