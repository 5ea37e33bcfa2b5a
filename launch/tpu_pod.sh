#!/usr/bin/env bash
# Run the trainer on every worker of a Cloud TPU VM pod slice (or several slices).
#
#   launch/tpu_pod.sh create  NAME ZONE ACCELERATOR [SLICES]   # e.g. v3-2048; SLICES>1: queued resource
#   launch/tpu_pod.sh install NAME ZONE                        # copy this checkout, pip install -e '.[tpu]'
#   launch/tpu_pod.sh run     NAME ZONE -- <trainer args>      # start on all workers, stream logs
#   launch/tpu_pod.sh delete  NAME ZONE
#
# install uses the [tpu] extra (jax[tpu] pinned to the project's jax). JAX finds
# the workers (and slices) from the TPU VM metadata server, so the trainer needs
# no distributed flags. Several slices (create ... SLICES > 1, multislice: v4 and
# later) are a queued resource of SLICES nodes: install and run then reach every
# worker of every node, and `run` passes --config.mesh.dcn_axes.data=SLICES (data
# parallelism across the slices) unless the trainer args set dcn axes themselves.
# The slices find each other through MEGASCALE_* in the VMs' metadata (JAX's own
# multislice start-up). See launch/README.md for the gcloud commands spelled out.
set -euo pipefail

usage() { sed -n '2,7p' "$0"; exit 2; }
[[ $# -ge 3 ]] || usage
action=$1 name=$2 zone=$3
shift 3
runtime=${TPU_RUNTIME_VERSION:-tpu-ubuntu2204-base}

# Nodes of the queued resource NAME (0 when NAME is a plain TPU VM).
slices() {
  gcloud compute tpus queued-resources describe "$name" --zone="$zone" \
    --format='value(tpu.nodeSpec[0].multisliceParams.nodeCount)' 2>/dev/null || true
}

ssh_all() {
  if [[ -n "$(slices)" ]]; then
    gcloud compute tpus queued-resources ssh "$name" --zone="$zone" --node=all --worker=all \
      --command="$1"
  else
    gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command="$1"
  fi
}

scp_all() {
  if [[ -n "$(slices)" ]]; then
    gcloud compute tpus queued-resources scp "$1" "$name":"$2" --zone="$zone" --node=all \
      --worker=all
  else
    gcloud compute tpus tpu-vm scp "$1" "$name":"$2" --zone="$zone" --worker=all
  fi
}

case "$action" in
  create)
    accelerator=${1:?accelerator type, e.g. v3-2048}
    slices=${2:-1}
    if [[ "$slices" -gt 1 ]]; then
      gcloud compute tpus queued-resources create "$name" --zone="$zone" \
        --accelerator-type="$accelerator" --runtime-version="$runtime" \
        --node-count="$slices" --node-prefix="$name"
    else
      gcloud compute tpus tpu-vm create "$name" --zone="$zone" \
        --accelerator-type="$accelerator" --version="$runtime"
    fi
    ;;
  install)
    here=$(cd "$(dirname "$0")/.." && pwd)
    tar -C "$here" --exclude=.git --exclude=.venv -czf /tmp/wus-trainer.tgz .
    scp_all /tmp/wus-trainer.tgz /tmp/
    ssh_all "mkdir -p ~/wus-trainer && tar -C ~/wus-trainer -xzf /tmp/wus-trainer.tgz && \
      cd ~/wus-trainer && pip install -e '.[tpu]'"
    ;;
  run)
    [[ "${1:-}" == "--" ]] && shift
    count=$(slices)
    if [[ "${count:-0}" -gt 1 && "$*" != *dcn_axes* ]]; then
      set -- "$@" "--config.mesh.dcn_axes.data=$count"
    fi
    args=$(printf '%q ' "$@")
    # All workers start the same command; their output streams back here.
    ssh_all "cd ~/wus-trainer && python -m trainer $args 2>&1 | tee -a ~/train.log"
    ;;
  delete)
    if [[ -n "$(slices)" ]]; then
      gcloud compute tpus queued-resources delete "$name" --zone="$zone" --force --quiet
    else
      gcloud compute tpus tpu-vm delete "$name" --zone="$zone" --quiet
    fi
    ;;
  *)
    usage
    ;;
esac
