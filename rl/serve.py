"""flashpost-serve: the Hydra entry point of the OpenAI-compatible policy server.

Launch:
    flashpost-serve                                          # tiny model, seeded weights, 127.0.0.1:8000
    flashpost-serve model=small checkpoint=runs/x/checkpoints/step-00000400/model.safetensors serve.port=8001
    flashpost-serve serve.model_name=policy serve.max_pending=64 serve.decode_chunk=0
    flashpost-serve ... dry_run=true                         # validate and print the resolved config
Then any OpenAI client: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")`; add
`extra_body={"session_id": ...}` for token-exact multi-turn sessions (GET /v1/sessions/{id}).

This file only sequences: compose -> typed config -> model and engine -> uvicorn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from rl.config import ModelChoice
from rl.serve_engine import ServeConfig

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@dataclass(kw_only=True)
class ServeJobConfig:
    """Root of `flashpost-serve` (conf/serve.yaml)."""

    model: ModelChoice = field(default_factory=ModelChoice)
    checkpoint: str | None = None  # model.safetensors (or a folder of them); None = seeded initialisation
    policy_version: int = 0  # the version the loaded weights are served as
    seed: int = 0
    serve: ServeConfig = field(default_factory=ServeConfig)
    dry_run: bool = False


def build_server(job: ServeJobConfig):
    """The `Server` of a job: model (checkpoint loaded), engine on cuda when present, conversations."""
    import torch

    from model.engine import InferenceEngine
    from rl.actors import build_model
    from rl.serve_app import Server

    model, template = build_model(job.model, seed=job.seed)
    if job.checkpoint:
        from model.checkpoint import load_checkpoint

        load_checkpoint(model, job.checkpoint)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = InferenceEngine(model, template, max_sessions=job.serve.max_sessions, device=device,
                             prefill_mode=job.serve.prefill_mode)  # fmt: skip
    if job.policy_version:  # the engine stamps tokens with the version its last load_state_dict gave
        engine.load_state_dict(engine.model.state_dict(), job.policy_version)
    return Server(engine, template, job.serve)


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="serve_schema", node=ServeJobConfig)


_register_schema()


@hydra.main(config_path=CONF_DIR, config_name="serve", version_base="1.3")
def main(cfg: DictConfig) -> None:
    job: ServeJobConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ServeJobConfig), cfg))
    if job.dry_run:
        print(OmegaConf.to_yaml(cfg, resolve=True))
        job.model.build_args()
        print("[flashpost] dry run: configuration is valid")
        return
    import uvicorn

    from rl.serve_app import build_app

    server = build_server(job)
    print(f"[flashpost] serving {job.serve.model_name!r} on http://{job.serve.host}:{job.serve.port}/v1")
    try:
        uvicorn.run(build_app(server), host=job.serve.host, port=job.serve.port, log_level="warning")
    finally:
        server.loop.close()


if __name__ == "__main__":
    main()
