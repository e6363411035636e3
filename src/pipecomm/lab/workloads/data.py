"""Data sets for the training experiments: offline images and text, MNIST/CIFAR-10 loaders, sharding.

No paper equation; this module supplies the inputs of the BSP-SGD, Pipe-SGD (Li et al., NeurIPS
2018), layer-wise/delayed GD (Daily et al., 2017) and decentralized Adam (Wang et al., ICLR 2025)
experiments. Which data set each profile uses, where it comes from, its licence and checksums are
in ``data/README.md``.

* ``load_dataset("digits")`` - real 8x8 handwritten digits that ship inside scikit-learn (UCI
  Optical Recognition of Handwritten Digits, 1797 images, 10 classes): the cpu profile's images,
  no download, with a deterministic stratified train/test split per seed.
* ``load_dataset("mnist" | "cifar10", root=...)`` - the gpu profile's images, read from the
  official files under ``root`` (IDX files; CIFAR-10 "python" pickles). ``fetch(name, root)``
  (:mod:`pipecomm.lab.workloads.download`) downloads and verifies them, and only when called explicitly: nothing in this module touches
  the network otherwise.
* ``load_text("pydoc")`` / ``CharCorpus`` (:mod:`pipecomm.lab.workloads.corpus`) - an English character-level corpus available offline:
  the documentation topics that CPython ships in ``pydoc_data.topics``. The text differs between
  Python versions, so every corpus carries the sha256 of the exact text it was built from.
* ``shard`` / ``batches`` (:mod:`pipecomm.lab.workloads.sharding`) - a deterministic, disjoint, equal-sized split of a data set over ranks
  per epoch (the data-parallel setting of all four papers) and a minibatch iterator over a shard.

This module holds the image data sets; the others' names are importable from it as well.

Example::

    >>> from pipecomm.lab.workloads import data
    >>> X, y = data.load_dataset("digits", split="train", seed=0)
    >>> X.shape, X.dtype, y.dtype
    (torch.Size([1438, 1, 8, 8]), torch.float32, torch.int64)
    >>> idx = data.shard(len(X), rank=0, world_size=4, seed=0, epoch=0)
    >>> sum(len(xb) for xb, yb in data.batches(X, y, idx, batch_size=32, seed=0, epoch=0))
    352
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import math
import os
import pickle
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

# re-exported: public API (pipecomm.lab.workloads.data.<name>)
from pipecomm.lab.workloads.corpus import TEXTS as TEXTS
from pipecomm.lab.workloads.corpus import CharCorpus, load_text, text_sha256
from pipecomm.lab.workloads.download import CIFAR10_DIR, download_file, fetch, file_digest
from pipecomm.lab.workloads.sharding import batches, mix_seed, shard

__all__ = [
    "DATASETS",
    "DIGITS_SHA256",
    "CharCorpus",
    "batches",
    "fetch",
    "digits_split_indices",
    "download_file",
    "file_digest",
    "load_cifar10",
    "load_dataset",
    "load_mnist",
    "load_text",
    "read_cifar_batch",
    "read_idx",
    "shard",
    "text_sha256",
]

DATASETS = ("digits", "mnist", "cifar10")

# sha256 of the digits data as scikit-learn returns it: images as uint8 (values 0..16, C order,
# shape 1797x8x8) followed by the targets as int64 little-endian. Checked on every load (warning on
# mismatch) so results say which data they were trained on.
DIGITS_SHA256 = "65e5b4619795efb40c1082f4c350c049e4ad552200d369b6ae99e21eef5e72c5"

# Normalisation constants (mean, std over the training images after scaling to [0, 1]); the
# usual published values for these data sets.
_MNIST_MEAN, _MNIST_STD = (0.1307,), (0.3081,)
_CIFAR10_MEAN, _CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)

_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def load_dataset(
    name: str,
    *,
    root: str | os.PathLike | None = None,
    split: str = "train",
    seed: int = 0,
    test_fraction: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load an image classification data set as ``(X, y)``.

    ``X`` is float32 ``[N, C, H, W]``, normalised (zero mean, unit variance per channel as
    described below); ``y`` is int64 ``[N]`` with class labels 0..9.

    * ``"digits"``: scikit-learn's bundled 8x8 digits (1x8x8), no download. ``split`` is a
      stratified held-out split fixed by ``seed`` (``test_fraction`` of every class goes to
      "test"); pixel values 0..16 are standardised with the mean and std of that seed's training
      split, so train and test use the same transform.
    * ``"mnist"``: 1x28x28 from the IDX files under ``root`` (``.gz`` or not; looked up in
      ``root``, ``root/mnist`` and ``root/MNIST/raw``); train 60000, test 10000.
    * ``"cifar10"``: 3x32x32 from the "python" batches under ``root`` (``root`` itself or
      ``root/cifar-10-batches-py``); train 50000, test 10000.

    ``seed`` and ``test_fraction`` only affect "digits" (MNIST and CIFAR-10 have official splits).

    Example::

        >>> X, y = load_dataset("digits", split="test", seed=1)
        >>> X.shape, y.shape
        (torch.Size([359, 1, 8, 8]), torch.Size([359]))
        >>> # X, y = load_dataset("cifar10", root="~/data", split="train")   (a downloaded set)
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if name == "digits":
        return _load_digits(split, seed, test_fraction)
    if name in ("mnist", "cifar10"):
        if root is None:
            raise ValueError(
                f"load_dataset({name!r}) needs root=, the folder holding the official files; "
                f"get them once with pipecomm.lab.workloads.data.fetch({name!r}, root) (needs network)"
            )
        if name == "mnist":
            return load_mnist(root, split=split)
        return load_cifar10(root, split=split)
    raise ValueError(f"unknown data set name {name!r}; choose one of {DATASETS}")


@functools.lru_cache(maxsize=1)
def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the 'digits' data set ships with scikit-learn; install it with "
            "`pip install 'pipecomm[data]'` (or `pip install scikit-learn`)"
        ) from e
    bunch = load_digits()
    images = np.asarray(bunch.images).astype(np.uint8)
    target = np.asarray(bunch.target).astype("<i8")
    images.flags.writeable = False  # cached: shared by every call
    target.flags.writeable = False
    digest = hashlib.sha256(images.tobytes() + target.tobytes()).hexdigest()
    if digest != DIGITS_SHA256:
        warnings.warn(
            f"scikit-learn's digits data has sha256 {digest}, not the {DIGITS_SHA256} this "
            "artifact was built with; results may not be comparable",
            RuntimeWarning,
            stacklevel=3,
        )
    return images, target


def _stratified_split(y: np.ndarray, seed: int, test_fraction: float) -> tuple[np.ndarray, ...]:
    gen = torch.Generator().manual_seed(mix_seed(seed, 0x5D17))
    train, test = [], []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        perm = idx[torch.randperm(len(idx), generator=gen).numpy()]
        n_test = int(round(len(idx) * test_fraction))
        test.append(perm[:n_test])
        train.append(perm[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def digits_split_indices(
    seed: int = 0, test_fraction: float = 0.2
) -> tuple[np.ndarray, np.ndarray]:
    """Indices (into scikit-learn's 1797 digits, sorted) of the train and test split for ``seed``.

    Per class, a permutation fixed by ``seed`` sends ``round(test_fraction * class size)``
    samples to test and the rest to train; the two are disjoint and cover all 1797 samples.

    Example::

        >>> train_idx, test_idx = digits_split_indices(seed=0)
        >>> len(train_idx), len(test_idx)
        (1438, 359)
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    _, target = _digits_raw()
    return _stratified_split(target, seed, test_fraction)


def _load_digits(split: str, seed: int, test_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    images, target = _digits_raw()
    train_idx, test_idx = _stratified_split(target, seed, test_fraction)
    x_train = images[train_idx].astype(np.float64) / 16.0
    mean, std = float(x_train.mean()), float(x_train.std())
    idx = train_idx if split == "train" else test_idx
    x = (images[idx].astype(np.float64) / 16.0 - mean) / std
    X = torch.from_numpy(x.astype(np.float32)).unsqueeze(1).contiguous()
    return X, torch.from_numpy(target[idx].astype(np.int64))


def _normalise_uint8(x: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 [N, C, H, W] -> float32, scaled to [0, 1], then per-channel (x - mean) / std."""
    t = torch.from_numpy(np.ascontiguousarray(x)).to(torch.float32).div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return t.sub_(m).div_(s)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (the MNIST format), gzip-compressed or not, into a numpy array.

    The header is two zero bytes, a type code (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32,
    0x0D float32, 0x0E float64), the number of dimensions, then each dimension as a big-endian
    uint32. Raises ``ValueError`` naming the file if the magic, type, dimensions or length are
    wrong, and ``FileNotFoundError`` if it is missing.

    Example::

        >>> import gzip, os, struct, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "t10k-images-idx3-ubyte.gz")   # 2 images of 28 x 28
        >>> with gzip.open(path, "wb") as f:
        ...     _ = f.write(bytes([0, 0, 0x08, 3]) + struct.pack(">3I", 2, 28, 28) + bytes(2 * 28 * 28))
        >>> images = read_idx(path)      # MNIST's file: uint8 [10000, 28, 28]
        >>> images.dtype, images.shape
        (dtype('uint8'), (2, 28, 28))
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, ValueError) as e:
            raise ValueError(f"{path}: corrupt gzip data ({e}); delete it and fetch again") from e
    if len(raw) < 4:
        raise ValueError(f"{path}: not an IDX file (only {len(raw)} bytes)")
    if raw[0] != 0 or raw[1] != 0:
        raise ValueError(
            f"{path}: not an IDX file (magic starts {raw[:2].hex()}, expected 0000); "
            "is it a corrupt or HTML download?"
        )
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX data type 0x{code:02x}")
    if ndim == 0:
        raise ValueError(f"{path}: IDX header declares 0 dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes, need {header})")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = _IDX_DTYPES[code]
    expected = header + math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(
            f"{path}: IDX header says shape {dims} of {dtype} ({expected} bytes with header) "
            f"but the file holds {len(raw)} bytes; it is truncated or corrupt"
        )
    arr = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def _find_mnist(root: Path, stem: str) -> Path:
    for folder in (root, root / "mnist", root / "MNIST" / "raw"):
        for name in (stem, stem + ".gz"):
            if (folder / name).is_file():
                return folder / name
    raise FileNotFoundError(
        f"MNIST file {stem}(.gz) not found under {root} (looked in ., mnist/, MNIST/raw/); "
        f"download it with pipecomm.lab.workloads.data.fetch('mnist', {str(root)!r}) or place the official files there"
    )


def load_mnist(
    root: str | os.PathLike, *, split: str = "train"
) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST from its IDX files: ``X`` float32 ``[N, 1, 28, 28]`` normalised, ``y`` int64 ``[N]``.

    Checks that images are 3-D uint8 28x28, labels 1-D uint8 in 0..9, and that their counts match.

    Example::

        X, y = load_mnist("~/data", split="test")                  # [10000, 1, 28, 28]
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(root).expanduser()
    prefix = "train" if split == "train" else "t10k"
    img_path = _find_mnist(root, f"{prefix}-images-idx3-ubyte")
    lbl_path = _find_mnist(root, f"{prefix}-labels-idx1-ubyte")
    images, labels = read_idx(img_path), read_idx(lbl_path)
    if images.ndim != 3 or images.dtype != np.uint8 or images.shape[1:] != (28, 28):
        raise ValueError(
            f"{img_path}: expected uint8 images of shape [N, 28, 28], got {images.dtype} {images.shape}"
        )
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise ValueError(
            f"{lbl_path}: expected 1-D uint8 labels, got {labels.dtype} {labels.shape}"
        )
    if len(labels) != len(images):
        raise ValueError(
            f"{img_path} holds {len(images)} images but {lbl_path} holds {len(labels)} labels"
        )
    if len(labels) and labels.max() > 9:
        raise ValueError(f"{lbl_path}: label {int(labels.max())} out of range 0..9")
    X = _normalise_uint8(images[:, None], _MNIST_MEAN, _MNIST_STD)
    return X, torch.from_numpy(labels.astype(np.int64))


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that can rebuild numpy arrays and nothing else (a CIFAR batch is untrusted)."""

    _ALLOWED = {
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # bytes in protocol-2 pickles written by Python 3
    }

    def find_class(self, module: str, name: str):
        # pickles written by numpy 1.x (and the Python 2 originals) name numpy.core
        if module.startswith("numpy.core"):
            module = "numpy._core" + module[len("numpy.core") :]
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name}: a CIFAR-10 batch holds only numpy arrays, lists and bytes"
            )
        return super().find_class(module, name)


def read_cifar_batch(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR-10 "python" batch: ``(images uint8 [N, 3, 32, 32], labels int64 [N])``.

    The file is a pickled dict with ``b"data"`` (N x 3072 uint8: 1024 red, 1024 green, 1024 blue
    values, each row-major) and ``b"labels"`` (N ints in 0..9). Only numpy arrays are unpickled.
    Raises ``ValueError`` naming the file if it is not such a dict.

    Example::

        >>> import os, pickle, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "test_batch")                # 2 images
        >>> with open(path, "wb") as f:
        ...     pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [3, 5]}, f)
        >>> images, labels = read_cifar_batch(path)     # CIFAR's file: [10000, 3, 32, 32]
        >>> images.shape, labels.tolist()
        ((2, 3, 32, 32), [3, 5])
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            obj = _NumpyOnlyUnpickler(f, encoding="latin1").load()
    except FileNotFoundError:
        raise
    except Exception as e:
        raise ValueError(f"{path}: not a readable CIFAR-10 batch ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    obj = {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in obj.items()}
    if "data" not in obj or "labels" not in obj:
        raise ValueError(f"{path}: missing key 'data' or 'labels' (keys: {sorted(map(str, obj))})")
    data, labels = obj["data"], np.asarray(obj["labels"])
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3072
    ):
        desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise ValueError(f"{path}: 'data' must be a uint8 array of shape [N, 3072], got {desc}")
    if labels.ndim != 1 or len(labels) != len(data) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{path}: 'labels' must be {len(data)} integers, got {labels.dtype} {labels.shape}"
        )
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path}: labels out of range 0..9")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def load_cifar10(
    root: str | os.PathLike, *, split: str = "train"
) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10 from its "python" batches: ``X`` float32 ``[N, 3, 32, 32]`` normalised, ``y`` int64.

    Train is ``data_batch_1`` .. ``data_batch_5`` in order, test is ``test_batch``; looked up in
    ``root/cifar-10-batches-py`` or ``root`` itself.

    Example::

        X, y = load_cifar10("~/data", split="test")                 # [10000, 3, 32, 32]
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(root).expanduser()
    names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    folder = next((d for d in (root / CIFAR10_DIR, root) if (d / names[0]).is_file()), None)
    if folder is None:
        raise FileNotFoundError(
            f"CIFAR-10 batch {names[0]} not found in {root} or {root / CIFAR10_DIR}; download it "
            f"with pipecomm.lab.workloads.data.fetch('cifar10', {str(root)!r}) or extract the official archive there"
        )
    parts = [read_cifar_batch(folder / n) for n in names]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    return _normalise_uint8(images, _CIFAR10_MEAN, _CIFAR10_STD), torch.from_numpy(labels)
