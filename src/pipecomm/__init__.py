"""pipecomm: communication-efficient distributed training, reproduced.

Linear-pipelined collectives (Wang et al., arXiv 1611.04255), pipelined SGD (Li et al., NeurIPS
2018; Daily et al., ICLR 2017 submission) and decentralized Adam (Wang et al., ICLR 2025) on
``torch.distributed``. Submodules are imported on use: ``from pipecomm import collectives, backend``; the lab
(``pipecomm.lab``: the experiments, the emulated network, the cost models, the rank pools) is
never imported by the library.
"""

__version__ = "0.1.0"
