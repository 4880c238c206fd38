#!/usr/bin/env bash
# One RL job (`flashpost-train trainer=rl tasks=fixtures model=small cluster=h200`) on the lent H200,
# with the V4.1 rollout path at its defaults (CED prefill, prefix cache, DSpark speculation, simulated
# replay in the learner; multi-turn agent episodes in hardened Docker sandboxes of the fixture tasks).
#
# Run from the repo root on the GPU host, after the bundles are there (infra/gpu/README.md):
#   1. carry .gpu-docker-image and .gpu-docker (together when both fit in one call, else one each),
#      command: `bash infra/gpu/start_docker.sh`
#   2. carry .whl (../shared/tools/gpu-wheels.sh: Ray, Hydra, DeepSpeed; plus datasets, dill and
#      multiprocess, which writing the shipped task set needs: see the check below), command:
#      `bash infra/gpu/run_rl_small.sh LABEL [hydra overrides...]`, e.g.
#      `bash infra/gpu/run_rl_small.sh spec && bash infra/gpu/run_rl_small.sh plain rollout.speculative=false`
# What it does: installs .whl into /tmp/site once, starts (or confirms) the Docker engine, builds the
# fixture task images from the base image (envs/fixtures/build.py; cached by content), runs the job into
# $RUN_ROOT/LABEL for at most $RL_TIMEOUT_S seconds (default 240) and copies its metrics.jsonl and the
# log's tail to $OUT/LABEL-metrics.jsonl and $OUT/LABEL.log (what the device tool brings back).
# Sizes: $RL_STEPS learner updates (default 3); the rest of the job is conf/ at cluster=h200 (2 groups of
# 8 episodes per update, up to 4 turns of 64 new tokens), plus env.max_concurrent=16 sandboxes. Extra
# arguments are Hydra overrides appended last (e.g. ++model.overrides.impl=triton for the Triton kernels
# and the engine's CUDA-graph decode; figures in docs/h200_rl.md).
# What it does not do: build the bundles (docker_bundle.sh, gpu-wheels.sh run on the dev machine).
set -uo pipefail
[[ $# -ge 1 ]] || { echo "usage: bash infra/gpu/run_rl_small.sh LABEL [hydra overrides...]" >&2; exit 2; }
LABEL=$1; shift
ROOT=$(pwd)
SITE=${GPU_DOCKER_SITE:-/tmp/site}
RUN_ROOT=${RUN_ROOT:-/tmp/rl-small}
OUT=${OUT:-/tmp/rl-small-out}
mkdir -p "$SITE" "$RUN_ROOT" "$OUT"
say() { echo "[run_rl_small] $*" >&2; }

WHEELS=$(ls .whl/*.whl 2>/dev/null | sort | md5sum | cut -c1-12)
if [[ -d .whl && "$(cat "$SITE/.whl-installed" 2>/dev/null)" != "$WHEELS" ]]; then
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl \
        && echo "$WHEELS" > "$SITE/.whl-installed" || { say "installing .whl failed"; exit 1; }
fi
PYTHONPATH=$SITE python3 -c "import hydra, ray, deepspeed, datasets" 2>/dev/null \
    || { say "no Ray/Hydra/DeepSpeed/datasets in $SITE: carry .whl (bash ../shared/tools/gpu-wheels.sh builds the" \
             "first three; synth/taskset.py writes task sets with datasets: pip download datasets dill multiprocess" \
             "--no-deps --only-binary=:all: --python-version 3.12 -d .whl)"; exit 1; }
GPU_DOCKER_SMOKE=0 bash infra/gpu/start_docker.sh || { say "Docker engine did not start"; exit 1; }

export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 -m envs.fixtures.build > /dev/null || { say "building the fixture task images failed"; exit 1; }
say "fixture task images ready in $(( $(date +%s) - t0 )) s"
RUN_DIR=$RUN_ROOT/$LABEL
rm -rf "$RUN_DIR"
t0=$(date +%s)
timeout -s INT -k 20 "${RL_TIMEOUT_S:-240}" python3 -m rl.train trainer=rl tasks=fixtures model=small cluster=h200 \
    run_dir="$RUN_DIR" trainer.max_steps="${RL_STEPS:-3}" ++env.max_concurrent=16 "$@" > "$RUN_ROOT/$LABEL.log" 2>&1
rc=$?
say "$LABEL: exit code $rc after $(( $(date +%s) - t0 )) s (124: the time limit)"
nvidia-smi --query-gpu=memory.used --format=csv,noheader >&2 || true
tail -c 60000 "$RUN_ROOT/$LABEL.log" > "$OUT/$LABEL.log"
[[ -f $RUN_DIR/metrics.jsonl ]] && cp "$RUN_DIR/metrics.jsonl" "$OUT/$LABEL-metrics.jsonl"
grep -E "Error|error:|Traceback" "$RUN_ROOT/$LABEL.log" | tail -5 >&2
exit "$rc"
