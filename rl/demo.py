"""`make demo`: the product's jobs in a row, each in its own run folder under run_dir, each resumable.

  factory_sample    flashpost-factory build --repo sample            (the bundled sample repository)
  factory_families  flashpost-factory build --source families         (family A: demonstrations, B: tests only)
  tasks             flashpost-factory tasks merge                     -> run_dir/tasks, the one task set
  eval_base         flashpost-eval                                    (the seeded initialisation)
  sft               flashpost-train trainer=sft                       (every train demonstration)
  eval_sft          flashpost-eval checkpoint=sft
  rl                flashpost-train trainer=rl                        (family B, from the SFT policy)
  eval_rl           flashpost-eval checkpoint=rl
  student_sft       flashpost-train trainer=sft, half-width student   (the SFT-only student)
  opd               flashpost-train trainer=opd, from student_sft, teacher rl
  eval_opd, eval_student_sft
  report            rl/demo_report.py from the jobs' own eval.json and metrics.jsonl

Each job is composed from its own primary config (conf/train.yaml, conf/eval.yaml) with the overrides of
`demo:` (rl/demo_config.py) and run through its entry function in this process (Ray is already up), so
its run folder holds what the command line would have written; `commands.md` lists the equivalent
commands. Finished stages are skipped on a rerun (rl/stages.py); a training job killed midway continues
from its last checkpoint. Not here: any training, evaluation or factory code.
"""

from __future__ import annotations

import os

# libgomp's busy-waiting barriers make 2 torch threads 10-50x slower when the 2 cores are shared
# (sandboxes, graders, Ray); passive waiting costs nothing on an idle machine. Set before torch loads
# (rl/train.py imports this module before anything imports torch).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import shutil
from functools import partial
from pathlib import Path

from rl.config import JobConfig
from rl.demo_config import DemoConfig
from rl.stages import StageFn, record_run, run_stage, write_json_atomic

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
TASKS = "tasks/taskset"  # the merged task set, relative to run_dir
# evaluation stage -> the training stage whose checkpoint it scores (None: the seeded initialisation)
EVALS = {"eval_base": None, "eval_sft": "sft", "eval_rl": "rl", "eval_opd": "opd", "eval_student_sft": "student_sft"}
STUDENT_STAGES = ("student_sft", "opd", "eval_opd", "eval_student_sft")


def compose(config_name: str, overrides: list[str]):
    """conf/<config_name>.yaml with `overrides`, as the command line would compose it (also outside
    @hydra.main: tests call the demo directly)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rl.config import register_schemas

    register_schemas()
    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name=config_name, overrides=overrides)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides)


def _record_command(run_dir: Path, stage: str, command: str) -> None:
    with open(run_dir / "commands.md", "a") as f:
        f.write(f"- `{stage}`: `{command}`\n")


def _checkpoint(run_dir: Path, stage: str) -> str:
    """The model.safetensors of training stage `stage`'s latest checkpoint."""
    from rl.evaluate import checkpoint_file

    return str(checkpoint_file(str(run_dir / stage)))


class Demo:
    """The stages of one demo run: `stages()` in order, each `fn(stage_dir) -> summary`."""

    def __init__(self, demo: DemoConfig, run_dir: Path, dashboard_url: str | None = None):
        self.cfg, self.run_dir, self.dashboard_url = demo, Path(run_dir), dashboard_url

    # ------------------------------------------------------------------ factory
    def _factory(self, args: list[str], stage_dir: Path) -> dict:
        from synth import taskset
        from synth.cli import main as factory_main

        _record_command(self.run_dir, stage_dir.name, "flashpost-factory " + " ".join(args))
        rc = factory_main(args)
        if rc != 0:
            raise RuntimeError(f"flashpost-factory {' '.join(args)} exited {rc}; see its output above")
        ts = taskset.load(stage_dir / "taskset")
        return {"tasks": len(ts.tasks), "demonstrations": len(ts.demos), "command": " ".join(args),
                "load": os.getloadavg()[0]}

    def factory_sample(self, stage_dir: Path) -> dict:
        c = self.cfg
        return self._factory(["build", "--repo", "sample", "--out", str(stage_dir), "--budget",
                              str(c.factory_budget), "--seed", str(c.seed)], stage_dir)  # fmt: skip

    def factory_families(self, stage_dir: Path) -> dict:
        c = self.cfg
        return self._factory(["build", "--source", "families", "--out", str(stage_dir), "--budget",
                              str(c.families_budget), "--n-heldout", str(c.families_heldout), "--seed", str(c.seed)],
                             stage_dir)  # fmt: skip

    def merge(self, stage_dir: Path) -> dict:
        from synth import taskset
        from synth.cli import main as factory_main

        sets = [str(self.run_dir / "factory_families" / "taskset")]
        if self.cfg.factory_budget > 0:
            sets.insert(0, str(self.run_dir / "factory_sample" / "taskset"))
        out = stage_dir / "taskset"
        shutil.rmtree(out, ignore_errors=True)  # a merge killed midway left a partial folder
        args = ["tasks", "merge", str(out), *sets]
        _record_command(self.run_dir, stage_dir.name, "flashpost-factory " + " ".join(args))
        if factory_main(args) != 0:
            raise RuntimeError(f"flashpost-factory {' '.join(args)} failed; see its output above")
        ts = taskset.load(out)
        counts: dict[str, int] = {}
        for r in ts.tasks:
            counts[f"{r.family}/{r.split}"] = counts.get(f"{r.family}/{r.split}", 0) + 1
        return {"tasks": len(ts.tasks), "demonstrations": len(ts.demos), "by_family_split": counts,
                "load": os.getloadavg()[0]}

    # ------------------------------------------------------------------ jobs
    def _student(self, stage: str) -> list[str]:
        return list(self.cfg.student) if stage in STUDENT_STAGES else []

    def evaluate(self, stage_dir: Path) -> dict:
        from rl.config import to_eval_config
        from rl.evaluate import evaluate

        source = EVALS[stage_dir.name]
        checkpoint = _checkpoint(self.run_dir, source) if source else "null"
        c = self.cfg
        base = c.eval_base if source is None else []
        overrides = [*c.jobs, *self._student(stage_dir.name), *c.eval, *base, f"samples={c.eval_samples}",
                     f"k={c.eval_samples}", f"tasks={self.run_dir / TASKS}", f"checkpoint={checkpoint}",
                     f"out_dir={stage_dir}", f"++seed={c.seed}", f"++init_seed={c.seed}", f"++rollout.seed={c.seed}"]
        _record_command(self.run_dir, stage_dir.name, "flashpost-eval " + " ".join(overrides))
        report = evaluate(to_eval_config(compose("eval", overrides)))
        self._gauge(stage_dir.name, report)
        return {"overall": report["overall"], "by_family": report["by_family"], "checkpoint": checkpoint,
                "load": os.getloadavg()[0]}  # fmt: skip

    def train(self, stage_dir: Path) -> dict:
        from omegaconf import OmegaConf

        from rl.config import to_job_config

        stage, c = stage_dir.name, self.cfg
        extra, steps = {"sft": (c.sft, c.sft_steps), "rl": (c.rl, c.rl_steps), "opd": (c.opd, c.opd_steps),
                        "student_sft": (c.student_sft, c.student_sft_steps)}[stage]  # fmt: skip
        overrides = [*c.jobs, *c.train, *self._student(stage), *extra, f"++trainer.max_steps={steps}",
                     f"tasks={self.run_dir / TASKS}", f"run_dir={stage_dir}", f"++trainer.seed={c.seed}",
                     f"++rollout.seed={c.seed}"]  # fmt: skip
        if stage == "rl":
            overrides.append(f"++trainer.init_checkpoint={_checkpoint(self.run_dir, 'sft')}")
        if stage == "opd":
            overrides += [f"++trainer.init_checkpoint={_checkpoint(self.run_dir, 'student_sft')}",
                          f"++trainer.teacher_checkpoint={_checkpoint(self.run_dir, 'rl')}",
                          f"+model@trainer.teacher_model={c.teacher_model}"]  # fmt: skip
        _record_command(self.run_dir, stage, "flashpost-train " + " ".join(overrides))
        cfg = compose("train", overrides)
        job = to_job_config(cfg)
        record_run(stage_dir, OmegaConf.to_yaml(cfg, resolve=True))
        if job.trainer.kind in ("rl", "opd"):
            from rl.rl_loop import run_async

            if stage == "rl":
                self._screenshot_later()
            history = run_async(job, stage_dir)
        else:
            from rl.sft_loop import run_supervised

            history = run_supervised(job, stage_dir)
        last = history[-1] if history else {}
        return {"kind": job.trainer.kind, "steps": job.trainer.max_steps, "steps_this_run": len(history),
                "last": {k: v for k, v in last.items() if isinstance(v, (int, float))},
                "checkpoint": _checkpoint(self.run_dir, stage), "load": os.getloadavg()[0]}  # fmt: skip

    def _screenshot_later(self, after_s: float = 90.0) -> None:
        """While RL runs, a headless Chromium screenshot of the dashboard's Actors page (logged in with the
        token) into the report folder; skipped, with a line saying why, without a dashboard or Chromium."""
        import threading

        if not self.dashboard_url or not (shutil.which("chromium") or shutil.which("chromium-browser")):
            print("[demo] no dashboard screenshot: needs the dashboard and Chromium (bash infra/ensure_chromium.sh)")
            return
        out = self.run_dir / "report" / "dashboard_actors.png"

        def shoot() -> None:
            import importlib.util

            path = Path(__file__).resolve().parent.parent / "infra" / "dashboard_screenshot.py"
            spec = importlib.util.spec_from_file_location("dashboard_screenshot", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                module.screenshot(self.dashboard_url, out)
                print(f"[demo] dashboard Actors page while RL runs: {out}", flush=True)
            except Exception as e:  # the screenshot is a view of the run, never a reason to stop it
                print(f"[demo] dashboard screenshot failed: {e}", flush=True)

        timer = threading.Timer(after_s, shoot)
        timer.daemon = True
        timer.start()

    @staticmethod
    def _gauge(stage: str, report: dict) -> None:
        from rl.metrics import DemoGauges

        gauges = DemoGauges()
        for fam, s in report["by_family"].items():
            gauges.held_out(stage, fam, s["pass@1"])

    # ------------------------------------------------------------------ order
    def stages(self) -> list[tuple[str, StageFn]]:
        out: list[tuple[str, StageFn]] = []
        if self.cfg.factory_budget > 0:
            out.append(("factory_sample", self.factory_sample))
        out += [("factory_families", self.factory_families), ("tasks", self.merge), ("eval_base", self.evaluate),
                ("sft", self.train), ("eval_sft", self.evaluate), ("rl", self.train), ("eval_rl", self.evaluate),
                ("student_sft", self.train), ("opd", self.train), ("eval_opd", self.evaluate),
                ("eval_student_sft", self.evaluate)]  # fmt: skip
        return out


def run_demo(job: JobConfig, run_dir: Path, dashboard_url: str | None = None) -> dict:
    """Run (or resume) every stage, then write the report; returns make_report's dict."""
    from rl.demo_report import make_report

    demo = Demo(job.demo, run_dir, dashboard_url)
    print(f"[demo] run folder: {run_dir.resolve()}; the jobs' commands: {run_dir / 'commands.md'}")
    write_json_atomic(run_dir / "demo.json", {"dashboard_url": dashboard_url, "seed": job.demo.seed})
    stages = demo.stages()
    names = [n for n, _ in stages]
    if job.demo.until and job.demo.until not in names:
        raise ValueError(f"demo.until={job.demo.until!r} is not a stage of this demo; stages: {names}")
    for name, fn in stages:
        run_stage(run_dir, name, partial(_fresh_commands, run_dir, name, fn))
        if name == job.demo.until:
            print(f"[demo] stopping after {name} (demo.until)")
            break
    report = make_report(run_dir, run_dir / "report")
    print(f"[demo] held-out pass@1: {report['pass_at_1']}")
    print(f"[demo] report: {report['report']}")
    return report


def _fresh_commands(run_dir: Path, name: str, fn: StageFn, stage_dir: Path) -> dict:
    """Run stage `fn`, keeping commands.md to one line per stage (a rerun of a killed stage replaces its)."""
    path = run_dir / "commands.md"
    if path.exists():
        kept = [ln for ln in path.read_text().splitlines(keepends=True) if not ln.startswith(f"- `{name}`:")]
        path.write_text("".join(kept))
    return fn(stage_dir)
