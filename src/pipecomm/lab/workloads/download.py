"""Download of the official data sets (only when called explicitly), verified by checksum.

:func:`fetch` gets MNIST or CIFAR-10 into a folder that :func:`pipecomm.lab.workloads.data.load_dataset`
reads; :func:`download_file` and :func:`file_digest` do one file. Nothing else in the lab touches
the network. Which files, from where, with which published checksums: below and in
``data/README.md``.

Example::

    from pipecomm.lab.workloads import download
    download.fetch("cifar10", "~/data")
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CIFAR10_DIR", "download_file", "fetch", "file_digest"]

# Official files and their published checksums. MNIST: its home page publishes no checksum; the
# md5 values are those torchvision verifies (pytorch/vision, torchvision/datasets/mnist.py), which
# the MNIST files downloaded from both mirrors have matched for years. CIFAR-10: the archive's md5
# is published on https://www.cs.toronto.edu/~kriz/cifar.html; the per-batch md5 values are
# torchvision's (torchvision/datasets/cifar.py). No sha256 is published for either.
_MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
_MNIST_FILES = {
    "train-images-idx3-ubyte.gz": ("md5", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
    "train-labels-idx1-ubyte.gz": ("md5", "d53e105ee54ea40749a09fcbcd1e9432"),
    "t10k-images-idx3-ubyte.gz": ("md5", "9fb629c4189551a2d022fa330f9573f3"),
    "t10k-labels-idx1-ubyte.gz": ("md5", "ec29112dd5afa0611ce80d1b7f02629c"),
}
_CIFAR10_URLS = ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",)
_CIFAR10_ARCHIVE = ("cifar-10-python.tar.gz", ("md5", "c58f30108f718f92721af3b95e74349a"))
#: folder of the CIFAR-10 "python" batches, inside the archive and under a data root
CIFAR10_DIR = "cifar-10-batches-py"
_CIFAR10_FILES = {
    "data_batch_1": ("md5", "c99cafc152244af753f735de768cd75f"),
    "data_batch_2": ("md5", "d4bba439e000b95fd0a9bffe97cbabec"),
    "data_batch_3": ("md5", "54ebc095f3ab1f0389bbae665268c751"),
    "data_batch_4": ("md5", "634d18415352ddfa80567beed471001a"),
    "data_batch_5": ("md5", "482c414d41f54cd18b22e5b47cb7c3cb"),
    "test_batch": ("md5", "40351d587109b95175f43aff81a1287e"),
}


def file_digest(path: str | os.PathLike, algorithm: str = "sha256") -> str:
    """Hex digest of a file (``algorithm`` is any hashlib name, e.g. "sha256", "md5").

    Example::

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "cifar-10-python.tar.gz")
        >>> with open(path, "wb") as f:
        ...     _ = f.write(b"abc")
        >>> file_digest(path, "md5")     # the real archive: 'c58f30108f718f92721af3b95e74349a'
        '900150983cd24fb0d6963f7d28e17f72'
    """
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_file(
    urls: str | Sequence[str],
    dest: str | os.PathLike,
    checksum: tuple[str, str],
    *,
    timeout_s: float = 60.0,
) -> Path:
    """Download ``dest`` from the first of ``urls`` that answers and verify its checksum.

    ``checksum`` is ``(algorithm, hexdigest)``, e.g. ``("md5", "c58f...")`` or ``("sha256", ...)``.
    The bytes go to a temporary file beside ``dest`` that is renamed onto ``dest`` only once the
    checksum matches, so ``dest`` is never partial. A mismatch raises ``ValueError`` (nothing is
    left behind); no mirror reachable raises ``ConnectionError`` saying how to place the file by
    hand. An existing ``dest`` with the right checksum is kept without downloading.

    Example::

        download_file("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                      "data/cifar-10-python.tar.gz", ("md5", "c58f30108f718f92721af3b95e74349a"))
    """
    algorithm, expected = checksum[0], checksum[1].lower()
    hashlib.new(algorithm)  # unknown algorithm -> ValueError now, before any download
    dest = Path(dest)
    if dest.is_file() and file_digest(dest, algorithm) == expected:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    urls = [urls] if isinstance(urls, str) else list(urls)
    errors = []
    for url in urls:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        tmp = Path(tmp_name)
        try:
            h = hashlib.new(algorithm)
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout_s) as resp:
                for block in iter(lambda resp=resp: resp.read(1 << 20), b""):
                    h.update(block)
                    out.write(block)
            got = h.hexdigest()
            if got != expected:
                raise ValueError(
                    f"checksum mismatch for {url}: {algorithm} {got}, expected {expected}; "
                    f"the download is corrupt or the file changed upstream - {dest} was not written"
                )
            os.replace(tmp, dest)
            return dest
        except (urllib.error.URLError, OSError) as e:
            errors.append(f"{url}: {e}")
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    raise ConnectionError(
        f"could not download {dest.name} (offline?): "
        + "; ".join(errors)
        + f". Copy the official file to {dest} by hand and call again."
    )


def _safe_extract(archive: Path, into: Path) -> None:
    with tarfile.open(archive, "r:gz") as tar:
        for m in tar.getmembers():
            target = (into / m.name).resolve()
            if not (m.isfile() or m.isdir()) or not str(target).startswith(
                str(into.resolve()) + os.sep
            ):
                raise ValueError(f"{archive}: refusing to extract unexpected member {m.name!r}")
        # members checked above: plain files and folders inside `into`; the "data" filter (Python
        # >= 3.11.4) checks again and drops permissions and owners from the archive
        if hasattr(tarfile, "data_filter"):
            tar.extractall(into, filter="data")
        else:  # pragma: no cover - older Pythons
            tar.extractall(into)


def _cifar10_checksums(
    root: Path,
) -> tuple[tuple[str, tuple[str, str]], dict[str, tuple[str, str]]]:
    """The CIFAR-10 archive's name and checksum and every batch's checksum that :func:`fetch`
    verifies in ``root``: the published ones, or, for the folder a running rehearsal wrote its
    generated stand-in to, the stand-in's (:func:`pipecomm.lab.standin.checksums`; never for
    any other folder).

    Example::

        >>> (archive, (algo, digest)), files = _cifar10_checksums(Path("data"))
        >>> archive, algo, digest, len(files)
        ('cifar-10-python.tar.gz', 'md5', 'c58f30108f718f92721af3b95e74349a', 6)
    """
    from pipecomm.lab import standin

    stand_in = standin.checksums("cifar10", root)
    if stand_in is None:
        return _CIFAR10_ARCHIVE, _CIFAR10_FILES
    name, (algo, digest) = stand_in["archive"]
    return (name, (algo, digest)), {f: (a, d) for f, (a, d) in stand_in["files"].items()}


def fetch(name: str, root: str | os.PathLike, *, timeout_s: float = 60.0) -> Path:
    """Download an official data set into ``root`` and verify it (network needed; never implicit).

    ``"mnist"``: the four IDX ``.gz`` files into ``root/mnist``. ``"cifar10"``: the python
    archive into ``root``, its md5 checked, extracted to ``root/cifar-10-batches-py`` (through a
    temporary folder renamed into place) and every batch's md5 checked. Files already present
    with the right checksum are not downloaded again. "digits" and "pydoc" ship with the
    installed packages and "teacher" is generated by code: they need no fetch. Returns the folder holding the files.

    Example::

        fetch("cifar10", "~/data"); X, y = load_dataset("cifar10", root="~/data")
    """
    root = Path(root).expanduser()
    if name == "mnist":
        folder = root / "mnist"
        for fname, checksum in _MNIST_FILES.items():
            download_file(
                [m + fname for m in _MNIST_MIRRORS], folder / fname, checksum, timeout_s=timeout_s
            )
        return folder
    if name == "cifar10":
        folder = root / CIFAR10_DIR
        (archive_name, checksum), members = _cifar10_checksums(root)
        if folder.is_dir() and all(
            (folder / f).is_file() and file_digest(folder / f, algo) == digest
            for f, (algo, digest) in members.items()
        ):
            return folder
        archive = download_file(_CIFAR10_URLS, root / archive_name, checksum, timeout_s=timeout_s)
        tmp = Path(tempfile.mkdtemp(prefix=".cifar10.", dir=root))
        try:
            _safe_extract(archive, tmp)
            extracted = tmp / CIFAR10_DIR
            for f, (algo, digest) in members.items():
                if not (extracted / f).is_file() or file_digest(extracted / f, algo) != digest:
                    raise ValueError(f"{archive}: member {f} missing or has the wrong {algo}")
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(extracted, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return folder
    if name in ("digits", "teacher", "pydoc"):
        raise ValueError(f"{name!r} ships with the installed packages; there is nothing to fetch")
    raise ValueError(f"unknown data set name {name!r}; fetch supports 'mnist' and 'cifar10'")
