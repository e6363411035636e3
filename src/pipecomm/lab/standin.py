"""The stand-ins a rehearsal of the gpu profile puts in place of what this machine lacks.

A rehearsal (:mod:`pipecomm.lab.rehearsal`, ``./run_all.sh --profile gpu --rehearse``) runs the
gpu profile's experiments on CPUs. It keeps their NCCL code paths (``backend="nccl"``: no
emulated network, E0's calibrated link, the ``real`` network label) and replaces three things
underneath them, only while the environment variable :data:`ENV` is set (the orchestrator sets
it for its notebooks and their ranks, and for nothing else):

* an NCCL rank pool starts gloo ranks on the CPU (:func:`process_backend`; each rank's device
  is then the CPU, :func:`pipecomm.lab.networks.launch.device`);
* :data:`GPUS` stand-in GPUs are visible (:func:`gpu_count`), so a pool of up to that many NCCL
  ranks may start;
* a data set's published checksums are replaced by those of the generated stand-in written to
  the rehearsal's data folder (:func:`checksums`), and only for that folder: the real data
  folder is always checked against the published ones.

Without :data:`ENV` every function here says "no stand-in" and the lab runs as it always does.

Example::

    >>> import os
    >>> from pipecomm.lab import standin
    >>> os.environ.pop(standin.ENV, None) and None
    >>> standin.active(), standin.process_backend("nccl"), standin.gpu_count()
    (False, 'nccl', None)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["ENV", "GPUS", "active", "checksums", "gpu_count", "manifest", "process_backend"]

#: Set (to the path of the rehearsal's ``rehearsal.json``) while a rehearsal runs.
ENV = "PIPECOMM_REHEARSAL"
#: Stand-in GPUs a rehearsal makes visible: its NCCL pools are gloo pools of at most this many
#: ranks, and the rehearsal caps every world size to it -- the most ranks the cpu profile runs on
#: 2 cores (its E3 aside), and the gpu profile's largest world size.
GPUS = 8


def active() -> bool:
    """Whether a rehearsal runs in this process (:data:`ENV` is set).

    Example::

        >>> import os
        >>> os.environ.pop(ENV, None) and None
        >>> active()
        False
    """
    return bool(os.environ.get(ENV))


def manifest() -> dict[str, Any]:
    """The rehearsal's record of its stand-ins (the JSON file :data:`ENV` names): ``{}`` without
    a rehearsal or before the file is written.

    Example::

        manifest().get("datasets", {}).get("cifar10", {}).get("root")   # the stand-in's folder
    """
    path = os.environ.get(ENV)
    if not path:
        return {}
    try:
        found = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def process_backend(backend: str) -> str:
    """The process group a rank pool asked for ``backend`` starts: ``"gloo"`` for ``"nccl"``
    while a rehearsal runs, else ``backend`` itself.

    Example::

        >>> import os
        >>> os.environ.pop(ENV, None) and None
        >>> process_backend("nccl")
        'nccl'
    """
    return "gloo" if backend == "nccl" and active() else backend


def gpu_count() -> int | None:
    """The GPUs a rehearsal makes visible (:data:`GPUS`), or None when no rehearsal runs (then
    torch's count is the truth).

    Example::

        >>> import os
        >>> os.environ.pop(ENV, None) and None
        >>> gpu_count() is None
        True
    """
    return GPUS if active() else None


def checksums(name: str, root: str | os.PathLike) -> dict[str, Any] | None:
    """The checksums of the stand-in for data set ``name`` when ``root`` is the folder a running
    rehearsal wrote it to: ``{"archive": [file, [algorithm, digest]], "files": {member:
    [algorithm, digest]}}``; None otherwise (the published checksums apply).

    Example::

        checksums("cifar10", "results/gpu-rehearsal/data")   # during a rehearsal
        # {'archive': ['cifar-10-python.tar.gz', ['md5', '...']], 'files': {'data_batch_1': ...}}
    """
    entry = manifest().get("datasets", {}).get(name)
    if not isinstance(entry, dict) or "root" not in entry:
        return None
    try:
        same = Path(root).expanduser().resolve() == Path(entry["root"]).resolve()
    except (OSError, TypeError):
        return None
    return {"archive": entry["archive"], "files": entry["files"]} if same else None
