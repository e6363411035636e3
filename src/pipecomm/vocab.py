"""The names pipecomm's modules share: AllReduce algorithms, gradient codecs, training modes.

One concept: the vocabularies, defined once; the library and the lab import them from here.

* Algorithms — the AllReduce / Broadcast / Reduce schedules: ``"lp"`` (linear pipelining, Wang
  et al., "Efficient Communications in Training Large Scale Neural Networks", arXiv 1611.04255),
  the baselines ``"mst"`` (minimum spanning tree), ``"be"`` (bidirectional exchange) and
  ``"ring"`` of that paper's Table 1, and ``"torch"`` (the backend's built-in, which has no cost
  model and cannot run over the emulated network); :data:`DEFAULT_ALGORITHM` ``"auto"`` chooses
  one per call (:func:`pipecomm.collectives.builtin.choose`: fastest measured, else modelled).
* Codecs — Pipe-SGD's light-weight gradient compression (Li et al., NeurIPS 2018, Sec. 3.3):
  ``"fp16"``, ``"bf16"`` (16-bit truncation) and ``"int8"`` (8-bit quantization with per-chunk
  scales); only ``"lp"`` and ``"ring"`` carry them (compression happens inside their transfers).
* Modes — how PipeSGD overlaps the AllReduce with computation: ``"sync"`` (BSP-SGD),
  ``"layerwise"`` (per-bucket AllReduce from backward hooks) and ``"pipe"`` (Pipe-SGD / delayed
  GD with staleness k). The timing model adds ``"nocomm"`` (compute only) and ``"delayed"``.

Example::

    >>> from pipecomm import vocab
    >>> vocab.check_algorithm("mst")
    'mst'
    >>> vocab.check_compression("int8", algorithm="lp")
    'int8'
    >>> vocab.check_compression("int8", algorithm="mst")
    Traceback (most recent call last):
        ...
    ValueError: compression='int8' needs algorithm 'lp' or 'ring' (compression ...
"""

from __future__ import annotations

from typing import Any

__all__ = ["ALGORITHMS", "ALGORITHM_CHOICES", "AUTO", "BACKEND_NAME", "CODECS",
           "COMPRESSING_ALGORITHMS", "COMPRESSIONS", "DEFAULT_ALGORITHM", "MODELLED_ALGORITHMS",
           "MODES", "TIMING_MODES", "check_algorithm", "check_choice", "check_compression",
           "check_mode"]

#: The name of pipecomm's torch.distributed backend (:mod:`pipecomm.backend`).
BACKEND_NAME: str = "pipecomm"
#: Every algorithm :func:`pipecomm.collectives.allreduce` runs; ``"torch"`` stays last.
ALGORITHMS: tuple[str, ...] = ("lp", "mst", "be", "ring", "torch")
#: The algorithm argument that chooses one of :data:`ALGORITHMS` per call, and every value one takes.
AUTO: str = "auto"
ALGORITHM_CHOICES: tuple[str, ...] = (*ALGORITHMS, AUTO)
#: The algorithms with a cost model (:mod:`pipecomm.lab.networks.cost`); they run over the emulated network.
MODELLED_ALGORITHMS: tuple[str, ...] = ("lp", "mst", "be", "ring")
#: The algorithms that carry a codec (compression happens inside their transfers).
COMPRESSING_ALGORITHMS: tuple[str, ...] = ("lp", "ring")
#: The default wherever an algorithm is a default argument.
DEFAULT_ALGORITHM: str = AUTO

#: Gradient codecs by name (:func:`pipecomm.compress.get_codec`).
CODECS: tuple[str, ...] = ("fp16", "bf16", "int8")
#: The accepted values of a ``compression`` argument: no compression or a codec name.
COMPRESSIONS: tuple[str | None, ...] = (None, *CODECS)

#: PipeSGD's modes (:class:`pipecomm.pipesgd.PipeSGD`).
MODES: tuple[str, ...] = ("sync", "layerwise", "pipe")
#: The timing model's modes (:func:`pipecomm.lab.training.pipesgd_timing_model.iteration_time`): PipeSGD's, plus
#: ``"nocomm"`` (no communication) and ``"delayed"`` (delayed GD, the pipe with staleness k).
TIMING_MODES: tuple[str, ...] = ("nocomm", "sync", "layerwise", "pipe", "delayed")


def check_choice(name: str, value: Any, choices: tuple, *, where: str = "") -> Any:
    """Return ``value`` if it is one of ``choices`` (``None`` only by identity), else raise a
    ValueError that names the argument ``name`` (prefixed by ``where``, e.g. a function name).

    Example::

        >>> check_choice("mode", "pipe", MODES)
        'pipe'
        >>> check_choice("mode", "pipes", MODES)
        Traceback (most recent call last):
            ...
        ValueError: mode must be one of ('sync', 'layerwise', 'pipe'), got 'pipes'
    """
    if not any(value is c or (isinstance(value, str) and value == c) for c in choices):
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}{name} must be one of {choices}, got {value!r}")
    return value


def check_algorithm(algorithm: Any, *, allowed: tuple[str, ...] = ALGORITHMS,
                    name: str = "algorithm", where: str = "") -> str:
    """``algorithm`` if it is one of ``allowed`` (default: every algorithm), else a ValueError
    naming the argument.

    Example::

        >>> check_algorithm("be", allowed=MODELLED_ALGORITHMS)
        'be'
    """
    return check_choice(name, algorithm, allowed, where=where)


def check_compression(compression: Any, *, algorithm: str | None = None, name: str = "compression",
                      where: str = "") -> str | None:
    """``compression`` if it is None or a codec name that ``algorithm`` (when given) can carry,
    else a ValueError naming the argument.

    Example::

        >>> print(check_compression(None, algorithm="mst"))
        None
        >>> check_compression("fp16", algorithm="ring")
        'fp16'
    """
    check_choice(name, compression, COMPRESSIONS, where=where)
    if compression is not None and algorithm not in (None, AUTO, *COMPRESSING_ALGORITHMS):
        prefix = f"{where}: " if where else ""
        raise ValueError(
            f"{prefix}{name}={compression!r} needs algorithm 'lp' or 'ring' (compression "
            f"happens inside their transfers), got algorithm={algorithm!r}; pass "
            f"{name}=None or choose algorithm='lp'"
        )
    return compression


def check_mode(mode: Any, *, allowed: tuple[str, ...] = MODES, name: str = "mode",
               where: str = "") -> str:
    """``mode`` if it is one of ``allowed`` (default: PipeSGD's modes), else a ValueError naming
    the argument.

    Example::

        >>> check_mode("layerwise")
        'layerwise'
        >>> check_mode("delayed", allowed=TIMING_MODES)
        'delayed'
    """
    return check_choice(name, mode, allowed, where=where)
