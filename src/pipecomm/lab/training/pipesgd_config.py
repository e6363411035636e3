"""What a Pipe-SGD-family training run is (E5-E9): the experiments' shared parameters, the
training configuration a rank receives, and the method names.

Papers: BSP-SGD of the LP paper (Wang, Wu, Bosilca, Vuduc, Xu, arXiv 1611.04255), Pipe-SGD (Li,
Mao, Ding, Zhang, NeurIPS 2018: ``T_sync = C + M + U``, ``T_pipe = max(C + U, M)``), layer-wise
and delayed gradient descent (Daily et al. 2017), all through :class:`pipecomm.pipesgd.PipeSGD`.

* **Parameters.** E5-E9's ``Params`` subclass :class:`TrainingParams`, :class:`CalibratedParams`,
  :class:`PoolParams`, :class:`CalibratedPoolParams` or :class:`ConvergenceParams`, which hold
  the fields they share with their checks (which experiment uses which: docs/experiments.md,
  "pipesgd_config and pipesgd_training: the Pipe-SGD family in detail").

* **Configuration.** :func:`config` turns an experiment's parameters into the dict a rank trains
  from (:data:`DEFAULT_CONFIG`'s keys), :func:`check_config` validates one.

* **Methods** (``method`` names): ``"nocomm"`` (local steps, no AllReduce: the no-communication
  bound of Daily et al.'s Figure 1), ``"sync"``, ``"layerwise"``, ``"pipe"`` (staleness 1),
  ``"delayed-1"``/``"delayed-2"`` (pipe with staleness 1 / 2), each optionally with ``"+fp16"``,
  ``"+bf16"`` or ``"+int8"`` compression inside the AllReduce, and optionally with ``"@4x"``: the
  configuration's learning rate times 4 (a stress configuration: staleness is known to hurt at
  large steps). The learning rate follows ``schedule`` (:mod:`pipecomm.lab.workloads.schedules`: constant, or
  linear warm-up then cosine decay).

Example::

    >>> @dataclass(frozen=True)
    ... class Params(CalibratedPoolParams):
    ...     methods: list[str] = field(default_factory=lambda: ["sync", "pipe"])
    >>> cfg = config(Params.make(), seed=1, method="pipe+int8")
    >>> cfg["method"], cfg["seed"], cfg["model"]
    ('pipe+int8', 1, 'cnn')
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pipecomm import vocab
from pipecomm.lab import experiment
from pipecomm.lab.checks import positive_float, positive_int, require
from pipecomm.lab.networks import cost, launch, netem
from pipecomm.lab.networks.kinds import check_network_kind
from pipecomm.lab.workloads import data, models, schedules
from pipecomm.lab.workloads.tasks import HELDOUT_PARTS, check_batch_size

__all__ = [
    "BASE_METHODS",
    "COMPRESSIONS",
    "DEFAULT_CONFIG",
    "CalibratedParams",
    "CalibratedPoolParams",
    "ConvergenceParams",
    "PoolParams",
    "TrainingParams",
    "check_config",
    "config",
    "lr_scale",
    "parse_method",
    "parse_methods",
]

#: Training configuration keys and their defaults (experiments override some).
DEFAULT_CONFIG: dict[str, Any] = {
    "model": "cnn",
    "model_kw": {"channels": [64, 128], "hidden": 256},
    "dataset": "digits",
    "data_root": None,
    "batch_size": 64,
    "lr": 0.01,
    "momentum": 0.0,
    "schedule": "constant",
    "warmup_steps": 0,
    "min_lr_ratio": 0.0,
    "seed": 0,
    "data_seed": 0,
    "iterations": 20,
    "method": "sync",
    "algorithm": "ring",
    "bucket_mb": 25.0,
    "eval_every": 0,
    "evaluate": True,
    "eval_part": "all",
    "barrier_before_step": False,
    "switch_interval_s": 0.005,
}

COMPRESSIONS = vocab.CODECS
BASE_METHODS = ("nocomm", "sync", "layerwise", "pipe", "delayed-1", "delayed-2")


def parse_method(method: str) -> tuple[str, int | None, str | None]:
    """``"pipe+int8"`` -> ``("pipe", 1, "int8")``: PipeSGD mode, staleness, compression.

    ``"nocomm"`` gives mode ``"nocomm"`` (no PipeSGD at all).

    Example::

        >>> parse_method("delayed-2"), parse_method("sync+fp16")
        (('pipe', 2, None), ('sync', None, 'fp16'))
    """
    if not isinstance(method, str):
        raise ValueError(f"method must be a string like 'pipe+int8', got {method!r}")
    lr_scale(method)
    base, _, codec = method.partition("@")[0].partition("+")
    if base not in BASE_METHODS:
        raise ValueError(f"method {method!r}: the part before '+' must be one of {BASE_METHODS}")
    if codec and codec not in COMPRESSIONS:
        raise ValueError(f"method {method!r}: compression after '+' must be one of {COMPRESSIONS}")
    if base == "nocomm" and codec:
        raise ValueError(f"method {method!r}: 'nocomm' does not communicate, so cannot compress")
    compression = codec or None
    if base == "nocomm":
        return "nocomm", None, None
    if base == "pipe":
        return "pipe", 1, compression
    if base.startswith("delayed-"):
        return "pipe", int(base.split("-")[1]), compression
    return base, None, compression


def lr_scale(method: str) -> float:
    """The learning-rate multiplier of a method name: ``"pipe@4x"`` -> 4.0, ``"pipe"`` -> 1.0.

    Example::

        >>> lr_scale("pipe+int8@0.5x"), lr_scale("sync")
        (0.5, 1.0)
    """
    _, at, scale = method.partition("@")
    if not at:
        return 1.0
    try:
        value = float(scale.removesuffix("x")) if scale.endswith("x") else math.nan
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"method {method!r}: the part after '@' must be a positive factor like '4x'")
    return value


def config(params: experiment.Params, **overrides: Any) -> dict[str, Any]:
    """A training configuration: :data:`DEFAULT_CONFIG`, then the experiment's parameters of the
    same names, then ``overrides`` (the per-run choices: method, seed, ...).

    Example::

        >>> from pipecomm.lab.experiments.e05_bsp_sgd import Params
        >>> params = Params.make()
        >>> cfg = config(params, seed=1, method="pipe")
        >>> cfg["method"], cfg["seed"]
        ('pipe', 1)
    """
    cfg = dict(DEFAULT_CONFIG)
    given = params.asdict()
    cfg.update({k: given[k] for k in DEFAULT_CONFIG if k in given})
    cfg["model_kw"] = dict(cfg["model_kw"])
    cfg.update(overrides)
    return cfg


def check_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Validate a training configuration (unknown keys and bad values are ValueErrors).

    Example::

        >>> cfg = check_config(dict(DEFAULT_CONFIG, method="pipe", iterations=5))
        >>> cfg["iterations"]
        5
    """
    unknown = sorted(set(cfg) - set(DEFAULT_CONFIG))
    if unknown:
        raise ValueError(f"unknown training setting(s) {unknown}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **cfg}
    parse_method(cfg["method"])
    for key in ("evaluate", "barrier_before_step"):
        if not isinstance(cfg[key], bool):
            raise ValueError(f"{key} must be True or False, got {cfg[key]!r}")
    for key in ("batch_size", "iterations"):
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key} must be a positive int, got {v!r}")
    if (
        isinstance(cfg["eval_every"], bool)
        or not isinstance(cfg["eval_every"], int)
        or cfg["eval_every"] < 0
    ):
        raise ValueError(
            f"eval_every must be an int >= 0 (0: final only), got {cfg['eval_every']!r}"
        )
    v = cfg["switch_interval_s"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise ValueError(f"switch_interval_s must be in (0, 1] seconds, got {v!r}")
    for key in ("lr", "momentum"):
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{key} must be a finite number >= 0, got {v!r}")
    if cfg["eval_part"] not in HELDOUT_PARTS:
        raise ValueError(f"eval_part must be one of {HELDOUT_PARTS}, got {cfg['eval_part']!r}")
    schedules.check(cfg["schedule"], cfg["iterations"], cfg["warmup_steps"], cfg["min_lr_ratio"])
    if cfg["model"] not in models.MODELS:
        raise ValueError(f"model must be one of {tuple(models.MODELS)}, got {cfg['model']!r}")
    if not isinstance(cfg["model_kw"], dict):
        raise ValueError(
            f"model_kw must be a dict of constructor arguments, got {cfg['model_kw']!r}"
        )
    if cfg["dataset"] not in data.DATASETS:
        raise ValueError(f"dataset must be one of {data.DATASETS}, got {cfg['dataset']!r}")
    if cfg["dataset"] != "digits" and not isinstance(cfg["data_root"], str):
        raise ValueError(
            f"dataset={cfg['dataset']!r} needs data_root, the folder for the official files "
            "(fetched there once, checksums verified; 'digits' ships with scikit-learn)"
        )
    return cfg


def parse_methods(methods: list[str]) -> list[tuple[str, int | None, str | None]]:
    """:func:`parse_method` of every entry of the ``methods`` parameter; a bad one is a
    ValueError naming the parameter.

    Example::

        >>> parse_methods(["sync", "pipe+int8"])
        [('sync', None, None), ('pipe', 1, 'int8')]
    """
    out = []
    for m in methods:
        try:
            out.append(parse_method(m))
        except ValueError as exc:
            raise ValueError(f"parameter methods={methods!r}: {exc}") from None
    return out


# --------------------------------------------------------------------------- parameters


def _cnn_kw() -> dict[str, Any]:
    return {"channels": [64, 128], "hidden": 256}


@dataclass(frozen=True)
class TrainingParams(experiment.Params):
    """Parameters every training experiment E5-E9 has: the model (a :mod:`pipecomm.lab.workloads.models`
    name and its keywords), the peak learning rate, the number of iterations and the first
    ``skip`` of them left out of the steady state, the emulated link's latency ``alpha_s`` and
    port model ``ports``, and the time limit of one rank run ``timeout_s``."""

    model: str = "cnn"
    model_kw: dict[str, Any] = field(default_factory=_cnn_kw)
    lr: float = 0.01
    iterations: int = 20
    skip: int = 5
    alpha_s: float = 0.001
    ports: str = "single"
    timeout_s: float = 600.0

    def validate(self) -> None:
        super().validate()
        positive_int(self, "iterations")
        require(
            0 <= self.skip < self.iterations,
            "skip",
            self.skip,
            f"must be in [0, iterations={self.iterations})",
        )
        positive_float(self, "alpha_s", "timeout_s")
        require(self.ports in netem.PORTS, "ports", self.ports, f"must be one of {netem.PORTS}")


@dataclass(frozen=True)
class CalibratedParams(TrainingParams):
    """A training experiment whose timing model takes ``C`` and ``U`` from a separate
    compute-timing run of ``calib_iters`` iterations (E6-E9), with the AllReduce ``algorithm``
    (one of :attr:`ALGORITHMS`) and the GIL switch interval of training (see
    :func:`pipecomm.lab.training.trainers.gil_switch_interval`)."""

    #: The algorithms the experiment accepts, and why (appended to the error).
    ALGORITHMS: ClassVar[tuple[str, ...]] = cost.ALGORITHMS
    ALGORITHMS_WHY: ClassVar[str] = ""

    algorithm: str = "ring"
    calib_iters: int = 8
    switch_interval_s: float = 0.0001

    def validate(self) -> None:
        super().validate()
        positive_int(self, "calib_iters")
        positive_float(self, "switch_interval_s")
        require(
            self.algorithm in self.ALGORITHMS,
            "algorithm",
            self.algorithm,
            f"must be one of {self.ALGORITHMS}{self.ALGORITHMS_WHY}",
        )


@dataclass(frozen=True)
class PoolParams(TrainingParams):
    """A training experiment on one pool of ``world_size`` ranks (E5, E7-E9): ``backend``
    ``"gloo"`` (CPU ranks on a network of ``bandwidth_Bps``: emulated, or with
    ``network="shaped"`` a virtual cluster of one rank per node on Linux tc tbf links, whose
    calibrated link then replaces ``alpha_s`` in the model) or ``"nccl"`` (one GPU per rank, the
    real interconnect; ``alpha_s``, ``bandwidth_Bps``, ``ports`` and ``comm_ratio`` are then
    unused), each rank training ``batch_size`` images of ``dataset`` per step."""

    #: Whether ``bandwidth_Bps=None`` is allowed (chosen from ``comm_ratio``).
    BANDWIDTH_OPTIONAL: ClassVar[bool] = False

    world_size: int = 2
    batch_size: int = 64
    bandwidth_Bps: float | None = None
    backend: str = "gloo"
    dataset: str = "digits"
    data_root: str | None = None
    network: str = "emulated"  # "emulated" or "shaped" (network.ranks_on; gloo only)

    def validate(self) -> None:
        check_network_kind(self.network)
        require(self.network == "emulated" or self.backend == "gloo", "network", self.network,
                "'shaped' runs gloo ranks: use backend='gloo'")
        _check_pool_backend(self.backend, self.world_size)
        super().validate()
        positive_int(self, "world_size", "batch_size")
        require(self.world_size >= 2, "world_size", self.world_size, "needs >= 2 ranks")
        bw = self.bandwidth_Bps
        if self.BANDWIDTH_OPTIONAL:
            require(
                bw is None or (isinstance(bw, (int, float)) and bw > 0),
                "bandwidth_Bps",
                bw,
                "must be None (chosen from comm_ratio) or > 0",
            )
        else:
            positive_float(self, "bandwidth_Bps")
        require(self.dataset in data.DATASETS, "dataset", self.dataset,
                f"must be one of {data.DATASETS}")
        check_batch_size(self.batch_size, self.world_size, self.dataset)


def _check_pool_backend(backend: Any, world_size: int) -> None:
    """gloo or nccl (:func:`pipecomm.lab.cli.check_backend`); under torchrun only nccl:
    the gloo design needs the emulated network of local ranks."""
    from pipecomm.lab.cli import check_backend

    check_backend(backend, world_size, emulated=False)
    if launch.under_torchrun() and backend != "nccl":
        raise ValueError(
            "under torchrun this experiment runs with backend='nccl' (the real network); its "
            "gloo design needs the emulated network of local ranks: run it without torchrun"
        )


@dataclass(frozen=True)
class CalibratedPoolParams(PoolParams, CalibratedParams):
    """A pool whose emulated bandwidth is chosen after the compute-timing run so that the cost
    model's AllReduce takes ``comm_ratio`` x (C + U), unless ``bandwidth_Bps`` is given (E7-E9;
    :func:`pipecomm.lab.networks.kinds.network_for`)."""

    BANDWIDTH_OPTIONAL: ClassVar[bool] = True

    comm_ratio: float = 1.0

    def validate(self) -> None:
        super().validate()
        positive_float(self, "comm_ratio")


@dataclass(frozen=True)
class ConvergenceParams(CalibratedPoolParams):
    """Convergence runs (E7, E9): every method from each of ``seeds`` (paired by seed), rank 0's
    held-out accuracy every ``eval_every`` iterations (0: final only), SGD with ``momentum`` and
    the learning-rate ``schedule`` (:mod:`pipecomm.lab.workloads.schedules`)."""

    seeds: list[int] = field(default_factory=lambda: [0])
    eval_every: int = 10
    momentum: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0

    def validate(self) -> None:
        super().validate()
        require(
            len(self.seeds) >= 1
            and all(isinstance(s, int) and not isinstance(s, bool) for s in self.seeds)
            and len(set(self.seeds)) == len(self.seeds),
            "seeds",
            self.seeds,
            "must be a non-empty list of distinct ints",
        )
        require(
            isinstance(self.eval_every, int) and 0 <= self.eval_every <= self.iterations,
            "eval_every",
            self.eval_every,
            "must be an int in [0, iterations]",
        )
