#!/usr/bin/env bash
# The demo pipeline (`flashpost-train experiment=demo`) with `model=small` on the lent H200.
#
# Run from the repo root on the GPU host, in calls made back to back (the machine is handed back
# after 30 s idle), carrying the git-ignored bundles once each while it stays warm:
#   1. carry .gpu-docker-image   (infra/gpu/docker_bundle.sh: the sandbox base image)
#   2. carry .gpu-docker         `bash infra/gpu/start_docker.sh` (engine up, image loaded)
#   3. carry .whl                `bash infra/gpu/run_demo_small.sh`  (../shared/tools/gpu-wheels.sh: Ray,
#                                Hydra, DeepSpeed for Python 3.12; plus datasets, dill and multiprocess
#                                for the factory stage, see the check below)
#   4. (if 3 hit the call limit) `bash infra/gpu/run_demo_small.sh` again: the stages resume.
# What it does: installs .whl into /tmp/site once, starts (or confirms) the Docker engine, runs the
# demo into $RUN_DIR (default /tmp/demo-small, outside the copied tree so a later call finds it) for at
# most $DEMO_TIMEOUT_S seconds (default 500: with the 30 s kill grace and the copy it stays inside one
# 600 s call), then packs every stage's done.json, the logs and report/ into $OUT/demo-small.tgz (one
# file: the device tool returns only so many) and copies report.md beside it.
# The demo's step budgets are the defaults (rl/demo_config.py); extra arguments are Hydra overrides
# (e.g. demo.rl_steps=40). Not yet run on the H200 with the chained jobs.
set -uo pipefail
SITE=${GPU_DOCKER_SITE:-/tmp/site}
RUN_DIR=${RUN_DIR:-/tmp/demo-small}
OUT=${OUT:-/tmp/demo-small-out}
mkdir -p "$SITE" "$RUN_DIR" "$OUT"
say() { echo "[run_demo_small] $*" >&2; }

source infra/gpu/host_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader >&2 || true
t0=$(date +%s)
# every job of the chain gets model=small (the student at half width, the OPD teacher small) and the
# training jobs cluster=h200 (their actors' GPU shares)
timeout -s INT -k 30 "${DEMO_TIMEOUT_S:-500}" python3 -m rl.train experiment=demo cluster=h200 \
    run_dir="$RUN_DIR" demo.teacher_model=small \
    'demo.jobs=["model=small","++rollout.prefill_mode=ced","++rollout.max_turns=4"]' \
    'demo.train=["cluster=h200","++trainer.simulate_replay=true","++env.max_concurrent=32"]' \
    'demo.student=["++model.overrides.dim=512","++model.overrides.moe_inter_dim=256"]' \
    "$@" 2>&1 | tee -a "$RUN_DIR/demo.log"
rc=${PIPESTATUS[0]}
say "demo exit code $rc after $(( $(date +%s) - t0 )) s (124: the time limit; run again to resume)"
nvidia-smi --query-gpu=memory.used --format=csv,noheader >&2 || true
tar czf "$OUT/demo-small.tgz" -C "$RUN_DIR" --exclude='*.safetensors' --exclude='*.pt' . || say "packing failed"
[[ -f $RUN_DIR/report/report.md ]] && cp "$RUN_DIR/report/report.md" "$OUT/"
exit "$rc"
