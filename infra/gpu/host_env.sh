# Sourced by the GPU-host job scripts (run_rl_small.sh, run_demo_small.sh) from the repo root, after they
# set SITE and define `say`: installs the carried .whl wheels into $SITE (once per distinct set), checks
# that Ray, Hydra, DeepSpeed and datasets import, starts (or confirms) the Docker engine and exports the
# environment flashpost's jobs need there (../shared/tools/GPU.md). Returns non-zero, having said why,
# when a step fails. Not here: building the bundles (docker_bundle.sh, gpu-wheels.sh run on the dev machine).
WHEELS=$(ls .whl/*.whl 2>/dev/null | sort | md5sum | cut -c1-12)
if [[ -d .whl && "$(cat "$SITE/.whl-installed" 2>/dev/null)" != "$WHEELS" ]]; then
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl \
        && echo "$WHEELS" > "$SITE/.whl-installed" || { say "installing .whl failed"; return 1; }
fi
PYTHONPATH=$SITE python3 -c "import hydra, ray, deepspeed, datasets" 2>/dev/null \
    || { say "no Ray/Hydra/DeepSpeed/datasets in $SITE: carry .whl (bash ../shared/tools/gpu-wheels.sh builds the" \
             "first three; synth/taskset.py writes task sets with datasets: pip download datasets dill multiprocess" \
             "--no-deps --only-binary=:all: --python-version 3.12 -d .whl)"; return 1; }
GPU_DOCKER_SMOKE=0 bash infra/gpu/start_docker.sh || { say "Docker engine did not start"; return 1; }
export PYTHONPATH=$SITE:$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
