"""The workloads the training experiments run: models, tasks and their batch streams.

No paper equation of its own. Three workloads:

* **Image classification** (E5-E9, and E13's digits task): :mod:`pipecomm.lab.workloads.models` classifiers on
  :mod:`pipecomm.lab.workloads.data` images (scikit-learn's 8x8 digits and the generated 8x8 teacher task offline; MNIST / CIFAR-10 of the gpu
  profile), each rank reading its own shard epoch after epoch (:func:`batch_stream`), evaluated
  on the held-out split (:func:`evaluate`). A training configuration
  (:class:`~pipecomm.lab.training.pipesgd_config.TrainConfig`) names it: ``model``,
  ``model_kw``, ``dataset``, ``data_root``, ``data_seed``, ``seed``, ``batch_size``.
* **Tasks of the DAdam experiments** (E10, E13): :data:`TASK_MODELS`, an MLP on the digits and a
  character-level transformer on the pydoc corpus (:func:`corpus`).
* **The timing workload** (E11, E12): :class:`TimingNet`, bias-free ``width x width`` linear layers
  on synthetic inputs, each followed by :class:`EmulatedCompute`, which sleeps a configured time
  in forward and in backward. Eight ranks on two cores cannot compute in parallel, so the cpu
  profile emulates the compute of an accelerator the way it emulates the network: the sleeps
  release the core, every rank "computes" at once, and a per-rank, per-iteration factor injects
  varying compute times (the DAdam paper's third factor; Wang, Zhang, Wu, Johansson, ICLR 2025).

Gradient buckets (:func:`bucket_layout`) follow
:class:`~pipecomm.decentralized.DecentralizedDataParallel`'s rule, so the runtime model sees the
buckets the trainers communicate.

Example::

    >>> from pipecomm.lab.training.pipesgd_config import TrainConfig
    >>> cfg = TrainConfig(model="mlp", model_kw={"hidden": [64]}, dataset="digits", batch_size=32)
    >>> model, batches = build_model(cfg), batch_stream(cfg, rank=0, world=2)
    >>> x, y = next(batches)
    >>> model(x).shape
    torch.Size([32, 10])
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipecomm.bucketing import bucket_indices, bucket_nbytes
from pipecomm.lab.checks import require
from pipecomm.lab.experiment import Params
from pipecomm.lab.workloads import data, models

__all__ = [
    "TASK_BUCKET_MB",
    "TASK_MODELS",
    "EmulatedCompute",
    "ImageConfig",
    "TimingNet",
    "batch_stream",
    "bucket_bytes_forward",
    "bucket_layout",
    "build_model",
    "build_task_model",
    "build_timing_net",
    "check_batch_size",
    "check_world",
    "corpus",
    "data_dir",
    "dataset",
    "evaluate",
    "fetch_data",
    "gradient_bytes",
    "heldout",
    "timing_bucket_mb",
    "timing_spec",
    "workload_bucket_bytes",
]

# --------------------------------------------------------------------------- image classification


class ImageConfig(Protocol):
    """What the image-classification workload reads of a training configuration (a
    :class:`pipecomm.lab.training.pipesgd_config.TrainConfig`).

    Example::

        >>> from pipecomm.lab.training.pipesgd_config import TrainConfig
        >>> cfg: ImageConfig = TrainConfig(model="mlp", model_kw={"hidden": [64]})
        >>> cfg.dataset, cfg.batch_size, cfg.eval_part
        ('digits', 64, 'all')
    """

    model: str
    model_kw: dict[str, Any]
    dataset: str
    data_root: str | None
    data_seed: int
    seed: int
    batch_size: int
    eval_part: str


def data_dir(root: str | None) -> str | None:
    """Where a ``data_root`` parameter points: a relative folder is relative to the repository
    (``data`` is the repository's ``data/``, as ``run_all.sh`` and the result checks of
    :func:`pipecomm.lab.reuse.inputs` read it), whatever the working directory of the process
    that reads it (a notebook's kernel runs in ``notebooks/``, its ranks too); an absolute one,
    or None, as it is.

    Example::

        >>> from pipecomm.lab.results import REPO_ROOT
        >>> data_dir("data") == str(REPO_ROOT / "data"), data_dir(None)
        (True, None)
    """
    from pipecomm.lab.results import REPO_ROOT

    if not isinstance(root, str) or not root:
        return root
    path = Path(root).expanduser()
    return str(path if path.is_absolute() else REPO_ROOT / path)


@functools.lru_cache(maxsize=4)
def dataset(
    name: str, split: str, seed: int, root: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)`` of a :mod:`pipecomm.lab.workloads.data` split, loaded once per process
    (``root``: a ``data_root``, :func:`data_dir`).

    Example::

        >>> X, y = dataset("digits", "train", 0)
        >>> X.shape
        torch.Size([1438, 1, 8, 8])
    """
    return data.load_dataset(name, split=split, seed=seed, root=data_dir(root))


# Official training-split sizes and image shapes (channels, side), known without the files.
_TRAIN_SIZES = {"mnist": 60_000, "cifar10": 50_000}
_IMAGE_SHAPES = {"mnist": (1, 28), "cifar10": (3, 32)}


def build_model(cfg: ImageConfig) -> torch.nn.Module:
    """The configuration's model, initialised from ``torch.manual_seed(cfg.seed)``.

    Example::

        >>> from pipecomm.lab.training.pipesgd_config import TrainConfig
        >>> model = build_model(TrainConfig(model="mlp", model_kw={"hidden": [64]}))
        >>> type(model).__name__
        'MLP'
    """
    torch.manual_seed(cfg.seed)
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.model_kw.items()}
    if cfg.dataset in _IMAGE_SHAPES:
        channels, size = _IMAGE_SHAPES[cfg.dataset]
    else:
        x, _ = dataset(cfg.dataset, "train", cfg.data_seed, cfg.data_root)
        channels, size = x.shape[1], x.shape[2]
    return models.get_model(cfg.model, in_channels=channels, image_size=size, **kw)


def gradient_bytes(cfg: ImageConfig) -> int:
    """Bytes of one rank's flattened gradient (what every AllReduce of the run moves).

    Example::

        >>> from pipecomm.lab.training.pipesgd_config import TrainConfig
        >>> gradient_bytes(TrainConfig())      # the default CNN's float32 parameters
        833576
    """
    return models.param_bytes(build_model(cfg))


def batch_stream(cfg: ImageConfig, rank: int, world: int) -> Iterator[tuple]:
    """Endless minibatches of this rank's shard of the training split, epoch after epoch
    (disjoint shards per epoch, deterministic per ``cfg.seed``).

    Example::

        >>> from pipecomm.lab.training.pipesgd_config import TrainConfig
        >>> cfg = TrainConfig(dataset="digits", batch_size=16)
        >>> rank, world = 1, 4
        >>> xb, yb = next(batch_stream(cfg, rank, world))
        >>> xb.shape, yb.shape
        (torch.Size([16, 1, 8, 8]), torch.Size([16]))
    """
    X, y = dataset(cfg.dataset, "train", cfg.data_seed, cfg.data_root)
    epoch = 0
    while True:
        idx = data.shard(len(X), rank, world, cfg.seed, epoch)
        if len(idx) < cfg.batch_size:
            raise ValueError(
                f"batch_size={cfg.batch_size} exceeds the {len(idx)} samples of a rank's shard"
            )
        yield from data.batches(X, y, idx, cfg.batch_size, cfg.seed, epoch)
        epoch += 1


#: The parts of a held-out split: all of it, or one of its two disjoint halves ("val" selects
#: learning rates, "test" decides the claims).
HELDOUT_PARTS = ("all", "val", "test")


def heldout(name: str, part: str = "all", seed: int = 0,
            root: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out split of data set ``name``, or one of its two disjoint halves (a fixed
    permutation cut in two): ``"val"`` for choosing learning rates, ``"test"`` for the claims.

    Example::

        >>> Xv, yv = heldout("digits", "val")        # about half of the 359 held-out images
        >>> len(Xv)
        179
    """
    if part not in HELDOUT_PARTS:
        raise ValueError(f"part must be one of {HELDOUT_PARTS}, got {part!r}")
    X, y = dataset(name, "test", seed, root)
    if part == "all":
        return X, y
    idx = torch.randperm(len(X), generator=torch.Generator().manual_seed(7))
    half = idx[: len(X) // 2] if part == "val" else idx[len(X) // 2 :]
    return X[half], y[half]


def evaluate(model: torch.nn.Module, cfg: ImageConfig) -> tuple[float, float]:
    """``(accuracy in percent, loss)`` of ``model`` on the configuration's held-out data
    (``cfg.eval_part`` of :func:`heldout`).

    Example::

        >>> from pipecomm.lab.training.pipesgd_config import TrainConfig
        >>> cfg = TrainConfig(model="mlp", model_kw={"hidden": [64]}, dataset="digits", batch_size=32)
        >>> model = build_model(cfg)
        >>> acc, loss = evaluate(model, cfg)            # untrained: about chance
        >>> round(acc, 1), round(loss, 2)
        (5.0, 2.35)
    """
    Xt, yt = heldout(cfg.dataset, cfg.eval_part, cfg.data_seed, cfg.data_root)
    device = next(model.parameters()).device
    Xt, yt = Xt.to(device), yt.to(device)
    with torch.no_grad():
        out = model(Xt)
        loss = F.cross_entropy(out, yt).item()
        acc = (out.argmax(1) == yt).double().mean().item() * 100.0
    return acc, loss


def fetch_data(params: Params) -> None:
    """Before any rank starts: fetch ``params.dataset`` into ``params.data_root`` (relative to the
    repository, :func:`data_dir`) unless it is there with the right checksums (:func:`pipecomm.lab.workloads.data.fetch`; network needed once). Nothing for
    "digits", which ships with scikit-learn, nor for "teacher", generated by code.

    Example::

        fetch_data(params)   # E5's or E7-E9's, e.g. dataset="cifar10", data_root="data"
    """
    if params.dataset not in data.OFFLINE_DATASETS:
        data.fetch(params.dataset, data_dir(params.data_root))


def check_batch_size(
    batch_size: int, world_size: int, dataset_name: str = "digits", name: str = "batch_size"
) -> None:
    """A rank's shard (``len(train) // world_size`` samples) must hold at least one batch.

    Example::

        >>> check_batch_size(64, 4)        # digits: 1438 // 4 = 359 samples per rank: fine
        >>> check_batch_size(512, 4)
        Traceback (most recent call last):
        ValueError: parameter batch_size=512: exceeds the 359 training samples of each of 4 ranks
    """
    n = _TRAIN_SIZES.get(dataset_name) or len(dataset(dataset_name, "train", 0)[0])
    per_rank = n // world_size
    require(
        batch_size <= per_rank,
        name,
        batch_size,
        f"exceeds the {per_rank} training samples of each of {world_size} ranks",
    )


# --------------------------------------------------------------------------- buckets


def bucket_layout(params: Sequence[torch.Tensor], bucket_mb: float) -> list[list[int]]:
    """Buckets of parameter indices, in backward order (parameters reversed), closed once they
    reach ``bucket_mb`` MiB -- the rule of :class:`~pipecomm.decentralized.DecentralizedDataParallel`
    for a model whose gradients become ready in reverse registration order.

    Example::

        >>> bucket_layout([torch.zeros(3), torch.zeros(5)], bucket_mb=1e-6)
        [[1], [0]]
    """
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
    return bucket_indices(params, bucket_mb * 2**20, order="reverse")


def bucket_bytes_forward(params: Sequence[torch.Tensor], bucket_mb: float) -> list[int]:
    """Bytes of every bucket of :func:`bucket_layout`, in *forward* order (the runtime model's).

    Example::

        >>> bucket_bytes_forward([torch.zeros(512, 512), torch.zeros(512, 512)], 1.0)   # TimingNet(512, 2, ...)
        [1048576, 1048576]
    """
    return bucket_nbytes(params, bucket_layout(params, bucket_mb))[::-1]


#: The models E13 trains (and E10 times the gossip of): name -> (pipecomm.lab.workloads.models name, keywords).

# --------------------------------------------------------------------------- DAdam tasks (E10, E13)

#: The models E13 trains (and E10 times the gossip of): name -> (pipecomm.lab.workloads.models name, keywords).
#: ``char_transformer`` also gets ``vocab_size`` from the pydoc corpus.
TASK_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp": ("mlp", {"in_channels": 1, "image_size": 8, "hidden": (64,)}),
    "char_transformer": (
        "char_transformer",
        {"block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 48},
    ),
}
#: Bucket size (MiB) of DecentralizedDataParallel in E13 (its default).
TASK_BUCKET_MB = 25.0


@functools.lru_cache(maxsize=1)
def corpus() -> Any:
    """The pydoc character corpus (built once per process)."""
    from pipecomm.lab.workloads import data

    return data.CharCorpus.from_name("pydoc")


def build_task_model(name: str, seed: int) -> nn.Module:
    """E13's model ``name`` (a key of :data:`TASK_MODELS`), initialised from ``seed``.

    Example::

        >>> lm = build_task_model("char_transformer", seed=0)
        >>> type(lm).__name__
        'CharTransformer'
    """
    from pipecomm.lab.workloads import models

    if name not in TASK_MODELS:
        raise ValueError(f"unknown task model {name!r}; choose one of {sorted(TASK_MODELS)}")
    arch, kw = TASK_MODELS[name]
    if arch == "char_transformer":
        kw = {**kw, "vocab_size": corpus().vocab_size}
    torch.manual_seed(seed)
    return models.get_model(arch, **kw)


# --------------------------------------------------------------------------- timing workload (E11, E12)

class _SleepFn(torch.autograd.Function):
    """Identity that sleeps ``fwd_s`` in forward and ``bwd_s`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        if fwd_s > 0:
            time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.bwd_s > 0:
            time.sleep(ctx.bwd_s)
        return grad, None, None


class EmulatedCompute(nn.Module):
    """Emulated accelerator compute: sleeps ``fwd_s * factor`` in forward and ``bwd_s * factor``
    in backward (the core is free meanwhile); the identity on its input.

    Example::

        >>> import time
        >>> layer = nn.Sequential(nn.Linear(512, 512, bias=False), EmulatedCompute(0.01, 0.02))
        >>> t0 = time.perf_counter(); y = layer(torch.ones(1, 512)); time.perf_counter() - t0 >= 0.01
        True
    """

    def __init__(self, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        if fwd_s < 0 or bwd_s < 0:
            raise ValueError(f"fwd_s and bwd_s must be >= 0 seconds, got {fwd_s}, {bwd_s}")
        self.fwd_s, self.bwd_s, self.factor = float(fwd_s), float(bwd_s), 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepFn.apply(x, self.fwd_s * self.factor, self.bwd_s * self.factor)


class TimingNet(nn.Module):
    """Timing workload: ``layers`` blocks of ``Linear(width, width, bias=False)`` followed by
    :class:`EmulatedCompute` (``fwd_s`` / ``bwd_s`` seconds per block), on synthetic inputs.

    Each block has exactly one parameter of ``4 width^2`` bytes, so with ``bucket_mb`` equal to
    that size every block is one communication bucket.

    Example::

        >>> net = TimingNet(width=512, layers=2, fwd_s=0.01, bwd_s=0.02)   # 2 buckets of 1 MiB
        >>> [p.numel() * 4 for p in net.parameters()]
        [1048576, 1048576]
        >>> net.set_factor(1.3)                                            # a slow iteration
    """

    def __init__(self, width: int, layers: int, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        if width < 1 or layers < 1:
            raise ValueError(f"width and layers must be >= 1, got {width}, {layers}")
        self.blocks = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(width, width, bias=False), EmulatedCompute(fwd_s, bwd_s))
                for _ in range(layers)
            ]
        )
        for blk in self.blocks:  # keep activations O(1) through the stack
            nn.init.orthogonal_(blk[0].weight)

    def set_factor(self, factor: float) -> None:
        """Scale every emulated compute time of the next iterations by ``factor``."""
        for m in self.modules():
            if isinstance(m, EmulatedCompute):
                m.factor = float(factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def timing_spec(p: int, **overrides: Any) -> dict[str, Any]:
    """A complete timing specification (the workload of E11/E12) with defaults.

    Keys: ``width``, ``layers``, ``batch``, ``fwd_ms``/``bwd_ms`` (emulated compute per layer),
    ``compute_scale`` (multiplies both), ``compute_cv`` (log-normal factor per rank and
    iteration, mean 1), ``seed``, ``kind`` (``"allreduce"`` or ``"decentralized"``),
    ``topology``, ``algorithm``, ``warmup``, ``blocks``, ``block_iters``, ``calib_iters``,
    ``ranks_per_node``, ``p``, ``overlap`` (False: E11's overlap ablation -- AllReduce after
    backward, DAdam waiting for its gossip before the next forward).

    Example::

        >>> spec = timing_spec(8, compute_scale=0.5, kind="allreduce")
        >>> spec["p"], spec["compute_scale"], spec["kind"]
        (8, 0.5, 'allreduce')
    """
    spec = {
        "p": p,
        "ranks_per_node": 2,
        "width": 512,
        "layers": 2,
        "batch": 8,
        "fwd_ms": 10.0,
        "bwd_ms": 20.0,
        "compute_scale": 1.0,
        "compute_cv": 0.0,
        "seed": 0,
        "kind": "allreduce",
        "topology": "alternating-exp-ring",
        "algorithm": "ring",
        "warmup": 3,
        "blocks": 3,
        "block_iters": 5,
        "calib_iters": 6,
        "lr": 1e-4,
        "overlap": True,
    }
    unknown = sorted(set(overrides) - set(spec))
    if unknown:
        raise ValueError(f"unknown timing parameters {unknown}; known: {sorted(spec)}")
    spec.update(overrides)
    return spec


def timing_bucket_mb(spec: Mapping[str, Any]) -> float:
    """Bucket size (MiB) that puts every :class:`TimingNet` layer in a bucket of its own.

    Example::

        >>> timing_bucket_mb(timing_spec(8))     # width 512
        1.0
    """
    return 4 * spec["width"] ** 2 / 2**20


def build_timing_net(spec: Mapping[str, Any]) -> TimingNet:
    """The specification's :class:`TimingNet`, initialised from ``torch.manual_seed(spec["seed"])``.

    Example::

        >>> net = build_timing_net(timing_spec(8, compute_scale=0.5))
        >>> len(net.blocks)
        2
    """
    s = spec["compute_scale"]
    torch.manual_seed(spec["seed"])
    return TimingNet(
        spec["width"], spec["layers"], spec["fwd_ms"] * s / 1e3, spec["bwd_ms"] * s / 1e3
    )


def check_world(spec: Mapping[str, Any]) -> int:
    """On a rank: the pool's world size, which must be the timing specification's ``p``."""
    p = dist.get_world_size()
    if p != spec["p"]:
        raise ValueError(f"spec is for p={spec['p']} ranks but the pool has {p}")
    return p


def workload_bucket_bytes(name: str) -> list[int]:
    """Bucket sizes (bytes, forward order) of a workload: ``"timing"`` (E11/E12's TimingNet,
    one bucket per layer) or a key of :data:`TASK_MODELS` (buckets of :data:`TASK_BUCKET_MB`).

    Example::

        >>> workload_bucket_bytes("timing")
        [1048576, 1048576]
    """
    if name == "timing":
        spec = timing_spec(2)
        return bucket_bytes_forward(list(build_timing_net(spec).parameters()), timing_bucket_mb(spec))
    model = build_task_model(name, 0)
    return bucket_bytes_forward([p for p in model.parameters() if p.requires_grad], TASK_BUCKET_MB)


