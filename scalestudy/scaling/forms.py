"""Scaling-law functional forms in log space, with Jacobians, for batched fitting.

Every form predicts log L from log inputs and is evaluated for K parameter vectors at once:
`predict(theta_KQ, x_VP) -> (logL_KP, jac_KPQ)` where K indexes parameter vectors (starts x
bootstrap resamples), P data points, V input variables (log N, log D or log C) and Q
parameters. Positive constants are fitted through their logs and sums through a
log-sum-exp, as in Hoffmann et al. (2022), which keeps every parameter vector valid.

Forms:
- `PowerLaw("N")`: L = (N_c/N)^alpha_N [+ E] (Kaplan et al. 2020, also for D and C).
- `Chinchilla()`: L = E + A/N^alpha + B/D^beta (Hoffmann et al. 2022).
- `KaplanND()`: L = [(N_c/N)^(alpha_N/alpha_D) + D_c/D]^alpha_D [+ E] (Kaplan et al. 2020).
- `ClarkMoE()`: log10 L = a log10 N + b log10 E + c log10 N log10 E + d, for mixtures of
  experts: N parameters (dense-equivalent: active) and E experts (Clark et al. 2022).
- `KrajewskiMoE()`: L = c + (g/G^gamma + a)/N^alpha + b/D^beta, for mixtures of experts of
  granularity G (Krajewski et al. 2024).

The inputs E (experts) and G (granularity) are table columns (`scaling/table_input.py`); a dense
model is E = 1, G = 1.
"""

from __future__ import annotations

import itertools
from typing import ClassVar

import numpy as np


def _softmax_lse(terms_TKP: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log-sum-exp over the first axis and the softmax weights of each term."""
    m = terms_TKP.max(axis=0)
    e = np.exp(terms_TKP - m)
    s = e.sum(axis=0)
    return m + np.log(s), e / s


def _grid(*axes: list[float]) -> np.ndarray:
    return np.array(list(itertools.product(*axes)), dtype=np.float64)


class Form:
    """A scaling law: its inputs, internal parameters, prediction and reported values.

    `robust`: fitted with the Huber loss of log residuals (Hoffmann et al. 2022, for the
    Chinchilla form); otherwise by least squares in log space, as Kaplan et al. (2020) fitted
    their forms.
    """

    robust: bool = False
    name: str
    inputs: tuple[str, ...]
    params: tuple[str, ...]
    with_E: bool

    def predict(self, theta_KQ: np.ndarray, x_VP: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def grid(self, x_VP: np.ndarray) -> np.ndarray:
        """Initial parameter vectors [G, Q]."""
        raise NotImplementedError

    def named(self, theta_KQ: np.ndarray) -> dict[str, np.ndarray]:
        """The law's parameters under their published names, each of shape [K]."""
        raise NotImplementedError

    def formula(self) -> str:
        raise NotImplementedError


class PowerLaw(Form):
    """L = (X_c / X)^alpha_X [+ E] for one input X in {N, D, C}."""

    def __init__(self, var: str, with_E: bool = True):
        self.var, self.with_E = var, with_E
        self.inputs = (var,)
        self.name = f"kaplan_{var.lower()}" + ("" if with_E else "_noE")
        self.params = ("a", "alpha") + (("e",) if with_E else ())

    def predict(self, theta_KQ, x_VP):
        a, alpha = theta_KQ[:, 0:1], theta_KQ[:, 1:2]
        t = a - alpha * x_VP[0][None]
        K, P = t.shape
        if not self.with_E:
            jac = np.stack([np.ones_like(t), -np.broadcast_to(x_VP[0], (K, P))], axis=-1)
            return t, jac
        e = np.broadcast_to(theta_KQ[:, 2:3], (K, P))
        f, p = _softmax_lse(np.stack([t, e]))
        jac = np.stack([p[0], -p[0] * x_VP[0][None], p[1]], axis=-1)
        return f, jac

    def grid(self, x_VP):
        alphas = [0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0]
        # a = alpha * log X_c; place X_c from the data's range to far above it.
        lo, hi = float(x_VP[0].min()), float(x_VP[0].max())
        log_xc = list(np.linspace(lo, hi + 20.0, 6))
        pts = [(al * xc, al) for al in alphas for xc in log_xc]
        if not self.with_E:
            return np.array(pts)
        return np.array([(a, al, e) for a, al in pts for e in (-1.0, -0.5, 0.0, 0.5, 1.0)])

    def named(self, theta_KQ):
        alpha = theta_KQ[:, 1]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            out = {f"alpha_{self.var}": alpha, f"{self.var}_c": np.exp(theta_KQ[:, 0] / alpha)}
            if self.with_E:
                out["E"] = np.exp(theta_KQ[:, 2])
        return out

    def formula(self):
        v = self.var
        return f"L({v}) = ({v}_c/{v})^alpha_{v}" + (" + E" if self.with_E else "")


class Chinchilla(Form):
    """L(N, D) = E + A/N^alpha + B/D^beta (Hoffmann et al. 2022, approach 3)."""

    inputs = ("N", "D")
    robust = True

    def __init__(self, with_E: bool = True):
        self.with_E = with_E
        self.name = "chinchilla3" + ("" if with_E else "_noE")
        self.params = ("a", "alpha", "b", "beta") + (("e",) if with_E else ())

    def predict(self, theta_KQ, x_VP):
        a, alpha, b, beta = (theta_KQ[:, i : i + 1] for i in range(4))
        tn = a - alpha * x_VP[0][None]
        td = b - beta * x_VP[1][None]
        terms = [tn, td]
        if self.with_E:
            terms.append(np.broadcast_to(theta_KQ[:, 4:5], tn.shape))
        f, p = _softmax_lse(np.stack(terms))
        cols = [p[0], -p[0] * x_VP[0][None], p[1], -p[1] * x_VP[1][None]]
        if self.with_E:
            cols.append(p[2])
        return f, np.stack(cols, axis=-1)

    def grid(self, x_VP):
        # The initialisation grid of Hoffmann et al. (2022), appendix D.2.
        ex = [0.0, 0.5, 1.0, 1.5, 2.0]
        ab = [0.0, 5.0, 10.0, 15.0, 20.0, 25.0]
        if not self.with_E:
            return _grid(ab, ex, ab, ex)
        return _grid(ab, ex, ab, ex, [-1.0, -0.5, 0.0, 0.5, 1.0])

    def named(self, theta_KQ):
        # A bootstrap fit that ran off to a huge coefficient is inf here; the flags name it.
        with np.errstate(over="ignore"):
            out = {
                "A": np.exp(theta_KQ[:, 0]),
                "alpha": theta_KQ[:, 1],
                "B": np.exp(theta_KQ[:, 2]),
                "beta": theta_KQ[:, 3],
            }
            if self.with_E:
                out["E"] = np.exp(theta_KQ[:, 4])
        return out

    def formula(self):
        return ("E + " if self.with_E else "") + "A/N^alpha + B/D^beta"


class KaplanND(Form):
    """L(N, D) = [(N_c/N)^(alpha_N/alpha_D) + D_c/D]^alpha_D [+ E] (Kaplan et al. 2020, eq. 1.5)."""

    inputs = ("N", "D")

    def __init__(self, with_E: bool = False):
        self.with_E = with_E
        self.name = "kaplan_nd" + ("_E" if with_E else "")
        # u = (alpha_N/alpha_D) log N_c, v = log D_c, r = alpha_N/alpha_D.
        self.params = ("u", "v", "r", "alpha_D") + (("e",) if with_E else ())

    def predict(self, theta_KQ, x_VP):
        u, v, r, ad = (theta_KQ[:, i : i + 1] for i in range(4))
        s, q = _softmax_lse(np.stack([u - r * x_VP[0][None], v - x_VP[1][None]]))
        g = ad * s
        cols = [ad * q[0], ad * q[1], -ad * q[0] * x_VP[0][None], s]
        if not self.with_E:
            return g, np.stack(cols, axis=-1)
        e = np.broadcast_to(theta_KQ[:, 4:5], g.shape)
        f, p = _softmax_lse(np.stack([g, e]))
        return f, np.stack([p[0] * c for c in cols] + [p[1]], axis=-1)

    def grid(self, x_VP):
        nmax, dmax = float(x_VP[0].max()), float(x_VP[1].max())
        rs = [0.5, 0.75, 1.0, 1.5, 2.0]
        ads = [0.05, 0.1, 0.2, 0.35, 0.5]
        offs = [-5.0, 0.0, 5.0, 10.0, 15.0]
        pts = [
            (r * (nmax + on), dmax + od, r, ad)
            for r, ad, on, od in itertools.product(rs, ads, offs, offs)
        ]
        if not self.with_E:
            return np.array(pts)
        return np.array([(*p, e) for p in pts for e in (-1.0, 0.0, 1.0)])

    def named(self, theta_KQ):
        u, v, r, ad = theta_KQ[:, :4].T
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            out = {"alpha_N": r * ad, "alpha_D": ad, "N_c": np.exp(u / r), "D_c": np.exp(v)}
            if self.with_E:
                out["E"] = np.exp(theta_KQ[:, 4])
        return out

    def formula(self):
        return "[(N_c/N)^(alpha_N/alpha_D) + D_c/D]^alpha_D" + (" + E" if self.with_E else "")


_LN10 = float(np.log(10.0))


class ClarkMoE(Form):
    """log10 L(N, E) = a log10 N + b log10 E + c log10 N log10 E + d (Clark et al. 2022,
    eq. 1, without their saturating transform of E). A dense model is E = 1 (its law:
    log10 L = a log10 N + d). Linear in its parameters: fitted by least squares in log space.
    """

    inputs = ("N", "E")
    params = ("a", "b", "c", "d")
    name = "clark_ne"
    with_E = False

    def predict(self, theta_KQ, x_VP):
        u, v = x_VP[0][None] / _LN10, x_VP[1][None] / _LN10  # log10 N, log10 E
        a, b, c, d = (theta_KQ[:, i : i + 1] for i in range(4))
        f = _LN10 * (a * u + b * v + c * u * v + d)
        K, P = f.shape
        cols = [u, v, u * v, np.ones((1, P))]
        return f, np.stack([_LN10 * np.broadcast_to(col, (K, P)) for col in cols], axis=-1)

    def grid(self, x_VP):
        return _grid([-0.2, -0.05], [-0.1, 0.0], [0.0], [0.0, 1.0, 2.0])

    def named(self, theta_KQ):
        return {name: theta_KQ[:, i] for i, name in enumerate(self.params)}

    def formula(self):
        return "log10 L = a log10 N + b log10 E + c log10 N log10 E + d"


class KrajewskiMoE(Form):
    """L(N, D, G) = c + (g/G^gamma + a)/N^alpha + b/D^beta (Krajewski et al. 2024), fitted
    like Chinchilla's law (Huber loss of log residuals). `published`: their constants, to be
    read beside ours with the caveat of scale (their models: 10^7 to 10^9 parameters)."""

    inputs = ("N", "D", "G")
    robust = True
    name = "krajewski_ndg"
    with_E = True
    # log g, gamma, log a, alpha, log b, beta, log c
    params = ("lg", "gamma", "la", "alpha", "lb", "beta", "lc")
    published: ClassVar[dict[str, float]] = {
        "a": 18.1,
        "alpha": 0.115,
        "b": 30.8,
        "beta": 0.147,
        "g": 2.1,
        "gamma": 0.58,
        "c": 0.47,
    }

    def predict(self, theta_KQ, x_VP):
        lg, gamma, la, alpha, lb, beta, lc = (theta_KQ[:, i : i + 1] for i in range(7))
        n, d, g = (x[None] for x in x_VP)
        s, q = _softmax_lse(np.stack([lg - gamma * g, np.broadcast_to(la, (len(la), g.shape[1]))]))
        t1, t2 = s - alpha * n, lb - beta * d
        f, p = _softmax_lse(
            np.stack([t1, np.broadcast_to(t2, t1.shape), np.broadcast_to(lc, t1.shape)])
        )
        cols = [p[0] * q[0], -p[0] * q[0] * g, p[0] * q[1], -p[0] * n, p[1], -p[1] * d, p[2]]
        return f, np.stack([np.broadcast_to(c, f.shape) for c in cols], axis=-1)

    def grid(self, x_VP):
        return _grid(
            [0.0, 2.0, 4.0],
            [0.3, 0.6],
            [0.0, 2.5, 5.0],
            [0.1, 0.3],
            [0.0, 5.0, 10.0],
            [0.1, 0.3],
            [-1.0, 0.0, 0.5],
        )

    def named(self, theta_KQ):
        lg, gamma, la, alpha, lb, beta, lc = theta_KQ.T
        with np.errstate(over="ignore"):
            return {
                "g": np.exp(lg),
                "gamma": gamma,
                "a": np.exp(la),
                "alpha": alpha,
                "b": np.exp(lb),
                "beta": beta,
                "c": np.exp(lc),
            }

    def formula(self):
        return "c + (g/G^gamma + a)/N^alpha + b/D^beta"


def get_form(law: str) -> Form:
    """The form fitted by a law name (see LAWS)."""
    forms = {
        "kaplan_n": lambda: PowerLaw("N", True),
        "kaplan_n_noE": lambda: PowerLaw("N", False),
        "kaplan_d": lambda: PowerLaw("D", True),
        "kaplan_d_noE": lambda: PowerLaw("D", False),
        "kaplan_c": lambda: PowerLaw("C", True),
        "kaplan_c_noE": lambda: PowerLaw("C", False),
        "kaplan_nd": lambda: KaplanND(False),
        "kaplan_nd_E": lambda: KaplanND(True),
        "chinchilla3": lambda: Chinchilla(True),
        "chinchilla3_noE": lambda: Chinchilla(False),
        "clark_ne": ClarkMoE,
        "krajewski_ndg": KrajewskiMoE,
    }
    return forms[law]()


FORM_LAWS = (
    "kaplan_n",
    "kaplan_n_noE",
    "kaplan_d",
    "kaplan_d_noE",
    "kaplan_c",
    "kaplan_c_noE",
    "kaplan_nd",
    "kaplan_nd_E",
    "chinchilla3",
    "chinchilla3_noE",
    "clark_ne",
    "krajewski_ndg",
)
