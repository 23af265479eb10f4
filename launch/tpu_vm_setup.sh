#!/bin/bash
# Prepare one TPU VM worker for scalestudy: code, virtual environment, JAX for TPU.
# Usage: gcloud compute tpus tpu-vm scp launch/tpu_vm_setup.sh NAME: --zone ZONE --worker=all
#        gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all \
#          --command "REPO_URL=<your clone URL> bash tpu_vm_setup.sh"
set -euo pipefail
REPO_URL=${REPO_URL:?set REPO_URL to the scalestudy git repository}
REPO_DIR=${REPO_DIR:-$HOME/scalestudy}
if [ ! -d "$REPO_DIR/.git" ]; then
  git clone "$REPO_URL" "$REPO_DIR"
fi
cd "$REPO_DIR"
git pull --ff-only
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e .
.venv/bin/pip install -q "jax[tpu]"
.venv/bin/python -c "import jax; print(jax.process_index(), jax.device_count())"
