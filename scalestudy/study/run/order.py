"""The main job's whole order, in one place: `scalestudy study` runs a spec through

1. the learning-rate search and the pretraining runs, the fits and the report
   (`main_job.run_study`);
2. the decoder-only experiments, when the spec has `experiments:` (given as `experiments` by
   the command: decoder_only/ sits above study/ in the flow of imports, so study/ calls it
   without importing it);
3. the stages after pretraining, when the spec has `stages:` (`after_pretraining`): collected
   with `collect` (never trained), planned only with `dry_run`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from scalestudy.study.record.phases import phase
from scalestudy.study.run import after_pretraining, executors, main_job

# (study, its planned runs, the study directory) -> None
Experiments = Callable[[Any, list, Path], None]


def run_main_job(
    spec: Path,
    out: Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    dry_run: bool = False,
    collect: bool = False,
    workers: int = 1,
    experiments: Experiments | None = None,
) -> None:
    """Run (or resume) the study of `spec` in `out`, every step the spec asks for, in order."""
    study, runs = main_job.run_study(
        spec, out, overrides, dry_run, collect=collect, workers=workers
    )
    if not dry_run and study.experiments is not None and experiments is not None:
        with phase("experiments"):
            experiments(study, runs, Path(out))
    if study.stages is not None:
        _stages(study, Path(spec).parent, Path(out), runs, dry_run=dry_run, collect=collect)


def _stages(study: Any, spec_dir: Path, out: Path, runs: list, *, dry_run: bool, collect: bool):
    """A study's stages after its pretraining runs: collected (never trains) or run
    (adaptation and finetuning; a plan only with `dry_run`)."""
    if collect:
        if missing := after_pretraining.collect(study, spec_dir, out, runs):
            raise executors.StudyRunError(
                f"{len(missing)} stage run(s) are not complete (listed above); collecting "
                "never trains: re-submit their jobs, then collect again"
            )
        return
    with phase("stages", plain=False if dry_run else None):  # a plan: no phase
        after_pretraining.run_stages(study, spec_dir, out, runs, dry_run=dry_run)
