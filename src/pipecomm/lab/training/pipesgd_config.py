"""What a Pipe-SGD-family training run is (E5-E9): the experiments' shared parameters, the
training configuration a rank receives, and the method names.

Papers: BSP-SGD of the LP paper (Wang, Wu, Bosilca, Vuduc, Xu, arXiv 1611.04255), Pipe-SGD (Li,
Mao, Ding, Zhang, NeurIPS 2018: ``T_sync = C + M + U``, ``T_pipe = max(C + U, M)``), layer-wise
and delayed gradient descent (Daily et al. 2017), all through :class:`pipecomm.pipesgd.PipeSGD`.

* **Parameters.** One chain of bases, each adding a group of fields with its checks:
  :class:`TrainingParams` (E5's base) -> :class:`CalibratedParams` (E6's) ->
  :class:`CalibratedPoolParams` (E8's) -> :class:`ConvergenceParams` (E7's and E9's). E5's pool,
  which has no compute-timing run, declares the pool's fields itself and checks them with the same
  :func:`check_pool_backend` and :func:`check_pool` (which experiment uses which:
  docs/experiments.md, "pipesgd_config and pipesgd_training: the Pipe-SGD family in detail").

* **Configuration.** :class:`TrainConfig` is what a rank trains from, valid by construction;
  :func:`config` makes one from an experiment's parameters, ``dataclasses.replace`` a variant.

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
    >>> cfg.method, cfg.seed, cfg.model
    ('pipe+int8', 1, 'cnn')
"""

from __future__ import annotations

import copy
import dataclasses
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
    "CalibratedParams",
    "CalibratedPoolParams",
    "ConvergenceParams",
    "TrainConfig",
    "TrainingParams",
    "check_pool",
    "check_pool_backend",
    "config",
    "lr_scale",
    "parse_method",
    "parse_methods",
]

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


def _cnn_kw() -> dict[str, Any]:
    return {"channels": [64, 128], "hidden": 256}


@dataclass(frozen=True)
class TrainConfig:
    """A training configuration: what every rank of a run trains from (pickled to the ranks).

    Valid by construction: a bad value is a ValueError naming the setting. ``model_kw`` is a copy
    of the dict given, so the configuration never shares it with the experiment's parameters.

    Example::

        >>> import dataclasses
        >>> cfg = TrainConfig(method="pipe", iterations=5)
        >>> cfg.iterations, dataclasses.replace(cfg, seed=2).seed
        (5, 2)
        >>> TrainConfig(batch_size=0)
        Traceback (most recent call last):
        ValueError: batch_size must be a positive int, got 0
    """

    model: str = "cnn"
    model_kw: dict[str, Any] = field(default_factory=_cnn_kw)
    dataset: str = "digits"
    data_root: str | None = None
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    seed: int = 0
    data_seed: int = 0
    iterations: int = 20
    method: str = "sync"
    algorithm: str = "ring"
    bucket_mb: float = 25.0
    eval_every: int = 0
    evaluate: bool = True
    eval_part: str = "all"
    barrier_before_step: bool = False
    switch_interval_s: float = 0.005

    def __post_init__(self) -> None:
        parse_method(self.method)
        for key in ("evaluate", "barrier_before_step"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be True or False, got {getattr(self, key)!r}")
        for key in ("batch_size", "iterations"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} must be a positive int, got {v!r}")
        v = self.eval_every
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"eval_every must be an int >= 0 (0: final only), got {v!r}")
        v = self.switch_interval_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise ValueError(f"switch_interval_s must be in (0, 1] seconds, got {v!r}")
        for key in ("lr", "momentum"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{key} must be a finite number >= 0, got {v!r}")
        if self.eval_part not in HELDOUT_PARTS:
            raise ValueError(f"eval_part must be one of {HELDOUT_PARTS}, got {self.eval_part!r}")
        schedules.check(self.schedule, self.iterations, self.warmup_steps, self.min_lr_ratio)
        if self.model not in models.MODELS:
            raise ValueError(f"model must be one of {tuple(models.MODELS)}, got {self.model!r}")
        if not isinstance(self.model_kw, dict):
            raise ValueError(
                f"model_kw must be a dict of constructor arguments, got {self.model_kw!r}"
            )
        if self.dataset not in data.DATASETS:
            raise ValueError(f"dataset must be one of {data.DATASETS}, got {self.dataset!r}")
        if self.dataset not in data.OFFLINE_DATASETS and not isinstance(self.data_root, str):
            raise ValueError(
                f"dataset={self.dataset!r} needs data_root, the folder for the official files "
                "(fetched there once, checksums verified; 'digits' ships with scikit-learn, "
                "'teacher' is generated by code)"
            )
        object.__setattr__(self, "model_kw", copy.deepcopy(self.model_kw))

    def asdict(self) -> dict[str, Any]:
        """The settings as a plain dict (the key of a resumable run, :class:`pipecomm.lab.results.Runs`).

        Example::

            >>> TrainConfig(seed=3).asdict()["seed"]
            3
        """
        return dataclasses.asdict(self)


def config(params: experiment.Params, **overrides: Any) -> TrainConfig:
    """A training configuration: :class:`TrainConfig`'s defaults, then the experiment's
    parameters of the same names, then ``overrides`` (the per-run choices: method, seed, ...);
    an override that is no setting is a ValueError naming it.

    Example::

        >>> from pipecomm.lab.experiments.e05_bsp_sgd import Params
        >>> params = Params.make()
        >>> cfg = config(params, seed=1, method="pipe")
        >>> cfg.method, cfg.seed
        ('pipe', 1)
    """
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ValueError(f"unknown training setting(s) {unknown}; known: {sorted(names)}")
    given = params.asdict()
    return TrainConfig(**{**{k: given[k] for k in names if k in given}, **overrides})


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


def check_pool_backend(params: experiment.Params) -> None:
    """The pool checks a ``validate()`` runs first (before its base's): ``params.network`` is a
    network kind, ``"shaped"`` only with gloo, and ``params.backend`` gloo or nccl
    (:func:`pipecomm.lab.cli.check_backend`); under torchrun only nccl: the gloo design needs
    the emulated network of local ranks.

    Example::

        >>> import types
        >>> check_pool_backend(types.SimpleNamespace(network="shaped", backend="nccl", world_size=2))
        Traceback (most recent call last):
        ValueError: parameter network='shaped': 'shaped' runs gloo ranks: use backend='gloo'
    """
    from pipecomm.lab.cli import check_backend

    check_network_kind(params.network)
    require(params.network == "emulated" or params.backend == "gloo", "network", params.network,
            "'shaped' runs gloo ranks: use backend='gloo'")
    check_backend(params.backend, params.world_size, emulated=False)
    if launch.under_torchrun() and params.backend != "nccl":
        raise ValueError(
            "under torchrun this experiment runs with backend='nccl' (the real network); its "
            "gloo design needs the emulated network of local ranks: run it without torchrun"
        )


def check_pool(params: experiment.Params, bandwidth_optional: bool) -> None:
    """The pool checks a ``validate()`` runs after its base's: one pool of ``world_size >= 2``
    ranks, each training ``batch_size`` images of ``dataset`` per step, on a network of
    ``bandwidth_Bps > 0`` (or None where ``bandwidth_optional``: chosen from ``comm_ratio``).

    Example::

        >>> import types
        >>> pool = types.SimpleNamespace(world_size=2, batch_size=32, bandwidth_Bps=None,
        ...                              dataset="digits")
        >>> check_pool(pool, bandwidth_optional=True)
        >>> check_pool(pool, bandwidth_optional=False)
        Traceback (most recent call last):
        ValueError: parameter bandwidth_Bps=None: must be a finite number > 0
    """
    positive_int(params, "world_size", "batch_size")
    require(params.world_size >= 2, "world_size", params.world_size, "needs >= 2 ranks")
    bw = params.bandwidth_Bps
    if bandwidth_optional:
        require(
            bw is None or (isinstance(bw, (int, float)) and bw > 0),
            "bandwidth_Bps",
            bw,
            "must be None (chosen from comm_ratio) or > 0",
        )
    else:
        positive_float(params, "bandwidth_Bps")
    require(params.dataset in data.DATASETS, "dataset", params.dataset,
            f"must be one of {data.DATASETS}")
    check_batch_size(params.batch_size, params.world_size, params.dataset)


@dataclass(frozen=True)
class CalibratedPoolParams(CalibratedParams):
    """A training experiment on one pool of ``world_size`` ranks after a compute-timing run (E7-E9):
    ``backend`` ``"gloo"`` (CPU ranks on a network of ``bandwidth_Bps``: emulated, or with
    ``network="shaped"`` a virtual cluster of one rank per node on Linux tc tbf links, whose
    calibrated link then replaces ``alpha_s`` in the model) or ``"nccl"`` (one GPU per rank, the
    real interconnect; ``alpha_s``, ``bandwidth_Bps``, ``ports`` and ``comm_ratio`` are then
    unused), each rank training ``batch_size`` images of ``dataset`` per step. The emulated
    bandwidth is chosen after the compute-timing run so that the cost model's AllReduce takes
    ``comm_ratio`` x (C + U), unless ``bandwidth_Bps`` is given
    (:func:`pipecomm.lab.networks.kinds.network_for`)."""

    world_size: int = 2
    batch_size: int = 64
    bandwidth_Bps: float | None = None
    backend: str = "gloo"
    dataset: str = "digits"
    data_root: str | None = None
    network: str = "emulated"  # "emulated" or "shaped" (network.ranks_on; gloo only)
    comm_ratio: float = 1.0

    def validate(self) -> None:
        check_pool_backend(self)
        super().validate()
        check_pool(self, bandwidth_optional=True)
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
