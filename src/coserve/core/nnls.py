"""Non-negative least squares (Lawson–Hanson) and the relative-error fit the latency model uses."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)


class NNLSResult(NamedTuple):
    x: torch.Tensor
    residual: float
    iterations: int


def nnls(a: torch.Tensor, b: torch.Tensor, *, max_iter: int | None = None) -> NNLSResult:
    """``x = argmin_{x ≥ 0} ‖A·x − b‖₂`` by the Lawson–Hanson active-set method, in float64.

    The passive set P grows by the coordinate of largest gradient ``w = Aᵀ(b − A·x)`` while
    ``max w > tol``; each unconstrained solve on P that leaves a coordinate ≤ 0 is cut back along
    the segment to the last feasible point, dropping the coordinates that reach 0.

    ``a: [m, n]``, ``b: [m]`` -> ``x: [n]`` (float64, CPU), ``residual = ‖A·x − b‖₂``.
    """
    a = a.detach().to("cpu", torch.float64)
    b = b.detach().to("cpu", torch.float64)
    m, n = a.shape
    max_iter = 3 * n + 10 if max_iter is None else max_iter
    eps = torch.finfo(torch.float64).eps
    a_norm = float(a.abs().sum(0).max()) if a.numel() else 0.0
    b_norm = float(b.abs().max()) if b.numel() else 0.0
    tol = 10 * eps * max(m, n) * a_norm * b_norm
    x = torch.zeros(n, dtype=torch.float64)
    passive = torch.zeros(n, dtype=torch.bool)
    blocked = torch.zeros(n, dtype=torch.bool)
    w = a.T @ b
    iterations = 0
    while bool((free := ~passive & ~blocked).any()):
        j = int(torch.where(free, w, -math.inf).argmax())
        if float(w[j]) <= tol:
            break
        if iterations == max_iter:
            logger.warning("nnls stopped after %d iterations before convergence", max_iter)
            break
        iterations += 1
        passive[j] = True
        s = _passive_lstsq(a, b, passive)
        if float(s[j]) <= 0.0:
            # NOTE: column j is numerically dependent on P; entering it cannot lower the residual.
            passive[j] = False
            blocked[j] = True
            continue
        while bool((s[passive] <= 0).any()):
            cut = passive & (s <= 0)
            ratios = x[cut] / (x[cut] - s[cut])
            k = int(cut.nonzero()[int(ratios.argmin())])
            x = x + float(ratios.min()) * (s - x)
            passive &= x > 0
            passive[k] = False
            x = torch.where(passive, x, torch.zeros_like(x))
            s = _passive_lstsq(a, b, passive)
        x = s
        blocked.zero_()
        w = a.T @ (b - a @ x)
    return NNLSResult(x, float(torch.linalg.vector_norm(a @ x - b)), iterations)


def _passive_lstsq(a: torch.Tensor, b: torch.Tensor, passive: torch.Tensor) -> torch.Tensor:
    """Least squares on the passive columns, zero elsewhere (min-norm if rank-deficient)."""
    s = torch.zeros(a.shape[1], dtype=torch.float64)
    idx = passive.nonzero().squeeze(1)
    if idx.numel():
        sol = torch.linalg.lstsq(a[:, idx], b.unsqueeze(1), driver="gelsd").solution
        s[idx] = sol.squeeze(1)
    return s


def fit_relative(
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    prior: Sequence[float] | None = None,
    prior_weight: float = 0.0,
) -> tuple[float, ...]:
    """``θ = argmin_{θ ≥ 0} Σ_r (w_r·(x_r·θ − y_r))² + λ‖S·(θ − θ₀)‖²``.

    Columns are scaled (``S``: the largest weighted magnitude of each feature) so that features
    spanning orders of magnitude condition alike; the prior ``θ₀`` (weight ``λ``) pins the
    directions that the rows do not excite. Tall systems are reduced to ``R`` of ``QR`` first.
    ``x: [m, k]``, ``y: [m]``, ``weight: [m]`` -> ``k`` coefficients.
    """
    a = x * weight[:, None]
    rhs = y * weight
    scale = a.abs().amax(0)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    a = a / scale
    if prior is not None and prior_weight > 0:
        root = math.sqrt(prior_weight)
        theta0 = torch.tensor(prior, dtype=torch.float64) * scale
        a = torch.cat([a, root * torch.eye(a.shape[1], dtype=torch.float64)])
        rhs = torch.cat([rhs, root * theta0])
    if a.shape[0] > a.shape[1]:
        q, r = torch.linalg.qr(a)
        a, rhs = r, q.T @ rhs
    return tuple((nnls(a, rhs).x / scale).tolist())
