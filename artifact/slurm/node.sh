#!/bin/bash
# One torchrun agent on this node for one experiment of a profile (default: gpu).
#
#   NNODES=2 NODE_RANK=0 NPROC_PER_NODE=4 HEAD_ADDR=node001 bash artifact/slurm/node.sh E13 [-p NAME=VALUE ...]
#
# Started once per node by run_gpu_profile.sbatch (srun, one task per node). The job has
# NNODES * NPROC_PER_NODE ranks; rank 0 gathers every rank's values and writes $OUT/<E>/.
# E0 ping-pongs between two ranks: it runs on nodes 0 and 1 with one rank each (the
# inter-node link); other nodes skip it.
#
# Environment: NNODES, NODE_RANK, NPROC_PER_NODE, HEAD_ADDR (required); RDZV_PORT (29500),
# RDZV_ID (pipecomm), OUT (results/gpu-cluster), PROFILE (gpu), PYTHON (.venv/bin/python),
# TORCHRUN_EXTRA (more torchrun options; pipecomm.lab.networks.cluster's virtual cluster passes
# --local-addr and --rdzv-conf is_host=, since its nodes share one host name).
set -euo pipefail
E=${1:?usage: node.sh EXPERIMENT [-p NAME=VALUE ...]}
shift
: "${NNODES:?}" "${NODE_RANK:?}" "${NPROC_PER_NODE:?}" "${HEAD_ADDR:?}"
PYTHON=${PYTHON:-.venv/bin/python}
PROFILE=${PROFILE:-gpu}
OUT=${OUT:-results/gpu-cluster}
RDZV_PORT=${RDZV_PORT:-29500}
RDZV_ID=${RDZV_ID:-pipecomm}
nnodes=$NNODES
nproc=$NPROC_PER_NODE
if [ "$E" = E0 ]; then
    nnodes=2
    nproc=1
    if [ "$NODE_RANK" -ge 2 ]; then exit 0; fi
fi
program=$("$PYTHON" -m pipecomm.lab.networks.cluster program "$PROFILE" "$E" --out "$OUT/$E" \
    --world-size $((nnodes * nproc)) --ranks-per-node "$nproc" "$@")
mapfile -t PROGRAM <<< "$program"
# shellcheck disable=SC2086  # TORCHRUN_EXTRA is a list of options
exec timeout --kill-after=30 "${NODE_TIMEOUT_S:-7200}" "$PYTHON" -m torch.distributed.run \
    --nnodes "$nnodes" --nproc-per-node "$nproc" --node-rank "$NODE_RANK" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD_ADDR:$RDZV_PORT" --rdzv-id "$RDZV_ID-$E" \
    --max-restarts 0 ${TORCHRUN_EXTRA:-} "${PROGRAM[@]}"
