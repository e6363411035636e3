"""Pipelined SGD with staleness k: synchronous (BSP-SGD), layer-wise, and pipelined AllReduce SGD.

One concept: data-parallel training in which the gradient averaged over all ranks is applied
``k`` iterations late, while its AllReduce runs on pipecomm's communication thread.
:class:`PipeSGD` wraps a ``torch.optim.Optimizer`` (like torch's ``PostLocalSGDOptimizer``) and
implements

* BSP-SGD of the LP paper (Wang et al., arXiv 1611.04255) — ``mode="sync"``: after backward,
  one AllReduce (average) of the flattened gradients, then the optimizer's step;
* layer-wise GD of Daily, Vishnu, Siegel ("Leveraging Asynchronicity in Gradient Descent for
  Scalable Deep Learning", ICLR 2017 submission) — ``mode="layerwise"``: gradients are bucketed in
  backward order and each bucket's AllReduce starts from a backward hook as soon as its gradients
  are ready; all of them are waited for before the step (zero staleness, so the result is that of
  ``"sync"``; only the timing differs);
* Pipe-SGD (Li, Yu, Li, Avestimehr, Kim, Schwing, NeurIPS 2018) and delayed GD (Daily et al.,
  "AGD (1 comm)", "AGD (2 comm)") — ``mode="pipe"``: the step of iteration t launches the
  AllReduce of its gradient and applies the one launched at iteration t - k, so the AllReduce of
  iteration t - k runs while iterations t - k + 1 .. t compute (k = 1 is Pipe-SGD's pipeline of
  width 2; k = 2 keeps two reductions in flight). Pipe-SGD's light compression (``"fp16"``,
  ``"bf16"``, ``"int8"``) is applied inside the AllReduce (:mod:`pipecomm.collectives`).

Exact rule (``docs/update_rules.md``, "Pipelined SGD with staleness k"): with ``g(w)`` the
gradient averaged over all ranks, ``w_{t+1} = step(w_t, g(w_{t-k}))`` for ``t >= k`` and ``w_{t+1} = w_t`` for ``t < k``; after
``step()`` of iteration t returns, the parameters are ``w_{t+1}``. ``step`` is the wrapped
optimizer's ``step()`` with ``p.grad`` set to the averaged gradient (so SGD, momentum, Adam, ...
all work, and their state advances once per update), with the hyper-parameters in
``param_groups`` at that moment (a learning-rate scheduler attached to the PipeSGD sets them).

Modules: :mod:`.optimizer` (the wrapper: the Optimizer interface, checkpoints),
:mod:`.replicas` (argument checks, the group, equal replicas at construction),
:mod:`.strategies` (``Local``, ``Sync``, ``Layerwise``, ``Pipelined``: one small class per
schedule), :mod:`.exchange` (buckets from :mod:`pipecomm.bucketing`, packing, AllReduce,
unpacking), :mod:`.timing` (the opt-in per-iteration records).

At world size 1 nothing is communicated, but the staleness is kept (gradients are held back k
iterations). The emulated network (:mod:`pipecomm.netem`) applies to every algorithm;
``"torch"`` (the built-in) cannot be emulated and is refused under it. With ``timing=True``,
timings per iteration (compute, time blocked on communication, compression, update) are kept in
:attr:`PipeSGD.timings` for the experiments' breakdowns; with CUDA parameters every timing point
first synchronises the device. Without it (the default) nothing is timed or synchronised.

Example::

    >>> import torch
    >>> from pipecomm.pipesgd import PipeSGD
    >>> model = torch.nn.Linear(2, 1)
    >>> w0 = model.weight.detach().clone()
    >>> opt = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), mode="pipe")
    >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 100))
    >>> loss_fn, batches = torch.nn.functional.mse_loss, [(torch.ones(4, 2), torch.zeros(4, 1))] * 3
    >>> for x, y in batches:
    ...     opt.zero_grad()
    ...     loss_fn(model(x), y).backward()
    ...     opt.step()              # launches this gradient's AllReduce, applies the previous one
    ...     if opt.iteration == 1:
    ...         print(torch.equal(model.weight, w0))   # k = 1: the first step applies nothing
    ...     sched.step()
    True
    >>> opt.finish()                # optional: applies the reductions still in flight
"""

from __future__ import annotations

from pipecomm.pipesgd.optimizer import PipeSGD
from pipecomm.pipesgd.timing import TIMING_KEYS
from pipecomm.vocab import COMPRESSIONS, MODES

__all__ = ["COMPRESSIONS", "MODES", "TIMING_KEYS", "PipeSGD"]
