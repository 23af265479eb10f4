"""The end of a study: its scaling fits and figures (`study/report/fits.py`), then report.md/.html.

The page opens with the answer (`study/report/answer.py`: what is compared, where, and the verdict
table of `study/report/verdicts.py`), the figure of the answer's metric under it, and what the study
cannot tell; then how to read it, every verdict in full, the fits, the figures and the runs.
Validation loss is compared only within an objective, zero-shot probe accuracy across every
cell; every verdict takes the run as the unit (`scaling/intervals.run_difference`).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy.stats import t as student_t

from scalestudy.config.errors import ScalestudyError
from scalestudy.evaluate.fewshot import in_context_tasks
from scalestudy.scaling import render
from scalestudy.study.plan.spec import StudySpec
from scalestudy.study.record.phases import phase
from scalestudy.study.record.registry import FILE_NAME as REGISTRY_FILE
from scalestudy.study.record.rows import RunRow, read_curves, read_planned
from scalestudy.study.report import (
    answer,
    comparisons,
    incontext,
    lr_report,
    task_law_report,
    verdicts,
)
from scalestudy.study.report import loss_tokens as loss_token_report
from scalestudy.study.report.fits import fit_study, fits_lines
from scalestudy.study.report.host import host_line
from scalestudy.study.report.verdicts import Comparison

Z95 = 1.959964


def probe_accuracy(run: RunRow) -> tuple[float, float] | None:
    """(accuracy, number of examples) over every evaluated task's `acc`, example-weighted."""
    hits, total = _task_total(run, "acc", weighted=True)
    return (hits / total, total) if total else None


def _task_total(run: RunRow, metric: str, weighted: bool) -> tuple[float, float]:
    """(sum over zero-shot tasks of metric, or of metric x examples when `weighted`;
    examples). A task scored with demonstrations (`<task>.<K>shot` rows and its `<task>` row)
    is the in-context section's."""
    value = total = 0.0
    in_context = in_context_tasks(run.evals)
    for key, x in run.evals.items():
        parts = key.split("/")  # eval/<task>/<metric>; deeper keys are breakdowns
        if len(parts) == 3 and parts[2] == metric and x is not None:
            if parts[1] in in_context:
                continue
            n = run.evals.get(key[: -len(metric)] + "n") or 1.0
            value += x * n if weighted else x
            total += n
    return value, total


def chance_accuracy(runs: list[RunRow]) -> float | None:
    """Probe accuracy of a uniform random guess (example-weighted like `probe_accuracy`)."""
    for run in runs:
        hits, total = _task_total(run, "chance", weighted=True)
        if total:
            return hits / total
    return None


def truncated_share(runs: list[RunRow]) -> tuple[float, float] | None:
    """(most examples any run had to cut from the left to fit its input length, examples)."""
    shares = [_task_total(r, "truncated", weighted=False) for r in runs]
    shares = [(cut, n) for cut, n in shares if n]
    return max(shares) if shares else None


def acc_stats(rows: list[RunRow]) -> dict[str, Any]:
    """Mean probe accuracy over seeds and its 95% t half-width over them (n - 1 degrees of
    freedom; None for one seed). The run is the unit: a run's accuracy is its mean over the
    examples every seed scores, so their noise is in the seeds' spread and not added again."""
    points = [pa[0] for r in rows if (pa := probe_accuracy(r))]
    if not points:
        return {"mean": math.nan, "half": None, "n": 0}
    n = len(points)
    mean = sum(points) / n
    if n < 2:
        return {"mean": mean, "half": None, "n": n}
    var = sum((acc - mean) ** 2 for acc in points) / (n - 1)
    return {"mean": mean, "half": float(student_t.ppf(0.975, n - 1)) * math.sqrt(var / n), "n": n}


def limits(
    study: StudySpec,
    cmp: Comparison,
    runs: list[RunRow],
    fits: dict[str, Any],
    rate_records: list[dict[str, Any]] = (),
) -> list[str]:
    """What the study cannot tell: the scale and budget its verdicts hold at, how many runs
    stand behind each point, which of its laws are flagged, and what its learning-rate search
    left open (`rate_records`: `lr_report.load`'s)."""
    done = [r for r in runs if r.status == "done" and r.params_total]
    if not done:
        return []
    per_point = defaultdict(int)
    for r in done:
        per_point[(r.cell, r.size, r.budget)] += 1
    out = [
        "## What this study cannot tell",
        "",
        _scale_line(done),
        f"- Runs per point: {min(per_point.values())} to {max(per_point.values())}. "
        '"Not distinguishable" is not "equal": a difference smaller than the run-to-run '
        "spread needs more runs to resolve.",
    ]
    if cmp.not_scaling:
        out.append(
            f"- Validation loss does not fall at every step up the ladder in "
            f"{', '.join(cmp.not_scaling)}."
        )
    out += _flagged_laws_line(fits)
    if not study.lr_search:
        out.append(
            "- Learning rates were set in the spec, not searched: a cell trained away from its "
            "best rate is handicapped in every comparison (add `lr_search`)."
        )
    out += lr_report.cannot_tell(list(rate_records), runs)
    return [*out, ""]


def _scale_line(done: list[RunRow]) -> str:
    """The limits' scale item: the finished runs' sizes, steps and tokens per parameter."""
    n = [float(r.params_total) for r in done]
    ratio = [r.tokens / r.params_total for r in done if r.tokens]
    # Chinchilla's 20 counts every parameter; many ladders count non-embedding ones.
    ratio_ne = [
        r.tokens / r.params_non_embedding for r in done if r.tokens and r.params_non_embedding
    ]
    return (
        f"- Scale: {min(n):.3g} to {max(n):.3g} total parameters, "
        f"{min(r.steps or 0 for r in done)} to {max(r.steps or 0 for r in done)} "
        "steps"
        + (f", {min(ratio):.3g} to {max(ratio):.3g} tokens per total parameter" if ratio else "")
        + (
            f" ({min(ratio_ne):.3g} to {max(ratio_ne):.3g} per non-embedding parameter)"
            if ratio_ne
            else ""
        )
        + ". The verdicts hold at these sizes and this budget; which cell is best can change "
        "with scale, so read the fits below for trends, not for answers far beyond the runs."
    )


def _flagged_laws_line(fits: dict[str, Any]) -> list[str]:
    """The limits' laws item, where any fitted law is flagged (none otherwise)."""
    laws = [
        (cell, law, fit.get("flags") or [])
        for cell, c in (fits.get("cells") or {}).items()
        for law, fit in (c.get("fits") or {}).items()
        if "formula" in fit
    ]
    if flagged := [(c, law, f) for c, law, f in laws if f]:
        kinds = sorted({flag.split(":")[0] for _, _, f in flagged for flag in f})
        return [
            f"- Laws: {len(flagged)} of {len(laws)} fitted laws are flagged ({', '.join(kinds)}; "
            "the fits section says why): read their exponents as this ladder's, not as laws."
        ]
    return []


def _runs_table(runs: list[RunRow]) -> list[str]:
    head = ["cell", "size", "d_model", "layers", "N total", "N non-emb", "steps", "tokens"]
    head += ["FLOPs", "val loss", "probe acc", "status"]
    rows = []
    for r in sorted(runs, key=lambda r: (r.size_index, r.arch, r.objective, r.seed or 0)):
        depth = r.n_layers
        if r.n_encoder_layers:
            depth = f"{r.n_encoder_layers}+{r.n_layers}"
        acc = probe_accuracy(r)
        rows.append(
            [
                r.cell,
                r.size,
                r.d_model,
                depth,
                render.num(r.params_total, ".3g"),
                render.num(r.params_non_embedding, ".3g"),
                r.steps,
                render.num(r.tokens, ".3g"),
                render.num(r.flops, ".2e"),
                render.num(r.loss, ".4f"),
                render.num(acc[0] if acc else None, ".3f"),
                r.status,
            ]
        )
    return render.table(head, rows)


@dataclass(frozen=True)
class ReportInputs:
    """Everything the sections of the page read, computed once (`ReportInputs.of`).

    `runs`: the planned runs, finished or not. `cmp`: `answer.compare` of them. `fits`: the
    study's fits (`fit_study`), `figures` their paths relative to `out` and `notes` why there
    are none. `out`: the report's folder; None (a page from its parts alone) leaves out the
    sections that read or write files there. `loss_tokens`: cell -> mean loss-bearing tokens
    per example, or why it was not measured (`loss_tokens.per_cell`). `left_out`: a sentence
    naming the registry's runs that the spec does not plan. `rate_records`: the learning-rate
    search's choice records (`lr_report.load`)."""

    study: StudySpec
    runs: list[RunRow]
    cmp: Comparison
    fits: dict[str, Any] = field(default_factory=dict)
    figures: list[str] = ()
    notes: list[str] = ()
    out: Path | None = None
    loss_tokens: dict[str, float | str] | None = None
    left_out: str = ""
    rate_records: list[dict[str, Any]] = ()

    @classmethod
    def of(cls, study: StudySpec, runs: list[RunRow], **parts: Any) -> ReportInputs:
        """The inputs of `study`'s page over `runs`, comparing them once; `parts`: the other
        fields."""
        return cls(study, runs, answer.compare(runs, tolerance=study.match_tolerance), **parts)

    @property
    def done(self) -> list[RunRow]:
        """The finished runs."""
        return [r for r in self.runs if r.status == "done"]

    @property
    def n_what(self) -> str:
        """What the comparisons' N counts, in words."""
        if self.cmp.n_key == "params_total":
            return "total parameters"
        return "non-embedding parameters"


def render_markdown(
    study: StudySpec,
    runs: list[RunRow],
    fits: dict[str, Any],
    figures: list[str],
    notes: list[str] = (),
    **parts: Any,
) -> str:
    """The report as Markdown from its parts (`ReportInputs`' fields; without `out`, the
    sections that read or write the report's folder are left out): `page` of them."""
    return page(ReportInputs.of(study, runs, fits=fits, figures=figures, notes=notes, **parts))


def page(inputs: ReportInputs) -> str:
    """The report as Markdown: every section of `SECTIONS` in order, joined once. First the
    answer (a verdict table, the frontier figure, what the study cannot tell), then how the
    rates were chosen, every verdict in full, the fits and the runs, then the per-task,
    BLiMP and MoE sections."""
    return "\n".join(line for section in SECTIONS for line in section(inputs))


def answer_section(inputs: ReportInputs) -> list[str]:
    """The report's title, what ran, the host, the verdict table and the frontier figure."""
    study, cmp, runs = inputs.study, inputs.cmp, inputs.runs
    wall = sum(r.wall_time_s or 0.0 for r in runs)
    flops = sum(r.flops or 0.0 for r in runs)
    frontier = [f for f in inputs.figures if Path(f).stem == "answer"]
    return [
        f"# Study `{study.name}`",
        "",
        study.description.strip() or "",
        "",
        f"{cmp.n_done} of {cmp.n_runs} runs finished; matching mode "
        f"`{study.matching}`; {flops:.3e} training FLOPs; {wall / 60:.1f} min of "
        f"training.{inputs.left_out}",
        "",
        host_line(),
        "",
        *verdicts.answer(cmp, inputs.n_what),
        *[
            f"![the answer's metric, probe accuracy, against training compute; chance dotted; "
            f"the points the rows are read at ringed]({f})"
            for f in frontier
        ],
        "",
    ]


def limits_section(inputs: ReportInputs) -> list[str]:
    """What the study cannot tell (`limits`)."""
    i = inputs
    return limits(i.study, i.cmp, i.runs, i.fits, i.rate_records)


def learning_rates_section(inputs: ReportInputs) -> list[str]:
    """The learning-rate search's section (`lr_report.section`; its figure is written to the
    report's folder, so none without one)."""
    return lr_report.section(inputs.out, inputs.done) if inputs.out is not None else []


def reading_section(inputs: ReportInputs) -> list[str]:
    """How to read the comparisons: what is comparable, the method, chance and cut contexts."""
    runs = inputs.runs
    return [
        "## How to read the comparisons",
        "",
        "Validation losses of different objectives are **not comparable**: an MLM model "
        "predicts corrupted spans, a PLM model the continuation after a prefix, an FLM model "
        "every token. Losses are therefore compared only between architectures trained with "
        "the same objective. Across all cells the common metric is **zero-shot probe "
        "accuracy** (rank classification of the same held-out examples).",
        "",
        *answer.method_lines(inputs.cmp),
        "",
        *(
            [f"Chance (a uniform guess among each example's choices): {chance:.3f}.", ""]
            if (chance := chance_accuracy(runs)) is not None
            else []
        ),
        *(
            [
                f"{cut:.0f} of {n:.0f} probe examples had their context cut from the left to "
                "fit the models' input length, so the probes mostly test consistency with the "
                "nearest context; raise `eval.inputs_length` (or train longer sequences) to "
                "test longer-range structure.",
                "",
            ]
            if (share := truncated_share(runs)) and (cut := share[0]) and (n := share[1])
            else []
        ),
    ]


def verdicts_section(inputs: ReportInputs) -> list[str]:
    """The verdicts section: whether loss falls up the ladder, then every verdict in full,
    the in-context comparisons and the comparisons at a held quantity."""
    study, cmp, runs = inputs.study, inputs.cmp, inputs.runs
    lines = ["## Verdicts", ""]
    if cmp.not_scaling:
        lines += [
            f"Validation loss falls at every step up the ladder except in "
            f"{', '.join(cmp.not_scaling)}: at this budget those cells' larger rungs are "
            "not yet ahead (train longer, or scale the learning rate down with width), so "
            "read their fits with care.",
            "",
        ]
    elif cmp.n_done:
        lines += ["Validation loss falls at every step up the ladder in every cell.", ""]
    lines += answer.verdict_section(cmp, inputs.n_what)
    lines += incontext.lines(cmp.incontext, runs)
    lines += comparisons.lines(runs, study.match_tolerance, found=cmp.matched, family=cmp.secondary)
    return lines


def fits_section(inputs: ReportInputs) -> list[str]:
    """The scaling-law fits (`fits_lines`), or why there are none; [] with neither."""
    if not (inputs.fits or inputs.notes):
        return []
    return ["## Scaling-law fits", "", *inputs.notes, *fits_lines(inputs.fits), ""]


def task_laws_section(inputs: ReportInputs) -> list[str]:
    """The per-task laws and their backtests (`task_law_report.section`)."""
    return task_law_report.section(inputs.fits)


def figures_section(inputs: ReportInputs) -> list[str]:
    """Every figure of the study, by its file name."""
    if not inputs.figures:
        return []
    return ["## Figures", "", *[f"![{Path(f).stem}]({f})" for f in inputs.figures], ""]


def loss_tokens_section(inputs: ReportInputs) -> list[str]:
    """Loss-bearing tokens per example (`loss_tokens.lines`); [] where not measured."""
    if inputs.loss_tokens is None:
        return []
    return loss_token_report.lines(inputs.runs, inputs.loss_tokens)


def runs_section(inputs: ReportInputs) -> list[str]:
    """Every planned run, one row each."""
    return ["## Runs", "", *_runs_table(inputs.runs), ""]


def zero_shot_section(inputs: ReportInputs) -> list[str]:
    """Zero-shot accuracy per task (`zeroshot_plots.report_section`; its figure is written to
    the report's folder, so none without one)."""
    if inputs.out is None:
        return []
    from scalestudy.scaling.zeroshot_plots import ScoredRun, report_section  # matplotlib: late

    scored = [
        ScoredRun(
            cell=r.cell,
            size=str(r.size),
            flops=r.flops,
            params=float(r.params_non_embedding or r.params_total or 0),
            run=str(r.run_id or f"{r.size}/{r.seed}"),
            evals=r.evals,
        )
        for r in inputs.done
    ]
    text = report_section(scored, inputs.out)
    # it opens with a blank line, the one the section before ends with
    return text.split("\n")[1:] if text else []


def blimp_section(inputs: ReportInputs) -> list[str]:
    """BLiMP (`blimp_report.section`), against the reference data the study's tasks name."""
    from scalestudy.study.report import blimp_report

    base_eval = inputs.study.base.get("eval", {})
    data_dir = base_eval.get("data_dir") or os.environ.get("SCALESTUDY_EVAL_DIR")
    reference = blimp_report.reference_dir(inputs.study.tasks, data_dir)
    return blimp_report.section(inputs.done, reference)


def expert_section(inputs: ReportInputs) -> list[str]:
    """The MoE runs' routing (`expert_report.section`; it measures the runs and links figures
    relative to the report's folder, so none without one)."""
    if inputs.out is None:
        return []
    from scalestudy.study.report import expert_report

    return expert_report.section(inputs.done, inputs.out)


Section = Callable[[ReportInputs], list[str]]

# The page, in order: the one place it is assembled (`page`).
SECTIONS: tuple[Section, ...] = (
    answer_section,
    limits_section,
    learning_rates_section,
    reading_section,
    verdicts_section,
    fits_section,
    task_laws_section,
    figures_section,
    loss_tokens_section,
    runs_section,
    zero_shot_section,
    blimp_section,
    expert_section,
)


def render_html(text: str) -> str:
    """The Markdown report as a self-contained HTML page (tables, emphasis, code, images)."""
    import markdown

    body = markdown.markdown(text, extensions=["tables", "sane_lists"], output_format="html")
    style = (
        "body{font-family:sans-serif;max-width:72em;margin:auto;line-height:1.4}"
        "table{border-collapse:collapse;margin:0.5em 0}td,th{padding:2px 8px;border:1px solid "
        "#ccc}img{max-width:48%}code{background:#f4f4f4}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><style>{style}</style></head>"
        f"<body>{body}</body></html>"
    )


def answer_figure(runs: list[RunRow], out: Path, tolerance: float) -> str | None:
    """Draw the answer's metric (probe accuracy, as its table) against training compute, the
    points its accuracy rows are read at ringed, to `out/figures/answer.png` (and .svg);
    returns its path relative to `out`, or None without probe accuracies."""
    from scalestudy.scaling import figstyle, zeroshot_plots  # matplotlib: load late

    points = [
        zeroshot_plots.AnswerPoint(r.cell, float(r.flops), acc[0])
        for r in runs
        if r.flops and (acc := probe_accuracy(r))
    ]
    cmp = answer.compare(runs, tolerance=tolerance)
    for name, held, _ in verdicts.QUESTIONS:
        for key, where in ((name, ""), (name + "_ladder", ", ladder")):
            if got := cmp.accuracy.get(key):
                for cell, q in got.quantities.items():
                    if q.flops:
                        read = f"equal {held}{where}"
                        point = zeroshot_plots.AnswerPoint(cell, q.flops, got.means[cell], read)
                        points.append(point)
    fig = zeroshot_plots.fig_answer(points, "probe accuracy (zero-shot)", chance_accuracy(runs))
    if fig is None:
        return None
    (Path(out) / "figures").mkdir(parents=True, exist_ok=True)
    figstyle.save(fig, Path(out) / "figures", "answer")
    return "figures/answer.png"


def finalize(study: StudySpec, out: Path) -> Path:
    """Write `out/report.md` and `out/report.html` from the registry's runs that the spec
    plans (its `planned` column, `registry.planned_runs`), with the study's fits and figures
    (`out/fits.json`, `out/figures/`); returns the Markdown path."""
    out = Path(out)
    runs, gone = read_planned(out / REGISTRY_FILE)
    planned = {r.run_id for r in runs}
    left_out = f" Left out: {len(gone)} run(s) of the registry that this spec does not plan"
    left_out = f"{left_out} ({', '.join(gone)})." if gone else ""
    fits: dict[str, Any] = {}
    figures: list[str] = []
    notes: list[str] = []
    done = [r for r in runs if r.status == "done"]
    if done:
        try:
            curves = read_curves(out / REGISTRY_FILE, planned)
            with phase("fits"):
                fits, paths = fit_study(study, out, done, curves)
            figures = [str(Path(p).relative_to(out)) for p in paths if str(p).endswith(".png")]
        except ScalestudyError as e:  # too few runs to fit is a finding, not a crash
            notes.append(f"Scaling fits were not possible: {e}")
    if done and (got := answer_figure(done, out, study.match_tolerance)):
        figures = [got, *figures]
    per_example = loss_token_report.per_cell(out / REGISTRY_FILE, run_ids=planned)
    text = render_markdown(
        study,
        runs,
        fits,
        figures,
        notes,
        out=out,
        loss_tokens=per_example,
        left_out=left_out,
        rate_records=lr_report.load(out),
    )
    (out / "report.md").write_text(text)
    (out / "report.html").write_text(render_html(text))
    print(f"report: {out / 'report.md'}")
    return out / "report.md"
