"""One line on what each experiment parameter means, for ``./run_all.sh --list``.

:data:`MEANINGS` holds the meaning of a name shared by several experiments; :data:`OWN` the
meaning a name has in one experiment only (``"E0.iters"``). A test checks that every parameter of
every experiment module has one.

Example::

    >>> meaning("E4", "block_range")
    'LP block sizes from optimum / range to optimum x range'
"""

from __future__ import annotations

__all__ = ["MEANINGS", "OWN", "meaning"]

MEANINGS: dict[str, str] = {
    # the network an experiment runs on
    "network": "where it measures: emulated (pipecomm.lab.networks.netem) or shaped (tc-shaped namespaces)",
    "emulated": "run on the emulated network (False: the real backend only)",
    "backend": "gloo (CPU ranks) or nccl (one GPU per rank)",
    "ports": "port model of the emulated link: single (one transfer at a time) or per-neighbor",
    "alpha_s": "latency of the emulated link (s)",
    "bandwidth_Bps": "bandwidth of the emulated link (B/s); None: chosen from comm_ratio",
    "emu_alpha_s": "latency of the emulated link (s)",
    "emu_bandwidth_Bps": "bandwidth of the emulated link (B/s)",
    "intra_alpha_s": "latency of the emulated link inside a node (s)",
    "intra_bandwidth_Bps": "bandwidth of the emulated link inside a node (B/s)",
    "inter_alpha_s": "latency of the emulated link between nodes (s)",
    "inter_bandwidth_Bps": "bandwidth of the emulated link between nodes (B/s)",
    "ranks_per_node": "ranks per (emulated) node",
    "comm_ratio": "emulated AllReduce time as a multiple of compute + update (sets bandwidth)",
    # sizes and repeats
    "world_size": "number of ranks (p)",
    "world_sizes": "numbers of ranks (p) swept",
    "sizes_min": "smallest message (bytes)",
    "sizes_max": "largest message (bytes)",
    "size_factor": "ratio between consecutive message sizes",
    "nbytes": "message size (bytes)",
    "iters": "timed repeats per point",
    "warmup": "untimed repeats before the timed ones",
    "timeout_s": "limit for one call on the ranks (s)",
    "ops": "collectives measured (broadcast, reduce, allreduce)",
    "op": "collective measured",
    "algorithms": "collective algorithms compared (lp, mst, be, ring, torch)",
    "algorithm": "collective algorithm of the gradient exchange or gossip",
    # training
    "model": "model trained",
    "model_kw": "the model's size arguments",
    "lr": "learning rate",
    "momentum": "SGD momentum",
    "iterations": "training iterations per run",
    "skip": "first iterations left out of the steady-state times",
    "batch_size": "mini-batch per rank",
    "batch_sizes": "mini-batches per rank swept",
    "dataset": "training data: digits (offline, scikit-learn) or a fetched data set",
    "data_root": "directory of a fetched data set (None: the default)",
    "seed": "random seed",
    "seeds": "random seeds (paired across methods)",
    "methods": "training methods compared",
    "calib_iters": "iterations of the compute-only calibration run",
    "switch_interval_s": "Python GIL switch interval on the ranks (s)",
    "eval_every": "iterations between evaluations",
    "schedule": "learning-rate schedule (constant, warmup-cosine, ...)",
    "warmup_steps": "iterations of learning-rate warm-up",
    "warmup_fraction": "fraction of iterations of learning-rate warm-up",
    "min_lr_ratio": "final learning rate as a fraction of lr",
    "bucket_mb": "gradient bucket size (MB)",
    "topology": "gossip topology of decentralized training",
    "topologies": "gossip topologies compared",
    "width": "hidden width of the timing model",
    "layers": "layers of the timing model",
    "fwd_ms": "emulated forward compute per iteration (ms)",
    "bwd_ms": "emulated backward compute per iteration (ms)",
    "blocks": "timed blocks per point (iteration time: median over blocks)",
    "block_iters": "iterations per timed block",
}

OWN: dict[str, str] = {
    # E0 calibration
    "E0.gamma_bytes": "bytes of the local reduction timing (gamma); 0: none",
    "E0.host_world_size": "ranks of the host-links probe (0: no host section)",
    "E0.host_bytes": "block size of the host-links probe (bytes)",
    "E0.host_messages": "messages per link of the host-links probe",
    "E0.fit_min_bytes": "smallest message the alpha-beta fit uses (bytes)",
    "E0.emu_world_sizes": "ranks of the emulated ping-pong (even; pairs)",
    "E0.emu_sizes_max": "largest message on the emulated link (bytes)",
    # E1 cost model
    "E1.alpha_s": "latency of the modelled link (s)",
    "E1.bandwidth_Bps": "bandwidth of the modelled link (B/s)",
    "E1.gamma_s_per_byte": "reduction cost of the model (s per byte)",
    "E1.size_sweep_p": "numbers of ranks of the size sweep",
    "E1.world_sizes": "numbers of ranks of the rank sweep",
    "E1.ranks_sweep_bytes": "message size of the rank sweep (bytes)",
    "E1.ports": "port models compared (single, per-neighbor)",
    # E2 collectives vs size
    "E2.emu_cases": "emulated cases: 'ports/op' -> algorithms",
    "E2.large_bytes": "messages this large or larger get iters_large repeats, no warm-up",
    "E2.iters_large": "timed repeats of a large message",
    "E2.max_point_s": "points whose modelled time exceeds this are not measured (s)",
    "E2.real_world_sizes": "ranks of the real-backend section",
    "E2.real_algorithms": "algorithms of the real-backend section (torch: the built-in)",
    "E2.real_ops": "collectives of the real-backend section",
    "E2.real_sizes_min": "smallest message of the real-backend section (bytes)",
    "E2.real_sizes_max": "largest message of the real-backend section (bytes)",
    "E2.real_iters": "timed repeats of the real-backend section",
    "E2.real_warmup": "untimed repeats of the real-backend section",
    # E4 block size
    "E4.block_range": "LP block sizes from optimum / range to optimum x range",
    "E4.steps_per_octave": "block sizes per factor of 2",
    # E6 timing model
    "E6.pools": "[ranks, emulated bandwidth B/s] pairs, one pool each",
    "E6.modes": "sync (BSP) and/or pipe (Pipe-SGD width 2)",
    # E7-E9 Pipe-SGD family
    "E5.port_models": "port models of the emulated link, one pool each (single, per-neighbor)",
    "E5.runs": "independent training runs per (port model, algorithm); a run's median is a repeat",
    "E6.runs": "independent training runs per point; a run's median is one repeat",
    "E8.runs": "independent training runs per method; a run's median is one repeat",
    "E7.target_fraction": "accuracy target as a fraction of sync's final accuracy",
    "E7.timing_methods": "methods of the separate timing runs (the speed claims)",
    "E7.timing_runs": "separate short timing runs per method (0: the seeds are the repeats)",
    "E7.timing_iterations": "iterations per timing run",
    "E7.lrs": "peak learning rates tried per method (geometric grid; empty: every method at lr)",
    "E7.selection_seeds": "seeds that choose each method's rate (never evaluation seeds)",
    "E7.momenta": "momenta chosen together with each method's rate (empty: momentum only)",
    "E7.selection_sets": "disjoint sets the selection seeds are cut into, one choice per set",
    "E7.selection_rule": "how a set's runs choose: mean loss, median loss, or stable (no divergence)",
    "E7.control_lr": "fixed stress rate of the @Kx negative controls (0: K x each method's rate)",
    "E7.max_extend": "times the rate grid may be extended past an edge holding the best",
    "E7.control_seeds": "evaluation seeds the @4x controls train from (0: all)",
    "E9.nocomm_iterations": "iterations of the no-communication bound (without timing runs)",
    "E9.timing_runs": "separate short timing runs per method (0: the seeds are the repeats)",
    "E9.timing_iterations": "iterations per timing run",
    "E9.target_acc": "accuracy target (%) for iterations-to-accuracy",
    # E10-E12 DAdam timing
    "E10.models": "workloads timed (timing: emulated compute; char_transformer)",
    "E11.compute_scales": "compute per iteration as multiples of the calibrated one",
    "E11.compute_cvs": "coefficients of variation of the per-rank compute",
    "E11.networks": "networks compared: two-level or flat links",
    "E11.inter_bandwidth_Bps": "bandwidth between nodes (B/s); None: the two-level default",
    "E12.compute_cv": "coefficient of variation of the per-rank compute",
    "E10.runs": "independent runs (every model and topology once per run, rotated order)",
    "E11.runs": "independent short trainings per configuration; a run's median is a repeat",
    "E11.ablation_runs": "rounds of the overlap ablation (each method with and without its overlap)",
    "E11.ablation_blocks": "timed blocks per ablation run (shorter repeats, more of them)",
    "E12.runs": "independent short trainings per configuration; a run's median is a repeat",
    # E13 DAdam convergence
    "E13.tasks": "tasks trained: digits (classification), lm (character language model)",
    "E13.accum_iters": "AccumAdam's accumulation periods K",
    "E13.digits_iterations": "iterations of the digits task",
    "E13.lm_iterations": "iterations of the language-model task",
    "E13.digits_batch": "mini-batch per rank of the digits task",
    "E13.lm_batch": "mini-batch per rank of the language-model task",
    "E13.seq_len": "sequence length of the language-model task",
    "E13.digits_lrs": "learning rates tried per configuration on the digits task (geometric)",
    "E13.lm_lrs": "learning rates tried per configuration on the language-model task (geometric)",
    "E13.digits_seeds": "evaluation seeds of the digits task (paired across configurations)",
    "E13.lm_seeds": "evaluation seeds of the language-model task (paired across configurations)",
    "E13.selection_seeds": "seeds that choose each configuration's rate (never evaluation seeds)",
    "E13.max_extend": "times the rate grid may be extended past an edge holding the best",
    "E13.emulated": "run on the two-level emulated network (False: the real backend)",
    # E14 emulator vs shaped
    "E14.bandwidth_Bps": "rate of each shaped node link (B/s)",
    "E14.sizes": "message sizes compared (bytes)",
    "E14.cases": "collectives and algorithms compared",
    "E14.link_sizes": "message sizes of the link calibration (bytes)",
    "E14.link_iters": "repeats of the link calibration",
    "E14.min_block_bytes": "smallest LP block (bytes)",
    # E15 against the built-in
    "E15.bandwidth_Bps": "rate of each shaped node link (B/s)",
    "E15.world_sizes": "numbers of single-port nodes (p) of the collectives",
    "E15.sizes": "message sizes of the collectives (bytes)",
    "E15.cases": "collectives and algorithms (torch: gloo's built-in)",
    "E15.auto_cases": "collectives and the algorithms timed beside auto ({} : no auto section)",
    "E15.auto_sizes": "message sizes of auto's table and section (bytes)",
    "E15.tune_iters": "repeats of each point of auto's tables and of LP's block plan",
    "E15.train_tune_sizes": "allreduce sizes of the training cluster's table for :auto (bytes)",
    "E15.link_sizes": "message sizes of the link calibration (bytes)",
    "E15.link_iters": "repeats of the link calibration",
    "E15.lp_plan_blocks": "LP blocks whose pipeline steps fit the link LP plans on ([]: the "
                          "link calibration; bytes)",
    "E15.lp_plan_bytes": "message of those LP broadcasts (bytes)",
    "E15.train_nodes": "single-port nodes of the training runs",
    "E15.train_batch": "training configurations: name -> sequences per rank per step",
    "E15.train_strategies": "training configurations: name -> strategies NAME[:ALG][+CODEC]",
    "E15.steps": "training steps per run",
    "E15.warmup_steps": "steps left out of a run's median step time",
    "E15.n_layer": "transformer blocks of the GPT",
    "E15.n_embd": "width of the GPT",
    "E15.block_size": "characters per sequence",
}


def meaning(eid: str, name: str) -> str:
    """One line on what parameter ``name`` of experiment ``eid`` means ("" if none is written).

    Example::

        >>> meaning("E0", "host_world_size")
        'ranks of the host-links probe (0: no host section)'
    """
    return OWN.get(f"{eid}.{name}", MEANINGS.get(name, ""))
