"""Sequential temperature scaling of per-position confidences.

What adaptive verification consumes is the survival of position k, S_k = Π_{j<=k} c_j, the predicted
probability that drafts 1..k are all accepted. Calibrating each c_j alone does not calibrate that product,
so the temperatures are fitted in order: T_1 makes S_1 calibrated, then T_2 (with T_1 fixed) makes S_2
calibrated, and so on. The observed survival of a block is Π_{j<=k} α_j with α_j the exact acceptance
probability of slot j (a 0/1 agreement at temperature 0). Calibration is measured by the expected
calibration error over equal-width bins. Written by hand: it is a 1-D grid search per position, which no
library we use provides in this form.
"""

from __future__ import annotations

import math

import torch


def expected_calibration_error(pred: torch.Tensor, observed: torch.Tensor, bins: int = 10) -> float:
    """Σ_b (n_b / N) |mean pred_b − mean observed_b| over equal-width bins of pred in [0, 1]."""
    pred, observed = pred.flatten().double(), observed.flatten().double()
    if pred.numel() == 0:
        return float("nan")
    which = (pred * bins).long().clamp(0, bins - 1)
    total = torch.zeros((), dtype=torch.float64, device=pred.device)
    for b in range(bins):
        sel = which == b
        if sel.any():
            total += sel.sum() * (pred[sel].mean() - observed[sel].mean()).abs()
    return float(total / pred.numel())


def survival_ece(
    conf_logits: torch.Tensor, alphas: torch.Tensor, valid: torch.Tensor, temps: list[float], bins: int = 10
) -> list[float]:
    """ECE of the predicted survival at every position, for the given temperatures. Inputs [N, γ]; a block
    contributes to position k while its slots up to k are valid."""
    conf = torch.sigmoid(conf_logits.double() / torch.tensor(temps, dtype=torch.float64, device=conf_logits.device))
    pred = conf.cumprod(-1)
    obs = alphas.double().cumprod(-1)
    return [expected_calibration_error(pred[valid[:, k], k], obs[valid[:, k], k], bins) for k in range(conf.shape[1])]


def fit_sequential_temperatures(
    conf_logits: torch.Tensor,
    alphas: torch.Tensor,
    valid: torch.Tensor,
    bins: int = 10,
    grid: torch.Tensor | None = None,
) -> list[float]:
    """Per-position temperatures (in order) minimizing the ECE of the survival S_k given the earlier ones."""
    grid = torch.logspace(-1.5, 1.5, 121, dtype=torch.float64) if grid is None else grid
    G = conf_logits.shape[1]
    temps: list[float] = []
    obs = alphas.double().cumprod(-1)
    # S_{k-1} under the fitted temperatures
    prefix = torch.ones(conf_logits.shape[0], dtype=torch.float64, device=conf_logits.device)
    for k in range(G):
        sel = valid[:, k]
        if not sel.any():
            temps += [1.0] * (G - k)
            break
        z = conf_logits[sel, k].double()
        best_t, best_e = 1.0, float("inf")
        # nearest to 1 first, and only a clearly lower ECE moves away from it: where the survival is already
        # ~0 many temperatures tie, and an extreme one would turn a later positive logit into certainty
        for t in sorted(grid.tolist(), key=lambda t: abs(math.log(t))):
            e = expected_calibration_error(prefix[sel] * torch.sigmoid(z / t), obs[sel, k], bins)
            if e < best_e - 1e-4:
                best_t, best_e = t, e
        temps.append(best_t)
        prefix = prefix * torch.sigmoid(conf_logits[:, k].double() / best_t)
    return temps
