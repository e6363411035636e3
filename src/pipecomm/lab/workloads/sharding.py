"""Sharding over ranks: a deterministic, disjoint, equal-sized split of a data set per epoch.

The data-parallel setting of all four papers: every rank computes the same permutation from
``(seed, epoch)`` (:func:`mix_seed`), so no communication is needed; :func:`batches` iterates a
shard in minibatches.

Example::

    >>> from pipecomm.lab.workloads.sharding import batches, shard
    >>> X, y = torch.randn(100, 1, 8, 8), torch.randint(0, 10, (100,))
    >>> idx = shard(len(X), rank=0, world_size=4, seed=0, epoch=0)
    >>> for xb, yb in batches(X, y, idx, batch_size=8, seed=0, epoch=0):
    ...     print(tuple(xb.shape), tuple(yb.shape))
    (8, 1, 8, 8) (8,)
    (8, 1, 8, 8) (8,)
    (8, 1, 8, 8) (8,)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch

__all__ = ["batches", "mix_seed", "shard"]


def mix_seed(seed: int, salt: int) -> int:
    """A 63-bit generator seed from (seed, salt), distinct for distinct pairs in practice.

    Example::

        >>> g = torch.Generator().manual_seed(mix_seed(0, 3))   # the permutation of seed 0, epoch 3
        >>> mix_seed(0, 3) == mix_seed(0, 3) != mix_seed(0, 4)
        True
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    h = hashlib.sha256(f"{seed}:{salt}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def shard(n: int, rank: int, world_size: int, seed: int, epoch: int = 0) -> torch.Tensor:
    """Indices of the samples ``rank`` trains on in ``epoch``: int64 ``[n // world_size]``.

    One permutation of ``range(n)``, fixed by ``(seed, epoch)``, is cut into ``world_size`` equal
    contiguous pieces; the last ``n % world_size`` samples of the permutation are dropped that
    epoch (a different few each epoch). Shards are disjoint and together cover all but that
    remainder; every rank computes the same permutation, so no communication is needed.

    Example::

        >>> idx = shard(1437, rank=2, world_size=4, seed=0, epoch=3)
        >>> len(idx)
        359
    """
    for arg, v in (("n", n), ("rank", rank), ("world_size", world_size), ("epoch", epoch)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{arg} must be an int, got {type(v).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if n < world_size:
        raise ValueError(f"n = {n} samples cannot give each of {world_size} ranks at least one")
    per = n // world_size
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(mix_seed(seed, epoch)))
    return perm[rank * per : (rank + 1) * per].clone()


def batches(
    X: torch.Tensor,
    y: torch.Tensor,
    indices: torch.Tensor,
    batch_size: int,
    seed: int,
    epoch: int = 0,
    *,
    drop_last: bool = True,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Minibatches ``(X[b], y[b])`` over ``indices`` in an order shuffled by ``(seed, epoch)``.

    With ``drop_last`` (default) every batch has exactly ``batch_size`` samples, so ranks with
    equal shards take equal numbers of steps.

    Example::

        >>> model, loss_fn = torch.nn.Linear(4, 3), torch.nn.functional.cross_entropy
        >>> X, y = torch.randn(100, 4), torch.randint(0, 3, (100,))
        >>> rank, p, seed, epoch = 0, 2, 0, 0
        >>> for xb, yb in batches(X, y, shard(len(X), rank, p, seed, epoch), 32, seed, epoch):
        ...     loss_fn(model(xb), yb).backward()
        >>> model.weight.grad.shape
        torch.Size([3, 4])
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(X) != len(y):
        raise ValueError(f"X has {len(X)} samples but y has {len(y)}")
    indices = torch.as_tensor(indices, dtype=torch.int64)
    order = torch.randperm(
        len(indices), generator=torch.Generator().manual_seed(mix_seed(seed, ~epoch))
    )
    indices = indices[order]
    stop = len(indices) - len(indices) % batch_size if drop_last else len(indices)
    for start in range(0, stop, batch_size):
        b = indices[start : start + batch_size]
        yield X[b], y[b]
