"""The main job behind `make demo`, as far as the pipeline exists today.

Stages run in order and resume from their outputs (`rl/stages.py`):
  sandbox_check  fixture task images are built, each task's gold patch is graded in a fresh
                 hardened grader container (reward 1) and so is an empty patch (reward 0);
  families       the demo task families (synth/families.py): family A with demonstrations, family B
                 with tests only, train and held-out instances, one image of real envs Tasks;
  eval_base, sft, eval_sft, rl, eval_rl
                 the demo policy (`tiny` with rl.demo_learning.DEMO_OVERRIDES; V4.1 mHC, MoE,
                 compressor/indexer and QAT on) is SFT'd on family A, then GRPO'd on family B with
                 rewards from warm grader containers; greedy held-out pass@1 on both families after
                 each (rl/demo_stages.py);
  report         report.md + PNG plots in run_dir/report (rl/demo_report.py).
`model_check` (a smoke of the `tiny` flavor itself inside a Ray task) is kept as a function for
callers that want it. OPD and DSpark are later stages; the demo prints that they are not built yet
rather than pretending. Not here: the learning loops (rl/demo_learning.py).
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

from rl.config import JobConfig
from rl.demo_stages import DemoConfig, eval_stage, families_stage, rl_stage, sft_stage
from rl.stages import run_stage

NOT_BUILT_YET = (
    ("factory", "tasks from the sample repository by the LLM factory (the demo uses synth/families today)"),
    ("dspark", "DSpark drafter trained alongside SFT, acceptance over training"),
    ("async", "asynchronous RL with rollouts in agent sandboxes (the demo's GRPO is synchronous)"),
    ("opd", "on-policy distillation of a smaller student"),
)


def sandbox_check(stage_dir: Path) -> dict:
    from envs.fixtures.build import fixture_tasks
    from envs.grading import grade_patch

    results = {}
    for task in fixture_tasks(build=True):
        gold = grade_patch(task, task.gold_patch)
        empty = grade_patch(task, "")
        results[task.task_id] = {"gold": gold.reward, "empty": empty.reward, "grade_s": round(gold.duration_s, 2)}
        print(f"  {task.task_id}: gold patch → {gold.reward:.0f}, empty patch → {empty.reward:.0f} "
              f"({gold.duration_s:.1f} s per grading)")
        if gold.reward != 1.0 or empty.reward != 0.0:
            raise RuntimeError(f"grading is broken on {task.task_id}: gold {gold.reason!r}, empty {empty.reason!r}")
    return results


def _training_text() -> list[str]:
    from envs.fixtures.build import repo_files

    return [body.decode(errors="replace") for name, body in repo_files().items() if name.endswith(".py")]


def train_tiny(flavor: str, steps: int, seq_len: int, lr: float, out_path: str) -> dict:
    """A few AdamW steps of a flavor on chat-rendered fixture sources; runs inside a Ray task."""
    import torch
    from tqdm import tqdm

    from model.chat_template import ChatTemplate
    from model.checkpoint import save_checkpoint
    from model.config import get_flavor
    from model.engram import EngramHasher
    from model.tokenizer import Tokenizer
    from model.transformer import Transformer
    from rl.config import OptimConfig
    from rl.optim import build_optimizer

    torch.manual_seed(0)
    args = get_flavor(flavor)
    tok = Tokenizer.default()
    template = ChatTemplate(tok)
    ids, mask = [], []
    for text in _training_text():
        chat = template.render([{"role": "user", "content": "Show me a module."},
                                {"role": "assistant", "content": text}])
        ids += chat.token_ids
        mask += chat.loss_mask
    ids_t = torch.tensor(ids[: (len(ids) // seq_len) * seq_len]).view(-1, seq_len)
    mask_t = torch.tensor(mask[: ids_t.numel()]).view(-1, seq_len)
    model = Transformer(args, engram_hasher=EngramHasher(args, tok) if args.engram_layer_ids else None)
    model.init_weights(seed=0)
    # per-family optimisers (Muon / Sinkhorn-balanced momentum / AdamW); the Engram table's sparse
    # gradients rule out a plain AdamW
    opt = build_optimizer(model, OptimConfig(lr=lr, sinkhorn_lr=lr))
    losses, n_tokens, t0 = [], 0, time.perf_counter()
    for step in tqdm(range(steps), desc=f"{flavor} steps", unit="step"):
        row = step % ids_t.size(0)
        x, m = ids_t[row : row + 1], mask_t[row : row + 1]
        out = model(x)
        logp = torch.log_softmax(out.logits[:, :-1], -1)
        nll = -logp.gather(-1, x[:, 1:, None]).squeeze(-1)
        loss = (nll * m[:, 1:]).sum() / m[:, 1:].sum().clamp(min=1) + out.indexer_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        n_tokens += x.numel()
    seconds = time.perf_counter() - t0
    save_checkpoint(model, out_path)
    k = max(1, steps // 5)
    return {"flavor": flavor, "steps": steps, "first_loss": sum(losses[:k]) / k, "last_loss": sum(losses[-k:]) / k,
            "tokens_per_s": n_tokens / seconds, "checkpoint": out_path, "n_rows": int(ids_t.size(0))}


def model_check(stage_dir: Path) -> dict:
    import ray

    task = ray.remote(num_cpus=1)(train_tiny)
    summary = ray.get(task.remote("tiny", 40, 256, 2e-3, str((stage_dir / "tiny.safetensors").resolve())))
    print(f"  tiny: loss {summary['first_loss']:.3f} → {summary['last_loss']:.3f} over {summary['steps']} steps, "
          f"{summary['tokens_per_s']:.0f} tokens/s; weights in {summary['checkpoint']}")
    if not summary["last_loss"] < summary["first_loss"]:
        raise RuntimeError(f"the tiny model's loss did not fall: {summary}")
    return summary


def run_demo(job: JobConfig, run_dir: Path, demo: DemoConfig | None = None) -> None:
    from rl.demo_report import make_report

    demo = demo or DemoConfig()
    print(f"[demo] run folder: {run_dir.resolve()}")
    run_stage(run_dir, "sandbox_check", sandbox_check)
    run_stage(run_dir, "families", partial(families_stage, demo))
    run_stage(run_dir, "eval_base", partial(eval_stage, demo, run_dir, None))
    run_stage(run_dir, "sft", partial(sft_stage, demo, run_dir))
    run_stage(run_dir, "eval_sft", partial(eval_stage, demo, run_dir, "sft/policy.safetensors"))
    run_stage(run_dir, "rl", partial(rl_stage, demo, run_dir))
    run_stage(run_dir, "eval_rl", partial(eval_stage, demo, run_dir, "rl/policy.safetensors"))
    report = make_report(run_dir, run_dir / "report")
    print(f"[demo] held-out pass@1: {report['pass_at_1']}")
    print(f"[demo] report: {report['report']}")
    print("[demo] stages of the full pipeline not built yet:")
    for name, what in NOT_BUILT_YET:
        print(f"  - {name}: {what}")
