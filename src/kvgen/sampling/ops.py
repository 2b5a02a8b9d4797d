"""Per-row logits transforms, token choice and log-probabilities.

Every op is pure: it returns a new tensor and never edits its inputs. Each
parameter is either a Python scalar (one setting for the whole batch, as in an
HF-style ``generate()``) or a ``[B]`` tensor (one setting per row, as in a
continuous-batching engine). A row whose parameter is the "disabled" value
(temperature 1.0, top_k 0, top_p 1.0, min_p 0.0, ...) comes back unchanged.

Token histories ``token_ids: [B, T] long`` may be ragged: rows are left-padded
with negative ids (``-1``), which never count as tokens. Pass float per-row
parameters as float64 so that thresholds such as ``1 - top_p`` round exactly as
transformers rounds a Python float.

Source: the semantics, tie-breaking and float operation order of Hugging Face
``transformers`` 4.55 ``generation/logits_process.py``, which tests compare to.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from kvgen.fields import check_int
from kvgen.sampling.params import PARAM_RULES, ParamRule, check_param, in_range

RowParam = float | int | torch.Tensor
SequenceBias = Mapping[tuple[int, ...], float] | Sequence[Sequence[Sequence[int] | float]]
Generators = torch.Generator | Sequence[torch.Generator | None] | None
Draw = Literal["multinomial", "inverse_cdf"]

FILTER_VALUE = -float("inf")


# ---------------------------------------------------------------- validation


# Where temperature divides the logits it must be positive (0 means greedy, decided before).
POSITIVE_TEMPERATURE = PARAM_RULES["temperature"].exclusive_low("use greedy decoding for 0")


def validate_param(name: str, value: RowParam, num_rows: int | None = None, rule: ParamRule | None = None) -> None:
    """Check a scalar or ``[B]`` parameter against ``PARAM_RULES[name]`` (or ``rule``), and B against ``num_rows``.

    Raises ValueError naming the parameter, the first bad value and, for a tensor,
    its row: ``top_p must be in (0, 1], got 1.5``.
    """
    rule = rule or PARAM_RULES[name]
    if not isinstance(value, torch.Tensor):
        check_param(name, value, rule)
        return
    if value.dim() != 1 or (num_rows is not None and value.shape[0] != num_rows):
        rows = "B" if num_rows is None else f"B={num_rows}"
        raise ValueError(f"{name} must be a scalar or a [{rows}] tensor, got shape {list(value.shape)}")
    if rule.kind is int and (value.dtype.is_floating_point or value.dtype.is_complex):
        raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")
    values = value.detach().cpu().tolist()  # B Python numbers: a few us per row, no tensor ops
    row = next((i for i, x in enumerate(values) if not in_range(rule, x)), None)
    if row is not None:
        raise ValueError(f"{name} must be {rule.expected}, got {values[row]} (row {row})")


def _check_min_tokens_to_keep(min_tokens_to_keep: int) -> None:
    if isinstance(min_tokens_to_keep, torch.Tensor):
        raise ValueError("min_tokens_to_keep must be an int, got a tensor")
    validate_param("min_tokens_to_keep", min_tokens_to_keep)


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {list(logits.shape)}")


def _check_token_ids(token_ids: torch.Tensor, logits: torch.Tensor, name: str = "token_ids") -> None:
    if token_ids.dim() != 2 or token_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"{name} must be [B={logits.shape[0]}, T], got shape {list(token_ids.shape)}")
    if token_ids.numel() and int(token_ids.max()) >= logits.shape[1]:
        raise ValueError(f"{name} must be < vocab size {logits.shape[1]}, got {int(token_ids.max())}")


def _per_row(value: RowParam, num_rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scalar or ``[B]`` parameter (already validated) as a ``[B, 1]`` column of ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).unsqueeze(1)  # [B, 1]
    return torch.full((num_rows, 1), value, dtype=dtype, device=device)  # [B, 1]


def _row_param(logits: torch.Tensor, name: str, value: RowParam, dtype: torch.dtype | None = None,
               min_tokens_to_keep: int = 1, rule: ParamRule | None = None) -> torch.Tensor:
    """A warper's checks in order (logits [B, V], ``value`` under ``name``'s rule, ``min_tokens_to_keep``), then
    ``value`` as a ``[B, 1]`` column of ``dtype`` (default: the logits')."""
    _check_logits(logits)
    validate_param(name, value, logits.shape[0], rule)
    _check_min_tokens_to_keep(min_tokens_to_keep)
    return _per_row(value, logits.shape[0], dtype or logits.dtype, logits.device)  # [B, 1]


def _keep_first(sorted_remove: torch.Tensor, num: int) -> torch.Tensor:
    """Clear the first ``num`` columns of a sorted removal mask (in place, internal)."""
    sorted_remove[:, :num] = False
    return sorted_remove


# ------------------------------------------------------------------ warpers


def apply_temperature(logits: torch.Tensor, temperature: RowParam) -> torch.Tensor:
    """Divide each row's logits by its temperature.

    logits: [B, V] float; temperature: scalar or [B], > 0 (1.0 disables).
    Returns [B, V], logits' dtype. Raises ValueError for temperature <= 0.
    Source: HF ``TemperatureLogitsWarper``.
    """
    t = _row_param(logits, "temperature", temperature, rule=POSITIVE_TEMPERATURE)  # [B, 1]
    return logits / t


def apply_top_k(
    logits: torch.Tensor, top_k: RowParam, min_tokens_to_keep: int = 1, filter_value: float = FILTER_VALUE
) -> torch.Tensor:
    """Keep tokens whose logit is at least the row's k-th largest (ties at the k-th all stay).

    logits: [B, V] float; top_k: int or [B] long, >= 0 (0 disables); k is raised to
    ``min_tokens_to_keep`` and capped at V. Returns [B, V] with removed entries set to
    ``filter_value``. Raises ValueError for top_k < 0. Source: HF ``TopKLogitsWarper``.
    """
    k = _row_param(logits, "top_k", top_k, torch.long, min_tokens_to_keep=min_tokens_to_keep)  # [B, 1]
    vocab_size = logits.shape[1]
    is_enabled = k > 0  # [B, 1]
    k = torch.where(is_enabled, k.clamp(min=min_tokens_to_keep), vocab_size).clamp(max=vocab_size)  # [B, 1]
    top_values = torch.topk(logits, int(k.max())).values  # [B, k_max], descending
    kth = top_values.gather(1, k - 1)  # [B, 1]
    return logits.masked_fill((logits < kth) & is_enabled, filter_value)


def apply_top_p(
    logits: torch.Tensor, top_p: RowParam, min_tokens_to_keep: int = 1, filter_value: float = FILTER_VALUE
) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of top tokens whose probability mass reaches top_p.

    Sorted ascending, tokens whose cumulative probability is <= 1 - top_p are removed
    (so ties at the boundary depend on ``torch.sort``, exactly as in HF).
    logits: [B, V] float; top_p: scalar or [B] in (0, 1] (1.0 disables).
    Returns [B, V]. Raises ValueError outside (0, 1]. Source: HF ``TopPLogitsWarper``.

    A row is first decided from its largest logits only (:func:`_top_p_from_candidates`, ~30x
    cheaper than sorting V); a row that could decide differently from the full sort (cut
    beyond the candidates, within float noise of the threshold, or between tied logits)
    takes the full sort, so every row equals HF's.
    """
    p = _row_param(logits, "top_p", top_p, torch.float64, min_tokens_to_keep=min_tokens_to_keep)  # [B, 1]
    # 1 - p in float64, then rounded to the logits dtype, as HF's Python-float threshold is.
    threshold = (1 - p).to(logits.dtype)  # [B, 1]
    is_active = p[:, 0] < 1  # [B]
    remove = torch.zeros_like(logits, dtype=torch.bool)  # [B, V]
    rows = torch.arange(logits.shape[0])  # [R] rows not decided yet
    for num_candidates in _TOP_P_CANDIDATES:
        if rows.numel() == 0 or num_candidates >= logits.shape[1]:
            break
        is_whole = rows.numel() == logits.shape[0]  # no row copies while every row is undecided
        row_remove, certain = _top_p_from_candidates(logits if is_whole else logits[rows], threshold[rows],
                                                     min_tokens_to_keep, num_candidates)  # [R, V], [R]
        certain |= ~is_active[rows]  # a disabled row's mask is dropped below
        if is_whole:
            remove = row_remove  # its undecided rows are overwritten below
        else:
            remove[rows[certain]] = row_remove[certain]
        rows = rows[~certain]
    if rows.numel():
        remove[rows] = _top_p_by_sort(logits[rows], threshold[rows], min_tokens_to_keep)
    return logits.masked_fill(remove & is_active[:, None], filter_value)


_TOP_P_CANDIDATES = (64, 1024)  # largest logits a row is decided from, tried in turn before the full sort
_TOP_P_MARGIN = 1e-4  # cumulative probabilities closer than this to the threshold go to the full sort


def _top_p_by_sort(logits: torch.Tensor, threshold: torch.Tensor, min_tokens_to_keep: int) -> torch.Tensor:
    """HF's top-p removal mask [B, V] bool (logits [B, V], threshold [B, 1] = 1 - top_p, logits' dtype)."""
    sorted_logits, sorted_ids = torch.sort(logits, descending=False)  # [B, V]
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    sorted_remove = cumulative <= threshold  # [B, V]
    sorted_remove[:, -min_tokens_to_keep:] = False
    return sorted_remove.scatter(1, sorted_ids, sorted_remove)  # [B, V], vocab order


def _top_p_from_candidates(logits: torch.Tensor, threshold: torch.Tensor, min_tokens_to_keep: int,
                           num_candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p's removal mask [B, V] bool from each row's ``num_candidates`` largest logits, and [B] bool: the row
    certainly equals :func:`_top_p_by_sort`'s.

    A candidate's ascending cumulative probability is 1 - the mass ranked above it (float64); it is
    non-increasing down the ranks, so the kept tokens are the first ``cut`` candidates, ``cut`` = max(how many
    exceed the threshold, ``min_tokens_to_keep``), and every token outside the candidates is removed when the
    cut falls inside them. Certain when it does, when the cumulative probabilities on both sides of the cut
    are more than ``_TOP_P_MARGIN`` from the threshold (the sort's float32 softmax and sums round differently)
    and when the two logits there differ (so no tie order of ``torch.sort`` matters).
    """
    values, ids = torch.topk(logits, num_candidates)  # [B, K], descending
    probs = logits.softmax(dim=-1).gather(1, ids).double()  # [B, K]
    cumulative = 1 - (probs.cumsum(dim=-1) - probs)  # [B, K], non-increasing
    thr = threshold.double()  # [B, 1]
    cut = (cumulative > thr).sum(dim=-1, keepdim=True).clamp(min=min_tokens_to_keep)  # [B, 1]
    first_out = cut.clamp(max=num_candidates - 1)  # [B, 1]
    last_in = first_out - 1  # [B, 1]; cut >= min_tokens_to_keep >= 1
    is_forced = cut - 1 < min_tokens_to_keep  # [B, 1]: the last kept token is kept whatever its cumulative
    certain = ((cut < num_candidates) & (cumulative.gather(1, first_out) <= thr - _TOP_P_MARGIN)
               & (is_forced | (cumulative.gather(1, last_in) > thr + _TOP_P_MARGIN))
               & (values.gather(1, first_out) != values.gather(1, last_in)))  # [B, 1]
    keep = torch.arange(num_candidates) < cut  # [B, K]
    remove = ~torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, keep)  # [B, V]
    return remove, certain[:, 0]


def apply_min_p(
    logits: torch.Tensor, min_p: RowParam, min_tokens_to_keep: int = 1, filter_value: float = FILTER_VALUE
) -> torch.Tensor:
    """Remove tokens whose probability is below min_p times the row's top probability.

    logits: [B, V] float; min_p: scalar or [B] in [0, 1] (0.0 disables).
    Returns [B, V]. Raises ValueError outside [0, 1]. Source: HF ``MinPLogitsWarper``
    (Nguyen et al. 2024, "Min P Sampling").
    """
    scale = _row_param(logits, "min_p", min_p, min_tokens_to_keep=min_tokens_to_keep)  # [B, 1]
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    top_probs = probs.max(dim=-1, keepdim=True).values  # [B, 1]
    remove = probs < scale * top_probs  # [B, V]
    if min_tokens_to_keep > 1:  # the top token is never below min_p (<= 1) times itself: one is kept anyway
        sorted_ids = torch.argsort(logits, descending=True, dim=-1)  # [B, V]
        sorted_remove = _keep_first(remove.gather(-1, sorted_ids), min_tokens_to_keep)  # [B, V]
        remove = sorted_remove.scatter(1, sorted_ids, sorted_remove)  # [B, V]
    return logits.masked_fill(remove & (scale > 0), filter_value)


def apply_typical_p(
    logits: torch.Tensor, typical_p: RowParam, min_tokens_to_keep: int = 1, filter_value: float = FILTER_VALUE
) -> torch.Tensor:
    """Locally typical sampling: keep tokens whose surprisal is closest to the entropy, up to mass typical_p.

    logits: [B, V] float; typical_p: scalar or [B] in (0, 1] (1.0 disables).
    Returns [B, V]. Raises ValueError outside (0, 1]. Source: HF ``TypicalLogitsWarper``
    (Meister et al. 2022, "Locally Typical Sampling").
    """
    mass = _row_param(logits, "typical_p", typical_p, min_tokens_to_keep=min_tokens_to_keep)  # [B, 1]
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1)  # [B, V]
    entropy = -(log_probs * torch.exp(log_probs)).nansum(-1, keepdim=True)  # [B, 1]
    shifted = torch.abs((-log_probs) - entropy)  # [B, V]
    sorted_shifted, sorted_ids = torch.sort(shifted, descending=False)  # [B, V]
    cumulative = logits.gather(-1, sorted_ids).softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    last = (cumulative < mass).sum(dim=1, keepdim=True).clamp(max=logits.shape[-1] - 1)  # [B, 1]
    sorted_remove = _keep_first(sorted_shifted > sorted_shifted.gather(1, last), min_tokens_to_keep)
    remove = sorted_remove.scatter(1, sorted_ids, sorted_remove)  # [B, V]
    return logits.masked_fill(remove & (mass < 1), filter_value)


def _outside_top(logits: torch.Tensor, min_tokens_to_keep: int) -> torch.Tensor:
    """[B, V] bool: below the row's ``min_tokens_to_keep``-th largest logit."""
    k = min(min_tokens_to_keep, logits.shape[-1])
    return logits < torch.topk(logits, k).values[..., -1:]  # [B, V]


def apply_epsilon_cutoff(
    logits: torch.Tensor, epsilon: RowParam, min_tokens_to_keep: int = 1, filter_value: float = FILTER_VALUE
) -> torch.Tensor:
    """Remove tokens with probability below epsilon (truncation sampling).

    logits: [B, V] float; epsilon: scalar or [B] in [0, 1) (0.0 disables).
    Returns [B, V]. Raises ValueError outside [0, 1). Source: HF ``EpsilonLogitsWarper``
    (Hewitt et al. 2022, "Truncation Sampling as Language Model Desmoothing").
    """
    eps = _row_param(logits, "epsilon_cutoff", epsilon, min_tokens_to_keep=min_tokens_to_keep)  # [B, 1]
    remove = (logits.softmax(dim=-1) < eps) & _outside_top(logits, min_tokens_to_keep)  # [B, V]
    return logits.masked_fill(remove & (eps > 0), filter_value)


def _categorical_entropy(logits: torch.Tensor) -> torch.Tensor:
    """[B] entropy in nats, computed as ``torch.distributions.Categorical`` does."""
    normalized = logits - logits.logsumexp(dim=-1, keepdim=True)  # [B, V]
    probs = torch.softmax(normalized, dim=-1)  # [B, V]
    clamped = torch.clamp(normalized, min=torch.finfo(normalized.dtype).min)  # -inf * 0 would be NaN
    return -(clamped * probs).sum(-1)  # [B]


def apply_eta_cutoff(
    logits: torch.Tensor, eta: RowParam, min_tokens_to_keep: int = 1, filter_value: float = FILTER_VALUE
) -> torch.Tensor:
    """Remove tokens with probability below min(eta, sqrt(eta) * exp(-entropy)).

    logits: [B, V] float; eta: scalar or [B] in [0, 1) (0.0 disables).
    Returns [B, V]. Raises ValueError outside [0, 1). Source: HF ``EtaLogitsWarper``
    (Hewitt et al. 2022).
    """
    eps = _row_param(logits, "eta_cutoff", eta, torch.float32, min_tokens_to_keep=min_tokens_to_keep)  # [B, 1]
    entropy = _categorical_entropy(logits).unsqueeze(1)  # [B, 1]
    threshold = torch.minimum(eps, torch.sqrt(eps) * torch.exp(-entropy)).to(logits.dtype)  # [B, 1]
    remove = (logits.softmax(dim=-1) < threshold) & _outside_top(logits, min_tokens_to_keep)  # [B, V]
    return logits.masked_fill(remove & (eps > 0), filter_value)


# ---------------------------------------------------------------- penalties


def apply_repetition_penalty(logits: torch.Tensor, token_ids: torch.Tensor, penalty: RowParam) -> torch.Tensor:
    """Penalize every id present in a row's history: positive logits / penalty, others * penalty.

    logits: [B, V] float; token_ids: [B, T] long (negative = padding); penalty: scalar
    or [B], > 0 (1.0 disables). Returns [B, V]. Raises ValueError for penalty <= 0 or
    ids >= V. Source: HF ``RepetitionPenaltyLogitsProcessor`` (Keskar et al. 2019, CTRL).
    """
    _check_logits(logits)
    _check_token_ids(token_ids, logits)
    validate_param("repetition_penalty", penalty, logits.shape[0])
    factor = _per_row(penalty, logits.shape[0], logits.dtype, logits.device)  # [B, 1]
    spill, ids = _with_spill_column(logits, token_ids)  # [B, V + 1], [B, T]
    seen = spill.gather(1, ids)  # [B, T]: only the history's entries change (O(T), as HF's gather/scatter)
    return spill.scatter_(1, ids, torch.where(seen < 0, seen * factor, seen / factor))[:, : logits.shape[1]]


def _with_spill_column(logits: torch.Tensor, token_ids: torch.Tensor, mask: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of logits [B, V] with one spill column [B, V + 1], and token_ids [B, T] with padding (negative ids, or
    False in ``mask``) sent to that column, so a gather/scatter over the history touches only its T entries."""
    is_real = token_ids >= 0 if mask is None else mask.to(torch.bool) & (token_ids >= 0)  # [B, T]
    spill = torch.cat([logits, logits.new_zeros(logits.shape[0], 1)], dim=1)  # [B, V + 1]
    return spill, torch.where(is_real, token_ids, logits.shape[1])  # [B, T]


def apply_presence_frequency_penalty(
    logits: torch.Tensor,
    output_token_ids: torch.Tensor,
    presence_penalty: RowParam,
    frequency_penalty: RowParam,
    output_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """OpenAI penalties: ``logits - frequency * count - presence * (count > 0)``.

    Counts run over generated tokens only. logits: [B, V] float; output_token_ids:
    [B, T] long; output_mask: [B, T] bool (True = real) or None (negative ids are
    padding); penalties: scalar or [B] in [-2, 2] (0.0 disables). Returns [B, V].
    Raises ValueError outside [-2, 2]. Source: OpenAI API reference, "Parameter details".
    """
    _check_logits(logits)
    _check_token_ids(output_token_ids, logits, "output_token_ids")
    validate_param("presence_penalty", presence_penalty, logits.shape[0])
    validate_param("frequency_penalty", frequency_penalty, logits.shape[0])
    num_rows, vocab_size = logits.shape
    presence = _per_row(presence_penalty, num_rows, logits.dtype, logits.device)  # [B, 1]
    frequency = _per_row(frequency_penalty, num_rows, logits.dtype, logits.device)  # [B, 1]
    spill, ids = _with_spill_column(logits, output_token_ids, output_mask)  # [B, V + 1], [B, T]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int32, device=logits.device)  # [B, V + 1]
    counts = counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32)).gather(1, ids).to(logits.dtype)
    # [B, T]: each entry's count; only the generated ids change (the same float ops as over all of V: x - f*c - p*1)
    penalized = spill.gather(1, ids) - frequency * counts - presence * (counts > 0).to(logits.dtype)  # [B, T]
    return spill.scatter_(1, ids, penalized)[:, :vocab_size]


def banned_ngram_tokens(history: Sequence[int], ngram_size: int) -> set[int]:
    """Ids that would repeat an n-gram already in ``history`` (n = ngram_size >= 1).

    Source: fairseq / HF ``_calc_banned_ngram_tokens``.
    """
    if ngram_size <= 0 or len(history) + 1 < ngram_size:
        return set()
    prefix = tuple(history[len(history) - ngram_size + 1 :])
    return {
        history[i + ngram_size - 1]
        for i in range(len(history) - ngram_size + 1)
        if tuple(history[i : i + ngram_size - 1]) == prefix
    }


def apply_no_repeat_ngram(logits: torch.Tensor, token_ids: torch.Tensor, ngram_size: RowParam) -> torch.Tensor:
    """Forbid any token that would complete an n-gram already present in the row's history.

    logits: [B, V] float; token_ids: [B, T] long (negative = padding, dropped);
    ngram_size: int or [B] long, >= 0 (0 disables). Returns [B, V] with banned ids at
    -inf. Raises ValueError for ngram_size < 0. Source: HF ``NoRepeatNGramLogitsProcessor``.
    """
    _check_logits(logits)
    _check_token_ids(token_ids, logits)
    validate_param("no_repeat_ngram_size", ngram_size, logits.shape[0])
    sizes = _per_row(ngram_size, logits.shape[0], torch.long, torch.device("cpu")).squeeze(1).tolist()
    out = logits.clone()
    for row, (history, size) in enumerate(zip(token_ids.tolist(), sizes)):
        banned = banned_ngram_tokens([t for t in history if t >= 0], size)
        if banned:
            out[row, sorted(banned)] = FILTER_VALUE
    return out


def _vocab_mask(token_ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] bool, True at the listed ids (ids outside the vocabulary are ignored, as in HF)."""
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    return torch.isin(torch.arange(vocab_size, device=device), ids)  # [V]


def apply_min_tokens(
    logits: torch.Tensor, num_generated: RowParam, min_tokens: RowParam, eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """Forbid every EOS id in rows that have generated fewer than ``min_tokens`` tokens.

    logits: [B, V] float; num_generated, min_tokens: int or [B] long, >= 0.
    Returns [B, V]. Raises ValueError for negative counts.
    Source: HF ``MinNewTokensLengthLogitsProcessor``.
    """
    _check_logits(logits)
    validate_param("num_generated", num_generated, logits.shape[0])
    validate_param("min_tokens", min_tokens, logits.shape[0])
    num_rows, vocab_size = logits.shape
    is_short = _per_row(num_generated, num_rows, torch.long, logits.device) < _per_row(
        min_tokens, num_rows, torch.long, logits.device
    )  # [B, 1]
    is_eos = _vocab_mask(eos_token_ids, vocab_size, logits.device)  # [V]
    return logits.masked_fill(is_short & is_eos, FILTER_VALUE)


def normalize_sequence_bias(sequence_bias: SequenceBias, name: str = "sequence_bias") -> dict[tuple[int, ...], float]:
    """``{(ids...): bias}`` from a dict or from HF's list of ``[ids, bias]`` pairs.

    Raises ValueError for an empty container, empty or negative id sequences, or
    non-numeric biases; ``name``: the setting the messages name (bad_words_ids are a -inf bias).
    """
    pairs: list[tuple[object, object]]
    if isinstance(sequence_bias, Mapping):
        pairs = list(sequence_bias.items())
    elif isinstance(sequence_bias, Sequence) and all(
        isinstance(p, Sequence) and len(p) == 2 for p in sequence_bias
    ):
        pairs = [(p[0], p[1]) for p in sequence_bias]
    else:
        raise ValueError(f"sequence_bias must be a dict or a list of [ids, bias] pairs, got {sequence_bias!r}")
    if not pairs:
        raise ValueError(f"sequence_bias must not be empty, got {sequence_bias!r}")
    result: dict[tuple[int, ...], float] = {}
    for key, bias in pairs:
        ids = tuple(key) if isinstance(key, Sequence) and not isinstance(key, str) else ()
        if not ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            part = "keys" if name == "sequence_bias" else "entries"
            raise ValueError(f"{name} {part} must be non-empty sequences of ids >= 0, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or (not math.isfinite(bias) and bias != -math.inf):
            raise ValueError(f"sequence_bias values must be finite numbers (or -inf), got {bias!r}")
        result[tuple(int(t) for t in ids)] = float(bias)
    return result


def apply_sequence_bias(logits: torch.Tensor, token_ids: torch.Tensor, sequence_bias: SequenceBias,
                        name: str = "sequence_bias") -> torch.Tensor:
    """Add a bias to the last id of each listed sequence when the history ends with the rest of it.

    Single-id sequences are always biased. logits: [B, V] float; token_ids: [B, T]
    long (negative = padding, never matches). Returns [B, V]. Raises ValueError for
    malformed biases or ids >= V. Source: HF ``SequenceBiasLogitsProcessor``.
    """
    _check_logits(logits)
    _check_token_ids(token_ids, logits)
    biases = normalize_sequence_bias(sequence_bias, name)
    vocab_size = logits.shape[1]
    too_big = [t for ids in biases for t in ids if t >= vocab_size]
    if too_big:
        raise ValueError(f"{name} ids must be < vocab size {vocab_size}, got {too_big}")
    single = torch.zeros(vocab_size, dtype=torch.float, device=logits.device)  # [V]
    single_items = [(ids[0], b) for ids, b in biases.items() if len(ids) == 1]
    if single_items:
        single[[i for i, _ in single_items]] = torch.tensor([b for _, b in single_items], device=logits.device)
    bias = torch.zeros_like(logits) + single  # [B, V]
    for ids, value in biases.items():
        if len(ids) == 1 or len(ids) > token_ids.shape[1]:
            continue
        prefix = torch.tensor(ids[:-1], dtype=token_ids.dtype, device=token_ids.device)  # [n - 1]
        is_match = torch.eq(token_ids[:, -len(prefix) :], prefix).all(dim=1)  # [B]
        bias[:, ids[-1]] += torch.where(is_match, value, 0.0)
    return logits + bias


def apply_bad_words(
    logits: torch.Tensor, token_ids: torch.Tensor, bad_words_ids: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Forbid the last id of each bad sequence when the history ends with the rest of it.

    logits: [B, V] float; token_ids: [B, T] long; bad_words_ids: non-empty list of
    non-empty id lists. Returns [B, V]. Raises ValueError for malformed lists.
    Source: HF ``NoBadWordsLogitsProcessor`` (a -inf sequence bias).
    """
    if not isinstance(bad_words_ids, Sequence) or not bad_words_ids:
        raise ValueError(f"bad_words_ids must be a non-empty list of id lists, got {bad_words_ids!r}")
    return apply_sequence_bias(logits, token_ids, {tuple(ids): FILTER_VALUE for ids in bad_words_ids}, "bad_words_ids")


def apply_suppress_tokens(logits: torch.Tensor, suppress_token_ids: Sequence[int]) -> torch.Tensor:
    """Set the listed ids to -inf in every row (ids >= V are ignored).

    logits: [B, V] float. Returns [B, V]. Source: HF ``SuppressTokensLogitsProcessor``.
    """
    _check_logits(logits)
    return logits.masked_fill(_vocab_mask(suppress_token_ids, logits.shape[1], logits.device), FILTER_VALUE)


# ------------------------------------------------------------- token choice


def choose_tokens(
    scores: torch.Tensor, do_sample: bool, generator: Generators = None, num_tokens: int = 1,
    draw: Draw = "multinomial",
) -> torch.Tensor:
    """The one token choice of ``generate()`` and the engine: best ids, or ids drawn from softmax(scores).

    scores: [B, V] float (processed logits or log-probs; -inf entries are never chosen).
    Greedy: ``argmax`` for one token (ties go to the lowest id), ``torch.topk`` order for
    more (beam search). Sampling: ``num_tokens`` draws without replacement from the float32
    softmax, from ``generator`` (one for the batch, or a list of B where each row draws from
    its own, so a seeded row gets the same ids whatever else is in the batch; ``None``
    entries use torch's default generator). ``draw="multinomial"`` is ``torch.multinomial``
    (HF's draws, seed for seed; it spends V exponential variates per row, ~1 ms at V = 49,152
    here); ``draw="inverse_cdf"`` (one token) spends one uniform variate per row on the
    float64 cumulative distribution, the same distribution ~10x cheaper (the engine's draw).
    Returns [B, num_tokens] long. Raises ValueError for num_tokens outside [1, V], an
    unknown ``draw``, or a generator list of the wrong length.
    Source: HF ``_sample`` (argmax / multinomial of softmax) and ``_beam_search`` (topk /
    multinomial of softmax over ``num_beams * V``); vLLM v1 ``Sampler.sample``.
    """
    _check_logits(scores)
    check_int("num_tokens", num_tokens, 1, scores.shape[1])
    if draw not in ("multinomial", "inverse_cdf") or (draw == "inverse_cdf" and num_tokens != 1):
        raise ValueError(f"draw must be 'multinomial', or 'inverse_cdf' for one token, got {draw!r}")
    if not do_sample:
        if num_tokens == 1:
            return torch.argmax(scores, dim=-1, keepdim=True)  # [B, 1]
        return torch.topk(scores, num_tokens).indices  # [B, K], best first
    probs = torch.softmax(scores.float(), dim=-1)  # [B, V]
    if draw == "inverse_cdf":
        return sample_inverse_cdf(probs, generator)  # [B, 1]
    return sample_from_probs(probs, generator, num_tokens)  # [B, K]


def sample_inverse_cdf(probs: torch.Tensor, generator: Generators = None) -> torch.Tensor:
    """One id per row by inversion: the first id whose cumulative probability exceeds u x the row's total.

    probs: [B, V] float, rows non-negative with a positive sum; generator as in
    ``choose_tokens`` (one float64 uniform u in [0, 1) per row). The search runs in two
    levels, over sums of blocks of ``_CDF_BLOCK`` ids and then inside the chosen block (float64
    cumulative sums), so no float64 copy of the row is made. A zero-probability id is never
    drawn. Returns [B, 1] long. Raises ValueError for a generator list of the wrong length.
    """
    _check_logits(probs)
    return inverse_cdf_at(probs, uniforms(probs.shape[0], generator))  # [B, 1]


def uniforms(num_rows: int, generator: Generators = None) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row, [B, 1], from ``generator`` as in ``choose_tokens`` (a list: row i
    draws from its own). Raises ValueError for a generator list of the wrong length."""
    generators = _row_generators(generator, num_rows)
    if generators is None:
        return torch.rand(num_rows, 1, generator=generator, dtype=torch.float64)  # type: ignore[arg-type]  # [B, 1]
    return torch.cat([torch.rand(1, 1, generator=g, dtype=torch.float64) for g in generators])  # [B, 1]


def inverse_cdf_at(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`sample_inverse_cdf` at given uniforms u [B, 1] float64: the first id whose cumulative probability
    exceeds u x the row's total (two-level search). probs: [B, V] float. Returns [B, 1] long."""
    num_rows, vocab_size = probs.shape
    blocks = torch.nn.functional.pad(probs, (0, -vocab_size % _CDF_BLOCK)).view(num_rows, -1, _CDF_BLOCK)  # [B, N, C]
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [B, N]
    target = u * block_cdf[:, -1:]  # [B, 1]
    block = _first_above(block_cdf, target)  # [B, 1]
    target = target - torch.nn.functional.pad(block_cdf, (1, 0)).gather(1, block)  # mass before the block: [B, 1]
    inner = blocks.gather(1, block.unsqueeze(-1).expand(-1, 1, _CDF_BLOCK))[:, 0].double().cumsum(dim=-1)  # [B, C]
    return block * _CDF_BLOCK + _first_above(inner, target)  # [B, 1]


_CDF_BLOCK = 256  # ids per block of sample_inverse_cdf's first search level


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the first column of the non-decreasing ``cdf`` [B, N] above ``target`` [B, 1], else (rounding) the
    first that reaches the row's last value: a column whose own increment is positive."""
    found = torch.searchsorted(cdf, target, right=True)  # [B, 1]
    return torch.minimum(found, torch.searchsorted(cdf, cdf[:, -1:].contiguous()))  # [B, 1]


def greedy(logits: torch.Tensor, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``choose_tokens`` without sampling, one id per row. logits: [B, V]. Returns [B] long. ``argmax``: a model's
    ``kernels.argmax`` (the same ids as ``torch.argmax``, ~10x faster at V = 49,152), used for float32 logits."""
    if argmax is not None and logits.dtype == torch.float32:
        return argmax(logits)  # [B]
    return choose_tokens(logits, do_sample=False).squeeze(1)  # [B]


def sample(logits: torch.Tensor, generator: Generators = None) -> torch.Tensor:
    """``choose_tokens`` with sampling, one id per row. logits: [B, V]. Returns [B] long."""
    return choose_tokens(logits, do_sample=True, generator=generator).squeeze(1)  # [B]


def sample_from_probs(probs: torch.Tensor, generator: Generators = None, num_samples: int = 1) -> torch.Tensor:
    """Draw ``num_samples`` ids per row (without replacement) with ``torch.multinomial``.

    probs: [B, V] float, rows non-negative with a positive sum; generator as in
    ``choose_tokens``. Returns [B, num_samples] long. Raises ValueError for a list of
    the wrong length, or for a row with no probability left (every token removed by the
    logits processors, or NaN scores), naming the row (transformers fails there too, with
    torch.multinomial's "probability tensor contains either inf, nan or element < 0").
    """
    _check_logits(probs)
    empty = ~(probs.sum(dim=-1) > 0)  # [B]; a NaN sum compares False too
    if bool(empty.any()):
        row = int(empty.nonzero()[0, 0])
        raise ValueError(f"no token left to sample in row {row}: the logits processors removed every token (or the "
                         "scores are NaN); loosen no_repeat_ngram_size, bad_words_ids, suppress_tokens or the cutoffs")
    generators = _row_generators(generator, probs.shape[0])
    if generators is None:
        return torch.multinomial(probs, num_samples=num_samples, generator=generator)  # type: ignore[arg-type]
    rows = [torch.multinomial(probs[i : i + 1], num_samples, generator=g) for i, g in enumerate(generators)]
    return torch.cat(rows)  # [B, K]


def _row_generators(generator: Generators, num_rows: int) -> Sequence[torch.Generator | None] | None:
    """None when one generator (or torch's default) serves the batch, else the per-row list, checked against
    ``num_rows`` (ValueError)."""
    if generator is None or isinstance(generator, torch.Generator):
        return None
    if len(generator) != num_rows:
        raise ValueError(f"generator list must have one entry per row ({num_rows}), got {len(generator)}")
    return generator


# ----------------------------------------------------------------- logprobs


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax in float32. logits: [B, V]. Returns [B, V] float32."""
    _check_logits(logits)
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its chosen id. logprobs: [B, V]; token_ids: [B] long. Returns [B]."""
    return logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [B]


def logprob_ranks(logprobs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Each row's 1-based vocabulary rank of its chosen id: how many ids have a log-probability >= the chosen one's
    (ties count against it). logprobs: [B, V]; token_ids: [B] long. Returns [B] long.
    Source: vLLM ``batched_count_greater_than`` (v1 ``Sampler.gather_logprobs``).
    """
    chosen = gather_logprobs(logprobs, token_ids)  # [B]
    return (logprobs >= chosen.unsqueeze(1)).sum(dim=1)  # [B]


def top_logprobs(logprobs: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``num`` largest log-probabilities per row and their ids, descending.

    logprobs: [B, V]. Returns ([B, num] float, [B, num] long). Raises ValueError
    unless 0 <= num <= V.
    """
    if isinstance(num, bool) or not isinstance(num, int) or not 0 <= num <= logprobs.shape[-1]:
        raise ValueError(f"num must be an int in [0, {logprobs.shape[-1]}], got {num!r}")
    values, ids = torch.topk(logprobs, num, dim=-1)  # [B, num]
    return values, ids
