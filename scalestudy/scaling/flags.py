"""Rules that flag a fit the data do not support, each with its reason.

A flag is a string `"<kind>: <reason>"`; kinds:
- `points`: fewer points than `min_points_per_param` per fitted parameter;
- `bound`: a parameter on the edge of its domain (E = 0, an exponent <= 0), or an interval
  reaching that edge;
- `span`: a rule on what the law says, not on how it is written: the interval of an exponent
  wider than the exponent itself, of E (a loss) wider than `MAX_SPAN_DEX` orders of
  magnitude, or of the law's predicted loss anywhere within the data wider than
  `MAX_PRED_SPAN` of the prediction (called unbounded from `UNBOUNDED_PRED_SPAN` times it).
  Coefficients (A, B, N_c, ...) are not judged by their own intervals: a coefficient is the
  law's value far outside the data (N_c = exp(a/alpha) explodes when alpha is small even
  when alpha is tight), so its interval says nothing about the fit;
- `sign`: bootstrap resamples that disagree on the sign of an exponent;
- `outliers`: points whose residual is far outside the others' (robust z-score, with a floor
  on the spread so that a near-perfect fit of a few points does not flag a 5% residual);
- `flat`: a fitted loss that barely changes over the data;
- `training`: unequal training across the ladder: tokens per parameter (D/N) differing by
  more than `MAX_TOKENS_PER_PARAM_RATIO` between sizes, so a law in N mixes the effect of size
  with that of under-training;
- `seed`: a size (an (N, D) point) trained by one run only: run-to-run variation is not
  measured there, so its loss is one draw (per size: every size needs repeats);
- `misfit`: residuals that curve or trend along the law's input (a least-squares test of a
  quadratic in the input against a constant, p < `MISFIT_P`): the form is misspecified;
- `extrapolation`: a prediction asked for outside the range of the data (on answers at a
  given compute, not on the fit itself).
"""

from __future__ import annotations

import warnings

import numpy as np
from scipy import stats

MAX_SPAN_DEX = 2.0  # an interval of E wider than this many decades
MAX_PRED_SPAN = 0.2  # a predicted loss's interval wider than this share of the prediction
# An interval this many times the prediction is bootstrap fits running off, not a width.
UNBOUNDED_PRED_SPAN = 100.0
BOUND_REL = 1e-3  # E below this share of the lowest observed loss sits on its bound 0
OUTLIER_Z = 5.0  # robust z-score (median absolute deviation) of an outlying residual
# The smallest residual spread the z-score divides by (log loss): a few runs on a near-perfect
# fit have a median absolute deviation near 0, which would make a 5% residual "5 robust
# standard deviations" out; seed-to-seed differences in a final loss are of this order.
MIN_RESID_SD = 0.02
MAX_TOKENS_PER_PARAM_RATIO = 4.0  # widest ratio of D/N between sizes before `training`
MISFIT_P = 0.05  # significance of the residual trend test
SAME_POINT_REL = 0.01  # runs whose N and D differ by less than this are repeats of one point
EXPONENTS = ("alpha", "beta", "a", "b")


def _is_exponent(name: str) -> bool:
    return name in EXPONENTS or name.startswith(("alpha_", "beta_"))


def _g(v: float) -> str:
    return f"{v:.3g}"


def points_flag(n_points: int, n_params: int, min_per_param: float, what: str = "points"):
    """'points' flag when there are fewer than min_per_param points per parameter."""
    if n_points >= min_per_param * n_params:
        return []
    return [
        f"points: {n_points} {what} for {n_params} parameters ({n_points / n_params:.2g} per "
        f"parameter; the stated minimum is {min_per_param:g} per parameter, "
        "--min-points-per-param): too few to determine the parameters reliably"
    ]


def param_flags(params: dict, samples: dict, ci: float, lowest_loss: float | None) -> list[str]:
    """bound, span and sign flags of summarised parameters ({name: {value, ci}})."""
    flags = []
    level = f"{ci:.0%}"
    for name, p in params.items():
        v, iv = p.get("value"), p.get("ci")
        if v is None:
            flags.append(f"bound: {name} is not finite: degenerate fit")
            continue
        if name == "E" and lowest_loss:
            edge = BOUND_REL * lowest_loss
            if v < edge:
                flags.append(
                    f"bound: E = {_g(v)} sits on its bound 0 (below {BOUND_REL:.1%} of the "
                    "lowest loss): the irreducible loss is not determined by these runs; "
                    "fit the law without E or add runs at larger scale"
                )
            elif iv and iv[0] < edge:
                flags.append(
                    f"bound: E's {level} interval reaches down to {_g(iv[0])}, its bound 0: "
                    "the irreducible loss is not determined by these runs"
                )
        if _is_exponent(name) and name not in ("a", "b") and not v > 1e-3:
            flags.append(
                f"bound: {name} = {_g(v)} <= 0: loss does not fall with scale; degenerate fit"
            )
        if iv is not None:
            lo, hi = iv
            at_bound = name == "E" and lowest_loss and lo < BOUND_REL * lowest_loss
            if at_bound:
                pass  # already flagged as reaching its bound
            elif name == "E" and lo > 0 and np.log10(hi / lo) > MAX_SPAN_DEX:
                flags.append(
                    f"span: {name}'s {level} interval [{_g(lo)}, {_g(hi)}] spans "
                    f"{np.log10(hi / lo):.0f} orders of magnitude"
                )
            elif _is_exponent(name) and hi - lo > abs(v):
                flags.append(
                    f"span: {name}'s {level} interval [{_g(lo)}, {_g(hi)}] is wider than "
                    f"its value {_g(v)}"
                )
        s = samples.get(name)
        if _is_exponent(name) and s is not None and len(s) and v != 0:
            s = np.asarray(s, dtype=float)
            s = s[np.isfinite(s)]
            opposite = float(np.mean(np.sign(s) == -np.sign(v))) if len(s) else 0.0
            if opposite > (1.0 - ci) / 2.0:
                flags.append(
                    f"sign: {opposite:.0%} of bootstrap fits give {name} of the opposite sign "
                    f"to {_g(v)}: the direction of the effect is not determined"
                )
    return flags


def outlier_points(resid_P: np.ndarray) -> np.ndarray:
    """Indices of the residuals with a robust z-score above OUTLIER_Z (none below 6 points)."""
    r = np.asarray(resid_P, dtype=float)
    if r.size < 6:
        return np.zeros(0, dtype=int)
    med = np.median(r)
    sigma = max(1.4826 * np.median(np.abs(r - med)), MIN_RESID_SD)
    return np.flatnonzero(np.abs(r - med) / sigma > OUTLIER_Z)


def outlier_flags(
    resid_P: np.ndarray, run_ids: list[str], out: np.ndarray
) -> tuple[list[str], list[str]]:
    """('outliers' flags, the runs flagged) for the outlying points `out` (outlier_points);
    `run_ids` names each point's run (frontier points of one run share it)."""
    r = np.asarray(resid_P, dtype=float)
    if not out.size:
        return [], []
    runs = list(dict.fromkeys(run_ids[i] for i in out))
    shown = ", ".join(f"{run_ids[i]} ({r[i]:+.3g})" for i in out[:5])
    more = f" and {out.size - 5} more" if out.size > 5 else ""
    return [
        f"outliers: {out.size} point(s) with log residuals beyond {OUTLIER_Z} robust standard "
        f"deviations: {shown}{more}; check them, or leave them out with --exclude"
    ], runs


def extrapolation(c: float, c_range: list[float] | None) -> str | None:
    """Why a prediction at compute c extrapolates beyond the runs' compute range (or None)."""
    if not c_range:
        return None
    lo, hi = c_range
    if c > hi * (1 + 1e-9):
        return f"extrapolation: C = {_g(c)} is {c / hi:.3g}x the largest run's compute {_g(hi)}"
    if c < lo * (1 - 1e-9):
        return f"extrapolation: C = {_g(c)} is below the smallest run's compute {_g(lo)}"
    return None


def training_flag(N_J: np.ndarray, D_J: np.ndarray) -> list[str]:
    """'training' flag when tokens per parameter differ by more than the stated factor
    between sizes (median D/N per distinct N)."""
    N_J, D_J = np.asarray(N_J, dtype=float), np.asarray(D_J, dtype=float)
    ok = np.isfinite(N_J) & np.isfinite(D_J) & (N_J > 0) & (D_J > 0)
    sizes = np.unique(N_J[ok])
    if sizes.size < 2:
        return []
    tpp = np.array([np.median(D_J[ok][N_J[ok] == n] / n) for n in sizes])
    hi, lo = int(np.argmax(tpp)), int(np.argmin(tpp))
    ratio = tpp[hi] / tpp[lo]
    if ratio <= MAX_TOKENS_PER_PARAM_RATIO:
        return []
    return [
        f"training: tokens per parameter range from {_g(tpp[lo])} (N = {_g(sizes[lo])}) to "
        f"{_g(tpp[hi])} (N = {_g(sizes[hi])}), {ratio:.3g}x apart (more than "
        f"{MAX_TOKENS_PER_PARAM_RATIO:g}x): sizes are unequally trained, so the fit mixes "
        "the effect of size with that of training length"
    ]


def repeat_groups(log_VJ: np.ndarray) -> list[np.ndarray]:
    """Runs as repeats of one point: index arrays, one per point. Runs whose every input (the
    rows of `log_VJ`: log N, log D, ...) agrees within SAME_POINT_REL are one point trained
    twice, and so are chains of such runs: seeds of one planned run read slightly different
    token counts (documents pack into rows differently in another order)."""
    x = np.asarray(log_VJ, dtype=float)
    near_JJ = (np.abs(x[:, :, None] - x[:, None, :]) <= np.log1p(SAME_POINT_REL)).all(axis=0)
    label = np.full(x.shape[1], -1)
    for j in range(x.shape[1]):
        stack, label[j] = ([j], j) if label[j] < 0 else ([], label[j])
        while stack:
            reached = np.flatnonzero(near_JJ[stack.pop()] & (label < 0))
            label[reached] = j
            stack += reached.tolist()
    return [np.flatnonzero(label == g) for g in np.unique(label)]


def seed_flag(N_J: np.ndarray, D_J: np.ndarray) -> list[str]:
    """'seed' flag when any (N, D) was trained by one run only (`repeat_groups`): each size
    needs repeats of its own, one repeated size does not vouch for the others."""
    x = np.log(np.stack([N_J, D_J]).astype(float))
    x = x[:, np.isfinite(x).all(axis=0)]
    if x.shape[1] < 2:
        return []
    groups = repeat_groups(x)
    single = [g[0] for g in groups if len(g) == 1]
    if not single:
        return []
    # A point is an (N, D): a ladder of sizes at several token counts has more points than
    # sizes, so both are counted.
    sizes = sorted({f"{v:.3g}" for v in np.exp(x[0, single])}, key=float)
    return [
        f"seed: {len(single)} of {len(groups)} (N, D) points trained by one run only "
        f"({len(sizes)} size{'s' if len(sizes) != 1 else ''}, N = {', '.join(sizes)}): "
        "run-to-run variation is not measured there, so their losses are single draws; "
        "train at least two seeds at every size before comparing close fits"
    ]


def misfit_flag(resid_P: np.ndarray, x_P: np.ndarray, what: str = "log X") -> list[str]:
    """'misfit' flag when residuals trend or curve along the input (F-test of a quadratic in
    the input against a constant; needs 5 points and 2 distinct inputs)."""
    r, x = np.asarray(resid_P, dtype=float), np.asarray(x_P, dtype=float)
    P = r.size
    if P < 5 or np.unique(np.round(x, 9)).size < 3:
        return []
    z = (x - x.mean()) / (x.std() or 1.0)
    X = np.stack([np.ones(P), z, z * z], axis=1)
    coef, *_ = np.linalg.lstsq(X, r, rcond=None)
    rss1 = float(np.sum((r - X @ coef) ** 2))
    rss0 = float(np.sum((r - r.mean()) ** 2))
    # Residuals at rounding level (an exact law) carry no trend worth a flag.
    if rss0 <= 1e-20 * P or np.sqrt(rss0 / P) < 1e-6:
        return []
    df = P - 3
    F = ((rss0 - rss1) / 2.0) / max(rss1 / df, 1e-300)
    p = float(stats.f.sf(F, 2, df))
    if p >= MISFIT_P:
        return []
    return [
        f"misfit: the residuals trend or curve along {what} (quadratic against constant, "
        f"F = {F:.3g}, p = {p:.2g}): the form does not describe these runs; read its "
        "exponents as local slopes at best"
    ]


def fit_flags(resid_P, x_P, N_J, D_J, what: str = "log X", in_n_and_d: bool = False):
    """The flags on how the runs were trained and how the law fits them: training (not for
    laws in both N and D, whose data vary D/N on purpose), seed, and misfit (residuals
    `resid_P` at inputs `x_P`); N and D per run."""
    flags = [] if in_n_and_d else training_flag(N_J, D_J)
    return flags + seed_flag(N_J, D_J) + misfit_flag(resid_P, x_P, what)


def prediction_span_flag(pred_P: np.ndarray, samples_RP: np.ndarray, ci: float, x_P, what: str):
    """'span' flag when the law's predicted loss at some data point has an interval (over the
    bootstrap fits `samples_RP`) wider than MAX_PRED_SPAN of the prediction `pred_P`; an
    interval UNBOUNDED_PRED_SPAN times the prediction or wider is called unbounded."""
    s = np.asarray(samples_RP, dtype=float)
    if s.ndim != 2 or len(s) < 2:
        return []
    # A bootstrap fit whose prediction overflowed lies beyond every finite one: it is kept, at
    # the largest float, so an interval reaching it is unbounded; failed fits (NaN) are dropped.
    big = np.finfo(float).max
    with np.errstate(invalid="ignore", over="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a point where every fit failed
        lo, hi = np.nanpercentile(np.clip(s, -big, big), [50 * (1 - ci), 50 * (1 + ci)], axis=0)
        rel = (hi - lo) / np.abs(pred_P)
    rel = np.where(np.isnan(rel), -np.inf, rel)  # a point without finished fits says nothing
    if not (rel > MAX_PRED_SPAN).any():
        return []
    i = int(np.argmax(rel))
    where = f"at {what} = {_g(float(x_P[i]))}"
    why = "the runs do not determine the law even within their range"
    if rel[i] >= UNBOUNDED_PRED_SPAN:
        reach = "past the largest float" if hi[i] >= big else _g(hi[i])
        return [
            f"span: the law's predicted loss {where} has an unbounded {ci:.0%} interval around "
            f"{_g(float(pred_P[i]))} (bootstrap fits reach {reach}): {why}"
        ]
    return [
        f"span: the law's predicted loss {where} has a {ci:.0%} interval "
        f"[{_g(lo[i])}, {_g(hi[i])}] around {_g(float(pred_P[i]))}, {rel[i]:.0%} of it (more "
        f"than {MAX_PRED_SPAN:.0%}): {why}"
    ]
