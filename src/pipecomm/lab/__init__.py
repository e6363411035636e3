"""The lab: what reproduces the four papers with the library (:mod:`pipecomm`).

The library is what a training script imports (collectives, the process group, DDP hooks,
PipeSGD, DecentralizedDataParallel, codecs, bucketing, the emulated network, launching ranks);
the lab imports it and is never imported by it. Its floors, bottom up: statistics
(:mod:`.stats`), results on disk (:mod:`.results`), data sets and models (:mod:`.data`,
:mod:`.models`, :mod:`.schedules`), the timing harness and sweeps (:mod:`.bench`, :mod:`.sweep`),
the virtual cluster (:mod:`.cluster`), claims (:mod:`.claims`), the experiments' shared pieces
(:mod:`.params`, :mod:`.checks`, :mod:`.network`, :mod:`.workloads`, :mod:`.calibration`,
:mod:`.trainers`, the Pipe-SGD and DAdam families' modules, :mod:`.cli`, :mod:`.notebook`), the
experiments (:mod:`.experiments`, one module per table or figure, none importing another), and
the orchestrator (:mod:`.artifact`, what ``run_all.sh`` runs).
"""
