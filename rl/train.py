"""flashpost-train: the Hydra entry point of every training job.

Launch:
    flashpost-train experiment=demo                        # the embedded demo (what `make demo` runs)
    flashpost-train trainer=rl rollout.max_policy_lag=1    # async RL on the toy task set, local Ray, CPU
    flashpost-train trainer=sft tasks=runs/factory/taskset # a factory task set's train demonstrations
    flashpost-train trainer=opd trainer.teacher_checkpoint=runs/x/checkpoints/step-00000400/model.safetensors
    flashpost-train model=small trainer=sft cluster=h200   # one H200
    flashpost-train model=small trainer=rl cluster=ray_cluster   # a Ray cluster (infra/ray/)
    flashpost-train ... dry_run=true                       # validate and print the resolved config

This file only sequences: compose → typed config → run folder → Ray → job → cleanup.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from rl.cluster import apply_local_env, shutdown, start_or_join
from rl.config import JobConfig, register_schemas, to_job_config
from rl.stages import record_run
from synth.taskset import TaskSetError

# An absolute path: Hydra resolves a relative one against the calling module ("rl.train" -> package
# "conf"), which fails when the installed `flashpost-train` script runs outside the repository root.
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
register_schemas()  # typed nodes YAML pulls in by name (conf/experiment/demo.yaml: /schema/demo@demo)


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    job = to_job_config(cfg)
    resolved = OmegaConf.to_yaml(cfg, resolve=True)
    if job.dry_run:
        print(resolved)
        job.model.build_args()  # cross-field checks of the model config run here
        print("[flashpost] dry run: configuration is valid")
        return
    run_dir = Path(job.run_dir)
    record_run(run_dir, resolved)
    apply_local_env()
    handle = start_or_join(job.cluster)
    try:
        _run(job, run_dir, handle.dashboard_url)
    except TaskSetError as e:  # bad task-set input: the message names the fix; no traceback
        raise SystemExit(f"error: {e}") from None
    finally:
        shutdown(handle)


def _run(job: JobConfig, run_dir: Path, dashboard_url: str | None) -> None:
    if job.entry == "demo":
        from rl.demo import run_demo

        run_demo(job, run_dir, dashboard_url)
    elif job.trainer.kind in ("rl", "opd"):
        from rl.rl_loop import run_async

        run_async(job, run_dir)
    else:
        from rl.sft_loop import run_supervised

        run_supervised(job, run_dir)


if __name__ == "__main__":
    main()
