"""Non-negative least squares (Lawson–Hanson) and the relative-error fit the latency model uses.

The arithmetic is numpy's, not torch's: the latency model refits on the engine's step path, and
there torch's CPU kernels of a few thousand rows (a QR, a matmul) wake the OpenMP or MKL threads
of the engine process, which sleep between steps: on the 2-core VM a latency-model refit over a
2,000-step window took 4.4–7.8 ms median and up to 15.8 ms that way, against ~1.0 ms and at most
2.0 ms with numpy's small-matrix LAPACK (each call after a sleep, as in serving;
``bench/prepare_host.py``, ``bench/results/host_cpu/refit_*.json``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

logger = logging.getLogger(__name__)


class NNLSResult(NamedTuple):
    x: torch.Tensor
    residual: float
    iterations: int


def nnls(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray, *, max_iter: int | None = None) -> NNLSResult:
    """``x = argmin_{x ≥ 0} ‖A·x − b‖₂`` by the Lawson–Hanson active-set method, in float64.

    The passive set P grows by the coordinate of largest gradient ``w = Aᵀ(b − A·x)`` while
    ``max w > tol``; each unconstrained solve on P that leaves a coordinate ≤ 0 is cut back along
    the segment to the last feasible point, dropping the coordinates that reach 0.

    ``a: [m, n]``, ``b: [m]`` -> ``x: [n]`` (float64, CPU), ``residual = ‖A·x − b‖₂``.
    """
    x, residual, iterations = _nnls(_array(a, 2), _array(b, 1), max_iter)
    return NNLSResult(torch.from_numpy(x), residual, iterations)


def _array(t: torch.Tensor | np.ndarray, ndim: int) -> np.ndarray:
    out = t.detach().to("cpu", torch.float64).numpy() if isinstance(t, torch.Tensor) else np.asarray(t, np.float64)
    assert out.ndim == ndim
    return out


def _nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None) -> tuple[np.ndarray, float, int]:
    m, n = a.shape
    max_iter = 3 * n + 10 if max_iter is None else max_iter
    eps = np.finfo(np.float64).eps
    a_norm = float(np.abs(a).sum(0).max()) if a.size else 0.0
    b_norm = float(np.abs(b).max()) if b.size else 0.0
    tol = 10 * eps * max(m, n) * a_norm * b_norm
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    blocked = np.zeros(n, dtype=bool)
    w = a.T @ b
    iterations = 0
    while (free := ~passive & ~blocked).any():
        j = int(np.where(free, w, -math.inf).argmax())
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
        while (s[passive] <= 0).any():
            cut = passive & (s <= 0)
            ratios = x[cut] / (x[cut] - s[cut])
            k = int(np.flatnonzero(cut)[int(ratios.argmin())])
            x = x + float(ratios.min()) * (s - x)
            passive &= x > 0
            passive[k] = False
            x = np.where(passive, x, 0.0)
            s = _passive_lstsq(a, b, passive)
        x = s
        blocked[:] = False
        w = a.T @ (b - a @ x)
    return x, float(np.linalg.norm(a @ x - b)), iterations


def _passive_lstsq(a: np.ndarray, b: np.ndarray, passive: np.ndarray) -> np.ndarray:
    """Least squares on the passive columns, zero elsewhere (min-norm if rank-deficient)."""
    s = np.zeros(a.shape[1])
    idx = np.flatnonzero(passive)
    if idx.size:
        s[idx] = np.linalg.lstsq(a[:, idx], b, rcond=None)[0]
    return s


def fit_relative(
    x: torch.Tensor | np.ndarray,
    y: torch.Tensor | np.ndarray,
    weight: torch.Tensor | np.ndarray,
    prior: Sequence[float] | None = None,
    prior_weight: float | Sequence[float] = 0.0,
) -> tuple[float, ...]:
    """``θ = argmin_{θ ≥ 0} Σ_r (w_r·(x_r·θ − y_r))² + Σ_j λ_j·(S_j·(θ_j − θ₀_j))²``.

    Columns are scaled (``S``: the largest weighted magnitude of each feature) so that features
    spanning orders of magnitude condition alike; the prior ``θ₀`` (weight ``λ``: one for every
    term, or one per term) pins the directions that the rows do not excite. Tall systems are
    reduced to ``R`` of ``QR`` first. ``x: [m, k]``, ``y: [m]``, ``weight: [m]`` -> ``k``
    coefficients.
    """
    xa, ya, wa = _array(x, 2), _array(y, 1), _array(weight, 1)
    a = xa * wa[:, None]
    rhs = ya * wa
    scale = np.abs(a).max(0) if a.shape[0] else np.ones(a.shape[1])
    scale = np.where(scale > 0, scale, 1.0)
    a = a / scale
    lam = np.broadcast_to(np.asarray(prior_weight, np.float64), (a.shape[1],))
    if prior is not None and (lam > 0).any():
        root = np.sqrt(np.maximum(lam, 0.0))
        theta0 = np.asarray(prior, np.float64) * scale
        a = np.concatenate([a, np.diag(root)])
        rhs = np.concatenate([rhs, root * theta0])
    if a.shape[0] > a.shape[1]:
        q, r = np.linalg.qr(a)
        a, rhs = r, q.T @ rhs
    theta, _, _ = _nnls(a, rhs, None)
    return tuple(float(v) for v in theta / scale)
