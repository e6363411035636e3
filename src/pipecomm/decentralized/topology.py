"""Communication topologies for decentralized training (DAdam; Wang et al., ICLR 2025).

One concept: *which ranks average their parameters at iteration k*. A topology hands out, for
every iteration ``step``, a partition of the ranks into groups; each group averages exactly (every
member gets weight ``1/|g|``), so the mixing matrix ``W_k`` of the paper is symmetric and doubly
stochastic. Decentralized training mixes ``y_i^k = sum_j (W_k)_ij x_j^k``.

Registered topologies: :func:`available_topologies` (``complete``, ``ring``, ``one-peer-exp``,
``alternating-exp-ring`` / ``aer``, ``random-matching``). Exact schedules and the spectral gap
(:meth:`Topology.spectral_gap`): docs/update_rules.md, "Topologies".

Example::

    >>> from pipecomm.decentralized import topology
    >>> topo = topology.get_topology("aer", 16, ranks_per_node=4)
    >>> topo.groups(0)
    [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11, 12, 13, 14, 15)]
    >>> W = topo.mixing_matrix(0)   # 16 x 16, doubly stochastic
    >>> W.shape, bool((W.sum(axis=0) == 1).all() and (W.sum(axis=1) == 1).all())
    ((16, 16), True)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["AlternatingExpRingTopology", "CompleteTopology", "Group", "OnePeerExpTopology",
           "RandomMatchingTopology", "RingTopology", "Topology", "available_topologies",
           "get_topology", "register_topology"]

Partition = list[tuple[int, ...]]


@dataclass(frozen=True)
class Group:
    """One averaging group of an iteration: its ranks (sorted) and the uniform weight ``1/|g|``.

    Example::

        >>> g = Group((4, 5, 6, 7))
        >>> g.weight
        0.25
        >>> g.nodes(ranks_per_node=2)
        (2, 3)
    """

    ranks: tuple[int, ...]

    @property
    def weight(self) -> float:
        """The weight every member gives every member: ``1 / len(ranks)``."""
        return 1.0 / len(self.ranks)

    def nodes(self, ranks_per_node: int) -> tuple[int, ...]:
        """The sorted nodes the group spans when nodes hold ``ranks_per_node`` consecutive ranks."""
        return tuple(sorted({r // ranks_per_node for r in self.ranks}))


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class Topology:
    """Base class: a sequence of partitions of ``range(world_size)``, one per iteration.

    Subclasses implement :meth:`_partition` (the groups of one step, any order) and set
    :attr:`period` (steps after which the sequence repeats, or ``None`` if it never does).
    Everything else (sorting, validation, mixing matrices, spectral gap) lives here.

    Example::

        >>> class Pairs(Topology):                      # a custom, fixed pairing
        ...     period = 1
        ...     def _partition(self, step):
        ...         return [(i, i + 1) for i in range(0, self.world_size, 2)]
        >>> Pairs(4).groups(0)    # register_topology("pairs")(Pairs) makes it a get_topology name
        [(0, 1), (2, 3)]
    """

    #: registry name (set by :func:`register_topology`)
    name: str = ""
    #: whether the topology needs ranks_per_node (get_topology then reads LOCAL_WORLD_SIZE)
    needs_ranks_per_node: bool = False
    #: steps after which ``groups`` repeats (None: never, e.g. random matchings)
    period: int | None = 1

    def __init__(self, world_size: int, ranks_per_node: int | None = None) -> None:
        self.world_size = _check_int(world_size, "world_size", 1)
        if ranks_per_node is not None:
            ranks_per_node = _check_int(ranks_per_node, "ranks_per_node", 1)
        self.ranks_per_node = ranks_per_node
        self._cache: dict[int, Partition] = {}

    # -- to implement -------------------------------------------------------------------------
    def _partition(self, step: int) -> Iterable[Sequence[int]]:
        raise NotImplementedError

    # -- public ---------------------------------------------------------------------------------
    def groups(self, step: int) -> list[tuple[int, ...]]:
        """The partition of all ranks used at iteration ``step``: sorted tuples, list sorted.

        Example::

            >>> get_topology("ring", 6).groups(1)
            [(0, 5), (1, 2), (3, 4)]
        """
        step = _check_int(step, "step", 0)
        key = step % self.period if self.period else step
        cached = self._cache.get(key)
        if cached is None:
            cached = self._validated(self._partition(key), step)
            if self.period or len(self._cache) < 1024:
                self._cache[key] = cached
        return list(cached)

    def group_of(self, rank: int, step: int) -> tuple[int, ...]:
        """The group that ``rank`` averages with at iteration ``step`` (it contains ``rank``).

        Example::

            >>> get_topology("one-peer-exp", 8).group_of(5, 1)
            (5, 7)
        """
        rank = _check_int(rank, "rank", 0)
        if rank >= self.world_size:
            raise ValueError(f"rank must be < world_size={self.world_size}, got {rank}")
        for g in self.groups(step):
            if rank in g:
                return g
        raise AssertionError("unreachable: groups() is a validated partition")

    def mixing_matrix(self, step: int) -> np.ndarray:
        """``W_step`` (world_size x world_size, float64): ``W_ij = 1/|g|`` if i, j share group g.

        Symmetric and doubly stochastic. Example::

            >>> get_topology("complete", 4).mixing_matrix(0)
            array([[0.25, 0.25, 0.25, 0.25],
                   [0.25, 0.25, 0.25, 0.25],
                   [0.25, 0.25, 0.25, 0.25],
                   [0.25, 0.25, 0.25, 0.25]])
        """
        p = self.world_size
        w = np.zeros((p, p), dtype=np.float64)
        for g in self.groups(step):
            idx = np.asarray(g)
            w[np.ix_(idx, idx)] = 1.0 / len(g)
        return w

    def product_matrix(self, steps: int | None = None, start: int = 0) -> np.ndarray:
        """``W_{start+T-1} ... W_{start}`` for ``T = steps`` (default: :meth:`default_window`).

        Example::

            >>> bool((get_topology("one-peer-exp", 8).product_matrix() == 1 / 8).all())
            True
        """
        steps = self.default_window() if steps is None else _check_int(steps, "steps", 1)
        start = _check_int(start, "start", 0)
        prod = np.eye(self.world_size)
        for s in range(start, start + steps):
            prod = self.mixing_matrix(s) @ prod
        return prod

    def default_window(self) -> int:
        """Steps used by :meth:`spectral_gap`: the period, or ``ceil(log2 p)`` (at least 1)."""
        if self.period:
            return self.period
        return max(1, math.ceil(math.log2(self.world_size))) if self.world_size > 1 else 1

    def spectral_gap(self, steps: int | None = None, start: int = 0) -> float:
        """``1 - ||P - 11^T/p||_2`` for the product ``P`` of the mixing matrices of one period.

        In ``[0, 1]``: 1 means a period averages exactly, 0 that a period does not connect all
        ranks. ``steps`` overrides the window (default :meth:`default_window`).

        Example::

            >>> get_topology("complete", 8).spectral_gap()
            1.0
            >>> round(get_topology("ring", 8).spectral_gap(), 2)
            0.29
        """
        p = self.world_size
        prod = self.product_matrix(steps, start)
        sigma = float(np.linalg.norm(prod - np.full((p, p), 1.0 / p), ord=2))
        return float(min(1.0, max(0.0, 1.0 - sigma)))

    def distinct_groups(self) -> list[tuple[int, ...]]:
        """Every group used by the topology (over one period; for random matchings all pairs).

        Useful to create one process group per group, on every rank in the same order.

        Example::

            >>> get_topology("ring", 4).distinct_groups()
            [(0, 1), (0, 3), (1, 2), (2, 3)]
        """
        if self.period is None:
            raise NotImplementedError(f"{type(self).__name__} has no period; override this")
        found = {g for s in range(self.period) for g in self.groups(s)}
        return sorted(found)

    def __repr__(self) -> str:
        rpn = f", ranks_per_node={self.ranks_per_node}" if self.ranks_per_node else ""
        return f"{type(self).__name__}(world_size={self.world_size}{rpn}, period={self.period})"

    # -- internal -------------------------------------------------------------------------------
    def _validated(self, groups: Iterable[Sequence[int]], step: int) -> Partition:
        out = sorted(tuple(sorted(int(r) for r in g)) for g in groups)
        seen: list[int] = [r for g in out for r in g]
        if any(len(g) == 0 for g in out) or sorted(seen) != list(range(self.world_size)):
            raise RuntimeError(f"{type(self).__name__}.groups({step}) is not a partition of "
                               f"range({self.world_size}): {out}")
        return out


_REGISTRY: dict[str, type[Topology]] = {}


def register_topology(name: str, *aliases: str) -> Callable[[type[Topology]], type[Topology]]:
    """Class decorator: make a :class:`Topology` subclass available to :func:`get_topology`.

    Example::

        >>> @register_topology("pairs")
        ... class Pairs(Topology):
        ...     def _partition(self, step):
        ...         return [(i, i + 1) for i in range(0, self.world_size, 2)]
        >>> get_topology("pairs", 4).groups(0)
        [(0, 1), (2, 3)]
        >>> _ = _REGISTRY.pop("pairs")   # (unregister again)
    """
    names = (name, *aliases)
    for n in names:
        if not isinstance(n, str) or not n:
            raise TypeError(f"topology names must be non-empty strings, got {n!r}")
        if n in _REGISTRY:
            raise ValueError(f"topology name {n!r} is already registered ({_REGISTRY[n].__name__})")

    def decorate(cls: type[Topology]) -> type[Topology]:
        if not (isinstance(cls, type) and issubclass(cls, Topology)):
            raise TypeError(f"register_topology({name!r}) needs a Topology subclass, got {cls!r}")
        cls.name = name
        for n in names:
            _REGISTRY[n] = cls
        return cls

    return decorate


def available_topologies() -> list[str]:
    """Registered names, aliases included, sorted.

    Example::

        >>> available_topologies()
        ['aer', 'alternating-exp-ring', 'complete', 'one-peer-exp', 'random-matching', 'ring']
    """
    return sorted(_REGISTRY)


def env_ranks_per_node() -> int | None:
    """Ranks per (real or emulated) node: ``LOCAL_WORLD_SIZE`` as torchrun or the lab's rank
    pools set it; ``None`` where it is unset.

    Example::

        >>> rpn = env_ranks_per_node()   # e.g. 2 in a pool of 8 ranks, 2 per node
    """
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


def get_topology(
    name: str | Topology, world_size: int, ranks_per_node: int | None = None, **kw: object
) -> Topology:
    """Build the topology ``name`` for ``world_size`` ranks.

    ``ranks_per_node`` defaults to :func:`env_ranks_per_node` (``LOCAL_WORLD_SIZE``)
    for topologies that need it (``alternating-exp-ring``). Extra keywords go to the class (e.g.
    ``seed`` for ``random-matching``). A :class:`Topology` instance is returned as is after
    checking its world size.

    Example::

        >>> topo = get_topology("alternating-exp-ring", 8, ranks_per_node=2)
        >>> topo.period
        4
    """
    if isinstance(name, Topology):
        if name.world_size != world_size:
            raise ValueError(f"topology {name!r} is for world_size={name.world_size}, not "
                             f"{world_size}")
        return name
    if not isinstance(name, str):
        raise TypeError(f"name must be a topology name or a Topology, got {type(name).__name__}")
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown topology {name!r}; available: "
                         f"{', '.join(available_topologies())}")
    if ranks_per_node is None and cls.needs_ranks_per_node:
        ranks_per_node = env_ranks_per_node()
    return cls(world_size, ranks_per_node=ranks_per_node, **kw)


# ------------------------------------------------------------------------------------------------
# built-in topologies


@register_topology("complete")
class CompleteTopology(Topology):
    """Every rank averages with every rank at every step (AllReduce-like mixing).

    Example::

        >>> get_topology("complete", 3).groups(7)
        [(0, 1, 2)]
    """

    period = 1

    def _partition(self, step: int) -> Partition:
        return [tuple(range(self.world_size))]


@register_topology("ring")
class RingTopology(Topology):
    """One-peer ring alternating between the two perfect matchings of the ring.

    Even steps: ``(0,1), (2,3), ...``; odd steps: ``(1,2), (3,4), ..., (p-1, 0)``. Even world
    sizes, or 1.

    Example::

        >>> get_topology("ring", 4).groups(1)
        [(0, 3), (1, 2)]
    """

    period = 2

    def __init__(self, world_size: int, ranks_per_node: int | None = None) -> None:
        super().__init__(world_size, ranks_per_node)
        p = self.world_size
        if p > 1 and p % 2:
            raise ValueError("topology 'ring' needs an even world_size (2, 4, 6, ...) or 1, got "
                             f"{p}")

    def _partition(self, step: int) -> Partition:
        p = self.world_size
        if p == 1:
            return [(0,)]
        off = step % 2
        return [((i + off) % p, (i + off + 1) % p) for i in range(0, p, 2)]


@register_topology("one-peer-exp")
class OnePeerExpTopology(Topology):
    """One-peer exponential graph: at round ``r = step mod log2 p`` rank ``j`` pairs ``j XOR 2^r``.

    Powers of two only (1 included, which never communicates).

    Example::

        >>> get_topology("one-peer-exp", 8).groups(2)
        [(0, 4), (1, 5), (2, 6), (3, 7)]
    """

    def __init__(self, world_size: int, ranks_per_node: int | None = None) -> None:
        super().__init__(world_size, ranks_per_node)
        p = self.world_size
        if not _is_power_of_two(p):
            raise ValueError("topology 'one-peer-exp' needs a power-of-two world_size (1, 2, 4, "
                             f"8, ...), got {p}")
        self.period = max(1, p.bit_length() - 1)

    def _partition(self, step: int) -> Partition:
        p = self.world_size
        if p == 1:
            return [(0,)]
        bit = 1 << (step % self.period)
        return [(j, j ^ bit) for j in range(p) if not j & bit]


@register_topology("alternating-exp-ring", "aer")
class AlternatingExpRingTopology(Topology):
    """Alternating exponential ring (AER): nodes pair exponentially, alternating intra/inter steps.

    The exact schedule: docs/update_rules.md, "Topologies". ``world_size`` must be ``N *
    ranks_per_node`` with ``N`` nodes a power of two.

    Example::

        >>> topo = get_topology("aer", 8, ranks_per_node=2)   # 4 nodes, period 4
        >>> topo.groups(0)
        [(0, 1), (2, 3), (4, 5, 6, 7)]
        >>> topo.groups(1)
        [(0, 1, 2, 3), (4, 5), (6, 7)]
    """

    needs_ranks_per_node = True

    def __init__(self, world_size: int, ranks_per_node: int | None = None) -> None:
        super().__init__(world_size, ranks_per_node)
        p, rpn = self.world_size, self.ranks_per_node
        if rpn is None:
            raise ValueError("topology 'alternating-exp-ring' needs ranks_per_node: pass it, or "
                             "run under launch/torchrun so that LOCAL_WORLD_SIZE is set")
        if p % rpn:
            raise ValueError("topology 'alternating-exp-ring' needs world_size a multiple of "
                             f"ranks_per_node={rpn} (a power-of-two number of nodes: {rpn}, "
                             f"{2 * rpn}, {4 * rpn}, ...), got world_size={p}")
        self.num_nodes = p // rpn
        if not _is_power_of_two(self.num_nodes):
            raise ValueError("topology 'alternating-exp-ring' needs a power-of-two number of "
                             f"nodes; world_size={p} with ranks_per_node={rpn} gives "
                             f"{self.num_nodes}. Accepted world sizes: {rpn}, {2 * rpn}, "
                             f"{4 * rpn}, {8 * rpn}, ...")
        self.rounds = self.num_nodes.bit_length() - 1
        self.period = 2 * self.rounds if self.rounds else 1

    def _node(self, n: int) -> tuple[int, ...]:
        rpn = self.ranks_per_node
        assert rpn is not None
        return tuple(range(n * rpn, (n + 1) * rpn))

    def _partition(self, step: int) -> Partition:
        if self.rounds == 0:
            return [self._node(0)]
        bit = 1 << ((step // 2) % self.rounds)
        phase = step % 2
        out: Partition = []
        lows = [a for a in range(self.num_nodes) if not a & bit]
        for q, a in enumerate(lows):
            b = a ^ bit
            if phase == q % 2:  # intra-node step of this pair
                out += [self._node(a), self._node(b)]
            else:  # inter-node step: both nodes together
                out.append(self._node(a) + self._node(b))
        return out

    def inter_node_nodes(self, step: int) -> list[int]:
        """Nodes whose group at ``step`` spans two nodes (they use the inter-node network).

        Example::

            >>> get_topology("aer", 16, ranks_per_node=4).inter_node_nodes(0)
            [2, 3]
        """
        rpn = self.ranks_per_node
        assert rpn is not None
        return sorted({r // rpn for g in self.groups(step) if len(g) > rpn for r in g})


@register_topology("random-matching")
class RandomMatchingTopology(Topology):
    """A fresh uniformly random perfect matching every step (same on every rank for a ``seed``).

    The matching of step ``s`` pairs consecutive entries of
    ``numpy.random.default_rng([seed, s]).permutation(p)``; with odd ``p`` the last entry is a
    group of size 1. ``period`` is ``None``; :meth:`spectral_gap` uses ``ceil(log2 p)`` steps.

    Example::

        >>> topo = get_topology("random-matching", 6, seed=3)
        >>> topo.groups(0) == get_topology("random-matching", 6, seed=3).groups(0)
        True
    """

    period = None

    def __init__(self, world_size: int, ranks_per_node: int | None = None, seed: int = 0) -> None:
        super().__init__(world_size, ranks_per_node)
        self.seed = _check_int(seed, "seed", 0)

    def _partition(self, step: int) -> Partition:
        return _random_matching(self.world_size, self.seed, step)

    def distinct_groups(self) -> list[tuple[int, ...]]:
        """Every pair ``(i, j)``, ``i < j`` (and every singleton if the world size is odd)."""
        p = self.world_size
        pairs = [(i, j) for i in range(p) for j in range(i + 1, p)]
        if p % 2:
            pairs += [(i,) for i in range(p)]
        return sorted(pairs)

    def __repr__(self) -> str:
        return f"RandomMatchingTopology(world_size={self.world_size}, seed={self.seed})"


@lru_cache(maxsize=4096)
def _random_matching(p: int, seed: int, step: int) -> Partition:
    perm = np.random.default_rng([seed, step]).permutation(p).tolist()
    out = [tuple(perm[i : i + 2]) for i in range(0, p, 2)]
    return out
