"""Pipelined SGD with staleness k: synchronous (BSP-SGD), layer-wise, and pipelined AllReduce SGD.

Data-parallel training in which the gradient averaged over all ranks is applied ``k`` iterations
late, while its AllReduce runs on pipecomm's communication thread. :class:`PipeSGD` wraps a
``torch.optim.Optimizer`` (like torch's ``PostLocalSGDOptimizer``):

* ``mode="sync"`` -- BSP-SGD of the LP paper (Wang et al., arXiv 1611.04255);
* ``mode="layerwise"`` -- layer-wise GD of Daily, Vishnu, Siegel ("Leveraging Asynchronicity in
  Gradient Descent for Scalable Deep Learning", ICLR 2017 submission): per-bucket AllReduce
  started from backward hooks, zero staleness;
* ``mode="pipe"`` -- Pipe-SGD (Li, Yu, Li, Avestimehr, Kim, Schwing, NeurIPS 2018) and delayed
  GD (Daily et al., "AGD (1 comm)", "AGD (2 comm)"): ``w_{t+1} = step(w_t, g(w_{t-k}))`` for
  ``t >= k`` and ``w_{t+1} = w_t`` for ``t < k``, with Pipe-SGD's light compression (``"fp16"``,
  ``"bf16"``, ``"int8"``) inside the AllReduce.

The package's modules, the exact rules, the order of operations inside ``step()``, world size
1, checkpoints: docs/update_rules.md, "Data-parallel SGD" and "Pipelined SGD with staleness k".

Example (a training loop: :class:`PipeSGD`'s)::

    >>> import torch
    >>> from pipecomm.pipesgd import PipeSGD
    >>> model = torch.nn.Linear(2, 1)
    >>> w0 = model.weight.detach().clone()
    >>> opt = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), mode="pipe")
    >>> model(torch.ones(4, 2)).sum().backward(); opt.step()   # launches, applies nothing (k = 1)
    >>> torch.equal(model.weight, w0)
    True
"""

from __future__ import annotations

from pipecomm.pipesgd.optimizer import PipeSGD
from pipecomm.pipesgd.timing import TIMING_KEYS
from pipecomm.vocab import COMPRESSIONS, MODES

__all__ = ["COMPRESSIONS", "MODES", "TIMING_KEYS", "PipeSGD"]
