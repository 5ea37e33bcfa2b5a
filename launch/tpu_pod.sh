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
# no distributed flags. See launch/README.md for the gcloud commands spelled out.
set -euo pipefail

usage() { sed -n '2,7p' "$0"; exit 2; }
[[ $# -ge 3 ]] || usage
action=$1 name=$2 zone=$3
shift 3
runtime=${TPU_RUNTIME_VERSION:-tpu-ubuntu2204-base}

ssh_all() {
  gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command="$1"
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
    gcloud compute tpus tpu-vm scp /tmp/wus-trainer.tgz "$name":/tmp/ --zone="$zone" --worker=all
    ssh_all "mkdir -p ~/wus-trainer && tar -C ~/wus-trainer -xzf /tmp/wus-trainer.tgz && \
      cd ~/wus-trainer && pip install -e '.[tpu]'"
    ;;
  run)
    [[ "${1:-}" == "--" ]] && shift
    args=$(printf '%q ' "$@")
    # All workers start the same command; their output streams back here.
    ssh_all "cd ~/wus-trainer && python -m trainer $args 2>&1 | tee -a ~/train.log"
    ;;
  delete)
    gcloud compute tpus tpu-vm delete "$name" --zone="$zone" --quiet
    ;;
  *)
    usage
    ;;
esac
