"""Pure loss math: plain tensor functions, no Ray, DeepSpeed, vLLM, Prefect or MLflow.

Label convention (Hugging Face): ``labels[b, t]`` is the token at position ``t`` itself, or
``-100`` where no loss is taken; the model's logits at ``t`` predict the token at ``t + 1``,
so every function here shifts by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_for_next_token(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Align logits with the tokens they predict.

    Args:
        logits: ``(batch, seq_len, vocab)``.
        labels: ``(batch, seq_len)`` with ``-100`` where no loss is taken.

    Returns:
        ``(logits[:, :-1], labels[:, 1:])``: shapes ``(batch, seq_len-1, vocab)`` and
        ``(batch, seq_len-1)``.
    """
    return logits[:, :-1, :], labels[:, 1:]


def token_nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token negative log-likelihood over the labelled tokens, and their count.

    ``NLL = - sum_{t: y_t != -100} log p(y_t | x_{<t})`` (the standard maximum-likelihood
    objective of supervised fine-tuning, e.g. Ouyang et al. 2022, "InstructGPT", Sec. 3.5).

    Returning the sum and the count (rather than a mean) lets a trainer normalise by the
    token count of the whole global batch, so gradient accumulation and data-parallel
    workers give the same gradient as one big batch.

    Args:
        logits: ``(batch, seq_len, vocab)``, unshifted.
        labels: ``(batch, seq_len)``, unshifted, ``-100`` where ignored.

    Returns:
        ``(nll_sum, n_tokens)``: a scalar tensor (differentiable) and a scalar long tensor.
    """
    logits, labels = shift_for_next_token(logits, labels)
    nll = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return nll, (labels != IGNORE_INDEX).sum()


def sft_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL over labelled tokens of one batch (``(B, T, V)``, ``(B, T)`` -> scalar)."""
    nll, n = token_nll_sum(logits, labels)
    return nll / n.clamp(min=1)


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each sequence's labelled tokens.

    ``log pi(y | x) = sum_{t: y_t != -100} log p(y_t | x, y_{<t})``: the quantity DPO-family
    losses compare (Rafailov et al. 2023, Eq. 7).

    Args:
        logits: ``(batch, seq_len, vocab)``, unshifted.
        labels: ``(batch, seq_len)``, unshifted, ``-100`` where ignored.

    Returns:
        ``(batch,)`` summed log-probs (0 for a sequence with no labelled token).
    """
    return token_logprobs(logits, labels).sum(-1)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each labelled next token, 0 where no loss is taken.

    Args:
        logits: ``(rows, seq_len, vocab)``, unshifted.
        labels: ``(rows, seq_len)``, unshifted, ``-100`` where ignored.

    Returns:
        ``(rows, seq_len-1)``: entry ``t`` is ``log p(labels[t+1] | tokens[:t+1])``.
    """
    logits, labels = shift_for_next_token(logits, labels)
    mask = labels != IGNORE_INDEX
    safe = labels.masked_fill(~mask, 0)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return logp * mask


# --------------------------------------------------------------------------------------
# Packed rows: several sequences in one row, position ids restarting at 0 for each
# --------------------------------------------------------------------------------------


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which sequence each token belongs to, numbered row-major across the batch.

    A sequence starts wherever ``position_ids`` is 0 (``rlhf_core.data.tokenize.collate_packed``
    restarts them per sequence; a padded row is one sequence). Every row must start one.

    Args:
        position_ids: ``(rows, seq_len)``.

    Returns:
        ``(rows, seq_len)`` long, ``0 .. n_sequences-1``; e.g. positions ``[[0, 1, 2, 0, 1]]``
        give ``[[0, 0, 0, 1, 1]]``.
    """
    return (position_ids == 0).flatten().long().cumsum(0).view_as(position_ids) - 1


def segment_sums(values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums of next-token values (log-probs, mask counts) of possibly packed rows.

    ``values[r, t]`` belongs to the token it predicts, ``t + 1``, so it is summed into that
    token's sequence: ``S_k = sum_{(r, t): seg[r, t+1] = k} values[r, t]``. The value that
    predicts a sequence's first token from the previous sequence's last falls into the new
    sequence: callers mask it (``collate_packed`` ignores each sequence's first label). On a
    padded batch (one sequence per row) this is ``values.sum(-1)``.

    Args:
        values: ``(rows, seq_len-1)``, e.g. :func:`token_logprobs`.
        position_ids: ``(rows, seq_len)``.

    Returns:
        ``(n_sequences,)`` in row-major order of the sequences' starts; differentiable in ``values``.

    ``position_ids`` may stay where the batch was collated (the host) while ``values`` are on the device:
    the segment count is then read without waiting for the device.
    """
    seg = segment_ids(position_ids)
    n = int(seg[-1, -1]) + 1
    out = torch.zeros(n, dtype=values.dtype, device=values.device)
    return out.index_add(0, seg[:, 1:].reshape(-1).to(values.device, non_blocking=True), values.reshape(-1))


def segment_last_index(position_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Flat index (into ``rows * seq_len``) of each sequence's last kept token.

    The reward head reads its score there: transformers' sequence-classification models pool
    the rightmost token that is not ``pad_token_id`` (``keep = input_ids != pad``), and a packed
    row needs the same rule per sequence. A sequence with no kept token falls back to its first
    token (where transformers' ``argmax`` of an all-zero row lands).

    Args:
        position_ids: ``(rows, seq_len)``.
        keep: ``(rows, seq_len)`` bool.

    Returns:
        ``(n_sequences,)`` long.
    """
    seg = segment_ids(position_ids).flatten()
    n = int(seg[-1]) + 1
    idx = torch.arange(seg.numel(), device=seg.device)
    first = torch.full((n,), seg.numel(), device=seg.device).scatter_reduce(0, seg, idx, "amin")
    last = torch.full((n,), -1, device=seg.device).scatter_reduce(0, seg, torch.where(keep.flatten(), idx, -1), "amax")
    return torch.where(last >= 0, last, first)


# --------------------------------------------------------------------------------------
# Reward models
# --------------------------------------------------------------------------------------


def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                       margin: torch.Tensor | None = None) -> torch.Tensor:
    """Pairwise reward-model loss, sigmoid form, with an optional per-pair margin.

    ``L = -log sigmoid(r_c - r_r - m)`` (Bradley & Terry 1952; Ouyang et al. 2022 Eq. 1;
    the margin ``m`` as in Touvron et al. 2023, "Llama 2", Eq. 2).

    Args:
        chosen_rewards: ``(batch,)`` scalar rewards of the preferred responses.
        rejected_rewards: ``(batch,)`` rewards of the dispreferred responses.
        margin: ``(batch,)`` or ``None``; how much better chosen must score.

    Returns:
        ``(batch,)`` per-pair losses.
    """
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)


def log_exp_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """Pairwise loss in log-exp form: ``L = log(1 + exp(r_r - r_c))`` (``(batch,)`` -> ``(batch,)``).

    Equal to :func:`bradley_terry_loss` without margin (``-log sigmoid(x) = log(1 + e^{-x})``),
    written with ``softplus`` as in OpenRLHF's ``LogExpLoss``; kept as a named option
    because users port configs that name it.
    """
    return F.softplus(rejected_rewards - chosen_rewards)


# --------------------------------------------------------------------------------------
# Direct preference optimisation family
# --------------------------------------------------------------------------------------


class PreferenceLoss(str, Enum):
    """The closed set of pairwise policy losses, dispatched in :func:`preference_loss`."""

    DPO = "dpo"
    IPO = "ipo"
    CDPO = "cdpo"

    @property
    def needs_reference_model(self) -> bool:
        """All three compare the policy's log-ratio against a frozen reference."""
        return True


@dataclass
class PreferenceLossOutput:
    """Per-pair loss and the implicit rewards ``beta * (log pi - log pi_ref)`` for logging."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def preference_loss(
    kind: PreferenceLoss,
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> PreferenceLossOutput:
    """DPO, IPO or conservative DPO on sequence log-probs.

    With ``h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r))``:

    * DPO (Rafailov et al. 2023, Eq. 7): ``L = -log sigmoid(beta * h)``;
    * cDPO (Mitchell 2023, "A note on DPO with noisy preferences"), label smoothing ``eps``:
      ``L = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``; ``eps = 0`` is DPO;
    * IPO (Azar et al. 2023, Eq. 17): ``L = (h - 1 / (2 beta))^2``, ``beta`` playing the
      paper's ``tau``. The paper's log-probs are sums over tokens; TRL averages them per
      token instead. Pass per-token means as the ``*_logps`` to get TRL's variant (the
      trainer's ``ipo_average_logps`` option does exactly that).

    Args:
        kind: which loss.
        policy_chosen_logps, policy_rejected_logps: ``(batch,)`` summed log-probs under the policy.
        ref_chosen_logps, ref_rejected_logps: ``(batch,)`` the same under the reference model
            (precomputed once or computed live: the loss does not care).
        beta: inverse temperature (DPO, cDPO) or regularisation ``tau`` (IPO).
        label_smoothing: cDPO's assumed fraction of flipped labels, in ``[0, 0.5)``.

    Returns:
        losses ``(batch,)`` and implicit rewards ``(batch,)`` for chosen and rejected.
    """
    chosen_ratio = policy_chosen_logps - ref_chosen_logps
    rejected_ratio = policy_rejected_logps - ref_rejected_logps
    h = chosen_ratio - rejected_ratio
    if kind is PreferenceLoss.IPO:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    elif kind in (PreferenceLoss.DPO, PreferenceLoss.CDPO):
        eps = label_smoothing if kind is PreferenceLoss.CDPO else 0.0
        if not 0.0 <= eps < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {eps}")
        losses = -(1.0 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    else:  # pragma: no cover - the enum is closed
        raise ValueError(f"unknown preference loss {kind!r}")
    return PreferenceLossOutput(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl_reference: torch.Tensor,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """KTO on unpaired examples (Ethayarajh et al. 2024, "KTO", Eq. 8).

    With ``r = log pi(y|x) - log ref(y|x)`` and reference point ``z0``:
    desirable ``L = lambda_D (1 - sigmoid(beta (r - z0)))``, undesirable
    ``L = lambda_U (1 - sigmoid(beta (z0 - r)))``.

    Args:
        policy_logps, ref_logps: ``(batch,)`` summed response log-probs.
        desirable: ``(batch,)`` bool, True for desirable examples.
        kl_reference: ``z0``, scalar or ``(batch,)`` (each example its draw's); see
            :func:`kto_reference_point`. Treated as a constant.
        beta: inverse temperature.
        desirable_weight, undesirable_weight: ``lambda_D``, ``lambda_U``.

    Returns:
        ``(batch,)`` per-example losses.
    """
    r = policy_logps - ref_logps
    z0 = kl_reference.detach()
    good = desirable_weight * (1.0 - torch.sigmoid(beta * (r - z0)))
    bad = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - r)))
    return torch.where(desirable.bool(), good, bad)


def kto_reference_point(policy_mismatched_logps: torch.Tensor, ref_mismatched_logps: torch.Tensor) -> torch.Tensor:
    """KTO's batch reference point ``z0 = max(0, mean(log pi(y'|x) - log ref(y'|x)))``.

    ``y'`` are completions paired with the *wrong* prompts of the batch (shifted by one), an
    estimate of ``KL(pi || ref)`` (Ethayarajh et al. 2024, Sec. 4.1). Shapes ``(batch,)``
    -> scalar, detached.
    """
    return (policy_mismatched_logps - ref_mismatched_logps).mean().clamp(min=0).detach()


# --------------------------------------------------------------------------------------
# Distillation
# --------------------------------------------------------------------------------------


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                      *, temperature: float = 1.0, nll_weight: float = 0.0) -> torch.Tensor:
    """Token-level forward KL to a teacher, optionally mixed with NLL.

    ``L = (1 - a) * T^2 * mean_t KL(p_T(.|t) || p_S(.|t)) + a * NLL`` over labelled tokens,
    with both distributions softened by temperature ``T`` (Hinton et al. 2015, Sec. 2; the
    ``T^2`` keeps gradient scale independent of ``T``) and ``a = nll_weight``.

    Args:
        student_logits, teacher_logits: ``(batch, seq_len, vocab)``, unshifted, same vocab.
        labels: ``(batch, seq_len)``, unshifted, ``-100`` where no loss is taken.

    Returns:
        scalar loss (mean over labelled tokens).
    """
    if not 0.0 <= nll_weight <= 1.0:
        raise ValueError(f"nll_weight must be in [0, 1], got {nll_weight}")
    s_logits, shifted = shift_for_next_token(student_logits, labels)
    t_logits = teacher_logits[:, :-1, :]
    mask = (shifted != IGNORE_INDEX).float()
    log_p_s = torch.log_softmax(s_logits.float() / temperature, dim=-1)
    log_p_t = torch.log_softmax(t_logits.float() / temperature, dim=-1)
    kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)  # (batch, seq_len-1)
    kl_mean = (kl * mask).sum() / mask.sum().clamp(min=1)
    loss = (1.0 - nll_weight) * temperature**2 * kl_mean
    if nll_weight > 0:
        loss = loss + nll_weight * sft_loss(student_logits, labels)
    return loss
