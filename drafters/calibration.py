"""Sequential scaling of per-position confidences: a temperature and a bias per position.

What adaptive verification consumes is the survival of position k, S_k = Π_{j<=k} c_j, the predicted
probability that drafts 1..k are all accepted. Calibrating each c_j alone does not calibrate that product,
so the scalings are fitted in order: c_1 = σ(z_1 / T_1 + b_1) makes S_1 calibrated, then (T_2, b_2), with the first
fixed, makes S_2 calibrated, and so on. The observed survival of a block is Π_{j<=k} α_j with α_j the exact
acceptance probability of slot j (a 0/1 agreement at temperature 0).

A temperature alone (the bias 0) cannot move a head's predictions past 1/2: the demo's EAGLE-3 head, trained on
answers its drafter fits far better than the holdout (first slots accepted 71% against 32%), predicted above 1/2 on
the holdout, and the best temperature (the grid's largest, 31.6) flattened every prediction to 0.50 against 0.32
accepted (survival ECE 0.18 at the first slot). So each position also gets a bias (Platt's scaling, fitted in order).
Each (T_k, b_k) minimizes the cross-entropy of S_k against the observed survival (a proper score: it is smallest at
the calibrated prediction), from T = 1, b = 0, by L-BFGS; the expected calibration error over equal-width bins is
what is reported. Written by hand: no library we use fits a scaling of a running product in order.
"""

from __future__ import annotations

import math

import torch


def expected_calibration_error(pred: torch.Tensor, observed: torch.Tensor, bins: int = 10) -> float | None:
    """Σ_b (n_b / N) |mean pred_b − mean observed_b| over equal-width bins of pred in [0, 1]; None without samples
    (not NaN: the reports that carry it are JSON, and NaN is not JSON)."""
    pred, observed = pred.flatten().double(), observed.flatten().double()
    if pred.numel() == 0:
        return None
    which = (pred * bins).long().clamp(0, bins - 1)
    total = torch.zeros((), dtype=torch.float64, device=pred.device)
    for b in range(bins):
        sel = which == b
        if sel.any():
            total += sel.sum() * (pred[sel].mean() - observed[sel].mean()).abs()
    return float(total / pred.numel())


def survival_ece(
    conf_logits: torch.Tensor,
    alphas: torch.Tensor,
    valid: torch.Tensor,
    temps: list[float],
    bins: int = 10,
    biases: list[float] | None = None,
) -> list[float | None]:
    """ECE of the predicted survival at every position, for the given temperatures (and biases: 0 when None).
    Inputs [N, γ]; a block contributes to position k while its slots up to k are valid; None at a position no block
    reaches (with sampled Markov inputs, a slot counts only while the samples before it equal the data)."""
    conf = torch.sigmoid(_scaled(conf_logits.double(), temps, biases))
    pred = conf.cumprod(-1)
    obs = alphas.double().cumprod(-1)
    return [expected_calibration_error(pred[valid[:, k], k], obs[valid[:, k], k], bins) for k in range(conf.shape[1])]


def _scaled(logits: torch.Tensor, temps: list[float], biases: list[float] | None) -> torch.Tensor:
    t = torch.tensor(temps, dtype=logits.dtype, device=logits.device)
    b = torch.zeros_like(t) if biases is None else torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    return logits / t + b


def fit_sequential_scaling(
    conf_logits: torch.Tensor, alphas: torch.Tensor, valid: torch.Tensor
) -> tuple[list[float], list[float]]:
    """Per-position (temperatures, biases), fitted in order: (T_k, b_k) minimizes the cross-entropy of the survival
    S_k = S_{k-1} σ(z_k / T_k + b_k) against the observed Π_{j<=k} α_j given the earlier positions' scalings. Where
    the survival is already ~0 the loss hardly moves, and a small pull toward T = 1, b = 0 keeps the scaling there
    instead of at an extreme that would turn a later logit into certainty."""
    G = conf_logits.shape[1]
    temps: list[float] = []
    biases: list[float] = []
    obs = alphas.double().cumprod(-1)
    prefix = torch.ones(conf_logits.shape[0], dtype=torch.float64, device=conf_logits.device)  # S_{k-1}, fitted
    for k in range(G):
        sel = valid[:, k]
        if not sel.any():
            temps += [1.0] * (G - k)
            biases += [0.0] * (G - k)
            break
        log_t, b = _fit_position(conf_logits[sel, k].double(), prefix[sel], obs[sel, k])
        temps.append(math.exp(log_t))
        biases.append(b)
        prefix = prefix * torch.sigmoid(conf_logits[:, k].double() / temps[-1] + b)
    return temps, biases


def _fit_position(z: torch.Tensor, before: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(log T, b) minimizing the cross-entropy of before · σ(z / T + b) against y, from (0, 0) by L-BFGS, with a pull
    of 1e-4 toward (0, 0). Log T: a temperature stays positive. On the data's device, CPU or GPU."""
    params = torch.zeros(2, dtype=torch.float64, device=z.device, requires_grad=True)
    opt = torch.optim.LBFGS([params], lr=1.0, max_iter=100, line_search_fn="strong_wolfe")
    eps = 1e-9

    def loss() -> torch.Tensor:
        opt.zero_grad()
        s = (before * torch.sigmoid(z * torch.exp(-params[0]) + params[1])).clamp(eps, 1 - eps)
        value = -(y * s.log() + (1 - y) * (1 - s).log()).mean() + 1e-4 * (params**2).sum()
        value.backward()
        return value

    with torch.enable_grad():  # fitted inside a caller's no_grad (the calibration after training)
        opt.step(loss)
    log_t, b = params.detach().tolist()
    return log_t, b
