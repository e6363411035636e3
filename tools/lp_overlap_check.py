"""LP broadcast on the emulated network: measured time against the lock-step model and against the
overlapped form of the progress engine's schedule (``pipecomm.lab.networks.cost.lp_overlapped_time`` is that
model, with the host's cost per block; docs/algorithms.md, "LP as the engine runs it").

The cost model prices LP broadcast lock-step, ``(k + p - 2) alpha + (n + (p - 2) b) beta``: every
pipeline step pays the latency. On the progress engine a rank forwards a block the moment it has
arrived, and the emulator's latency does not occupy a port (pipecomm.lab.networks.netem), so a block's latency
is in flight while the port sends the next one: the last block arrives after
``(p - 1) alpha + (n + (p - 2) b) beta``. This script reads E2's data (the emulated single-port
broadcast rows) and prints both forms beside the measurement. It is an analysis, not a claim.

    .venv/bin/python tools/lp_overlap_check.py artifact/reference/cpu/E2/data.csv.gz
"""

from __future__ import annotations

import sys

import pandas as pd


def main(path: str) -> None:
    df = pd.read_csv(path)
    d = df[(df.section == "emulated") & (df.ports == "single") & (df.op == "broadcast")
           & (df.algorithm == "lp")].sort_values("nbytes")
    print(f"{'size':>10} {'block':>9} {'measured':>10} {'lock-step':>16} {'overlapped':>17}")
    for r in d.itertuples():
        alpha, beta, p = r.emu_alpha_s, 1.0 / r.emu_bandwidth_Bps, int(r.world_size)
        n, b = int(r.nbytes), int(r.block_bytes)
        k = -(-n // b)
        wire = (n + (p - 2) * b) * beta
        lock, over = (k + p - 2) * alpha + wire, (p - 1) * alpha + wire
        print(f"{n:>10} {b:>9} {r.time_s * 1e3:8.1f}ms {lock * 1e3:8.1f}ms "
              f"({r.time_s / lock - 1:+6.1%}) {over * 1e3:8.1f}ms ({r.time_s / over - 1:+6.1%})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "artifact/reference/cpu/E2/data.csv.gz")
