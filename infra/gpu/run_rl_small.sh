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
# Sizes: $SFT_STEPS steps of SFT first (default 0: none; see below), $RL_STEPS learner updates (default 3); the rest of the job is conf/ at cluster=h200 (2 groups of
# 8 episodes per update, up to 4 turns of 64 new tokens), plus env.max_concurrent=16 sandboxes. Extra
# arguments are Hydra overrides appended last (e.g. ++model.overrides.impl=triton for the Triton kernels
# and the engine's CUDA-graph decode, whose layers then compile per batch bucket, minutes each the
# first time: add rollout.compile_decode=false to a short timed run; figures in docs/h200_rl.md).
# What it does not do: build the bundles (docker_bundle.sh, gpu-wheels.sh run on the dev machine).
set -uo pipefail
[[ $# -ge 1 ]] || { echo "usage: bash infra/gpu/run_rl_small.sh LABEL [hydra overrides...]" >&2; exit 2; }
LABEL=$1; shift
SITE=${GPU_DOCKER_SITE:-/tmp/site}
RUN_ROOT=${RUN_ROOT:-/tmp/rl-small}
OUT=${OUT:-/tmp/rl-small-out}
mkdir -p "$SITE" "$RUN_ROOT" "$OUT"
say() { echo "[run_rl_small] $*" >&2; }

source infra/gpu/host_env.sh || exit 1
t0=$(date +%s)
python3 -m envs.fixtures.build > /dev/null || { say "building the fixture task images failed"; exit 1; }
say "fixture task images ready in $(( $(date +%s) - t0 )) s"
# SFT_STEPS > 0: first `trainer=sft` on the fixtures' demonstrations, and RL starts from its checkpoint. Seeded
# weights solve nothing, so every group scores 0 and GRPO skips every update (zero spread); a policy that has
# seen the gold patches passes some episodes at T = 0.7 and not others, so the learner trains.
INIT=()
if (( ${SFT_STEPS:-0} > 0 )); then
    SFT_DIR=$RUN_ROOT/$LABEL-sft
    rm -rf "$SFT_DIR"
    t0=$(date +%s)
    timeout -s INT -k 20 "${SFT_TIMEOUT_S:-200}" python3 -m rl.train trainer=sft tasks=fixtures model=small cluster=h200 \
        run_dir="$SFT_DIR" trainer.max_steps="$SFT_STEPS" trainer.checkpoint_every="$SFT_STEPS" \
        ++trainer.batch_size=6 ++trainer.optim.compile_muon=false "$@" > "$RUN_ROOT/$LABEL-sft.log" 2>&1
    rc=$?
    say "$LABEL-sft: exit code $rc after $(( $(date +%s) - t0 )) s"
    tail -c 20000 "$RUN_ROOT/$LABEL-sft.log" > "$OUT/$LABEL-sft.log"
    [[ -f $SFT_DIR/metrics.jsonl ]] && cp "$SFT_DIR/metrics.jsonl" "$OUT/$LABEL-sft-metrics.jsonl"
    (( rc == 0 )) || exit "$rc"
    INIT=("++trainer.init_checkpoint=$SFT_DIR/checkpoints/$(cat "$SFT_DIR/checkpoints/latest")/model.safetensors")
fi
RUN_DIR=$RUN_ROOT/$LABEL
rm -rf "$RUN_DIR"
t0=$(date +%s)
timeout -s INT -k 20 "${RL_TIMEOUT_S:-240}" python3 -m rl.train trainer=rl tasks=fixtures model=small cluster=h200 \
    run_dir="$RUN_DIR" trainer.max_steps="${RL_STEPS:-3}" ++env.max_concurrent=16 "${INIT[@]}" "$@" \
    > "$RUN_ROOT/$LABEL.log" 2>&1
rc=$?
say "$LABEL: exit code $rc after $(( $(date +%s) - t0 )) s (124: the time limit)"
nvidia-smi --query-gpu=memory.used --format=csv,noheader >&2 || true
tail -c 60000 "$RUN_ROOT/$LABEL.log" > "$OUT/$LABEL.log"
[[ -f $RUN_DIR/metrics.jsonl ]] && cp "$RUN_DIR/metrics.jsonl" "$OUT/$LABEL-metrics.jsonl"
grep -E "Error|error:|Traceback" "$RUN_ROOT/$LABEL.log" | tail -5 >&2
exit "$rc"
