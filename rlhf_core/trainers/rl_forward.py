"""The forward passes of online RL's roles: response-token log-probs (policy, reference, teacher) and token
values (critic), with what makes them cheap: padding trimmed, rows packed or laid out as prefix trees (a
group's shared prompt run once), no-grad passes in chunks of bounded memory split over data-parallel ranks,
and the allocator's cache handed back between colocated roles' phases.

Used by :mod:`rlhf_core.trainers.rl_roles`, the roles that hold the models. Only torch and transformers here.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_core.models.attention import VARLEN, packed_forward_kwargs
from rlhf_core.models.lm_head import LMHead, bypasses_head, head_bypassed, head_logprobs, unwrap
from rlhf_core.distributed.parallel import World
from rlhf_core.algorithms.rl_math import aggregation_units, entropy_from_logits
from rlhf_core.data.tokenize import group_by_tokens


def _model_inputs(exp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # position_ids count from each row's first real token, as generate did: without them a
    # left-padded row is scored at shifted positions and its ratio to the sampler drifts.
    return {"input_ids": exp["input_ids"], "attention_mask": exp["attention_mask"],
            "position_ids": exp["position_ids"]}


def _keeps_logits(model: Any) -> bool:
    """Whether the causal LM under any wrappers (DDP, DeepSpeed, peft) takes ``logits_to_keep``."""
    while hasattr(model, "module"):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return _forward_takes(type(model), "logits_to_keep")


@functools.lru_cache(maxsize=None)
def _forward_takes(cls: type, name: str) -> bool:
    return name in inspect.signature(cls.forward).parameters


@dataclass
class PrefixTree:
    """A chunk's rows laid out with each distinct prompt once (:func:`prefix_tree`), on the rows' device.

    A group is a prompt's attended tokens, then the attended response tokens of each row with that prompt, back
    to back; groups are packed into tree rows of the longest group's length (first-fit decreasing), the rest of
    a tree row padding. ``input_ids``, ``position_ids`` ``(B, L)``: the tokens and their positions as in the
    padded rows; ``mask`` ``(B, 1, L, L)`` bool: a prompt token sees its prompt's earlier tokens, a response
    token its prompt and its own row's earlier tokens, a padding token the padding before it and itself (padding
    ends a tree row, so no real token sees it; a query with no key would be NaN in forward and backward); ``scored`` ``(rows * R,)``: the flat
    tree position whose output predicts each response column (a padded column maps to its row's last attended
    token; the caller masks it); ``keep``: the last ``keep`` columns hold every scored position
    (``logits_to_keep``).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    scored: torch.Tensor
    keep: int


def _tree_rows(group_len: list[int]) -> tuple[list[int], int, int]:
    """Each group's flat start when groups are packed first-fit decreasing into rows of the longest group's
    length; that length and the row count."""
    L = max(group_len)
    bins = group_by_tokens(group_len, L)
    start = [0] * len(group_len)
    for b, members in enumerate(bins):
        at = b * L
        for g in members:
            start[g], at = at, at + group_len[g]
    return start, L, len(bins)


def prefix_tree(exp: dict[str, torch.Tensor], prompt_width: int) -> PrefixTree | None:
    """The :class:`PrefixTree` of ``exp``'s rows (prompts left-padded to ``prompt_width``, responses right-padded),
    or ``None`` if no prompt repeats. Index arithmetic on the rows' device; one read of the groups' lengths."""
    ids, att = exp["input_ids"], exp["attention_mask"].bool()
    P, (rows, W) = prompt_width, ids.shape
    R, dev = W - P, ids.device
    distinct, inverse = torch.unique(torch.cat([ids[:, :P], att[:, :P].long()], dim=1), dim=0, return_inverse=True)
    G = len(distinct)
    if P == 0 or G == rows:
        return None
    first = torch.full((G,), rows, dtype=torch.long, device=dev)
    first = first.scatter_reduce(0, inverse, torch.arange(rows, device=dev), reduce="amin")
    prompt_len = att[first, :P].sum(-1)  # (G,)
    resp_len = att[:, P:].sum(-1)  # (rows,)
    # where each row's response starts in its group: after the prompt and the earlier rows of its group
    order = torch.argsort(inverse, stable=True)
    csum = torch.cumsum(resp_len[order], 0) - resp_len[order]  # over the rows sorted by group
    group_first = torch.zeros(G, dtype=torch.long, device=dev).scatter_reduce(
        0, inverse[order], csum, reduce="amin", include_self=False)
    before = torch.empty_like(csum)
    before[order] = csum - group_first[inverse[order]]
    group_len = prompt_len + torch.zeros(G, dtype=torch.long, device=dev).index_add(0, inverse, resp_len)
    host = torch.cat([group_len, prompt_len]).tolist()
    starts, L, B = _tree_rows(host[:G])
    base = torch.tensor(starts, device=dev)  # (G,) flat start of each group
    # destination of every attended token: prompts from their first rows, responses from every row
    p_att, r_att = att[first, :P], att[:, P:]
    p_dest = base[:, None] + p_att.long().cumsum(-1) - 1  # (G, P)
    r_rank = r_att.long().cumsum(-1)  # (rows, R): attended response tokens up to and including each column
    r_dest = (base + prompt_len)[inverse][:, None] + before[:, None] + r_rank - 1  # (rows, R)
    flat_ids = torch.zeros(B * L, dtype=ids.dtype, device=dev)
    flat_pos = torch.zeros(B * L, dtype=exp["position_ids"].dtype, device=dev)
    owner = torch.full((B * L,), -2, dtype=torch.long, device=dev)  # -2 padding, -1 prompt, else the row
    group = torch.full((B * L,), -1, dtype=torch.long, device=dev)
    row_ids = torch.arange(rows, device=dev)[:, None].expand(rows, R)
    for dest, keep, src_ids, src_pos, who, grp in (
            (p_dest, p_att, ids[first, :P], exp["position_ids"][first, :P], torch.full_like(p_dest, -1),
             torch.arange(G, device=dev)[:, None].expand(G, P)),
            (r_dest, r_att, ids[:, P:], exp["position_ids"][:, P:], row_ids, inverse[:, None].expand(rows, R))):
        flat_ids[dest[keep]] = src_ids[keep]
        flat_pos[dest[keep]] = src_pos[keep]
        owner[dest[keep]] = who[keep]
        group[dest[keep]] = grp[keep]
    owner, group = owner.view(B, L), group.view(B, L)
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    key_owner = owner[:, None, :]  # (B, 1, key) against (B, query, 1); padding is group -1, owner -2
    sees = (group[:, None, :] == group[:, :, None]) & ((key_owner == -1) | (key_owner == owner[:, :, None]))
    mask = causal & sees
    # response column c is predicted by the row's attended token before it, or by its prompt's last token
    earlier = r_rank - r_att.long()  # (rows, R) attended response tokens before column c
    last_prompt = (base + prompt_len - 1)[inverse][:, None]
    scored = torch.where(earlier > 0, r_dest - r_att.long(), last_prompt)
    keep = L - int(min(host[G:])) + 1  # every group starts at or after its row's column 0
    return PrefixTree(flat_ids.view(B, L), flat_pos.view(B, L), mask[:, None], scored.flatten(), keep)


def _shared_prompt_logits(model: Any, exp: dict[str, torch.Tensor], prompt_width: int) -> torch.Tensor | None:
    """``(rows, R, V)`` logits (hidden states with the head bypassed) of the response positions with each distinct
    prompt run once; ``None`` if none repeats.

    GRPO-style groups score ``n`` responses to one prompt, and on short answers the prompt is most of the
    tokens (60% on the embedded default). One forward over the rows' prefix tree (:func:`prefix_tree`): each
    distinct prompt, then its responses, each response attending to the prompt and to itself, several such
    groups to a tree row. The same attention over the same keys as the padded rows, so the same log-probs and
    gradients to rounding (``tests/model/test_rl_tiny.py``), with no response padding computed and one model
    call. An earlier version ran the prompts with a KV cache, then the responses on it: two calls, the second
    on padded responses (a CPU GRPO step 0.514 s against the tree's 0.436 s, BENCHMARKS.md).
    """
    tree = prefix_tree(exp, prompt_width)
    if tree is None:
        return None
    kwargs = {"logits_to_keep": tree.keep} if _keeps_logits(model) else {}
    out = model(input_ids=tree.input_ids, position_ids=tree.position_ids, attention_mask=tree.mask,
                use_cache=False, **kwargs).logits
    L = tree.input_ids.shape[1]
    drop = L - out.shape[1]  # the columns logits_to_keep left out, all left of every scored position
    rows, R = exp["input_ids"].shape[0], exp["input_ids"].shape[1] - prompt_width
    scored = (tree.scored // L) * out.shape[1] + tree.scored % L - drop  # positions in the kept columns
    return out.flatten(0, 1)[scored].view(rows, R, -1)


@dataclass
class PackedRows:
    """Where a chunk of rows' attended tokens sit in one padding-free row (:func:`pack_rows`), on the device.

    ``index (N,)``: the padded flat position of each packed token; ``positions (1, N)``: its position id
    (restarting at 0 at each row's first real token); ``scored (rows * R,)``: the packed position predicting
    each response column (a padded column maps to its row's last real token; the caller masks it);
    ``forward_kwargs``: the sequence bounds for the varlen attention (:func:`packed_forward_kwargs`).
    """

    index: torch.Tensor
    positions: torch.Tensor
    scored: torch.Tensor
    forward_kwargs: dict[str, Any]


def pack_rows(model: Any, exp: dict[str, torch.Tensor], prompt_width: int,
              host: torch.Tensor | None = None) -> PackedRows:
    """The :class:`PackedRows` of ``exp``'s rows (left-padded prompts of width ``prompt_width``, right-padded
    responses), worked out on the host from one copy of the mask and positions: this waits for the device
    once, or not at all when ``host`` is that copy already, ``(2, rows, W)`` long (attention mask, positions; the
    policy update reads every micro-batch's in one transfer, :func:`read_together`). The update works out every
    micro-batch's before the first forward, so no micro-batch waits for the one before it (a wait there drained
    the queue of launched work at each micro-batch)."""
    rows, W = exp["attention_mask"].shape
    device = exp["input_ids"].device
    if host is None:
        host = torch.stack([exp["attention_mask"].long(), exp["position_ids"].long()]).cpu()  # (2, rows, W)
    keep = host[0].flatten().bool()
    index = keep.nonzero().squeeze(-1)  # (N,) padded flat position of each packed token
    positions = host[1].flatten()[index][None]  # (1, N)
    at = (keep.cumsum(0) - 1).clamp(min=0).view(rows, W)  # padded column -> packed position
    scored = at[:, prompt_width - 1:W - 1].reshape(-1)  # (rows * R,)

    def to_device(t: torch.Tensor) -> torch.Tensor:  # from pinned memory: queued, no wait for the device
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)

    return PackedRows(to_device(index), to_device(positions), to_device(scored),
                      packed_forward_kwargs(model, positions, device))


def resolve_packing(setting: bool | str, model: Any) -> bool:
    """``rl.packing``: true or false as set; auto packs where ``model`` attends with the variable-length flash
    kernel (:data:`rlhf_core.models.attention.VARLEN`, chosen at load on a CUDA device) and pads elsewhere."""
    if setting != "auto":
        return bool(setting)
    base = unwrap(model)
    return getattr(getattr(base, "config", None), "_attn_implementation", None) == VARLEN


def _packed_response_logits(model: Any, exp: dict[str, torch.Tensor], prompt_width: int,
                            packed: PackedRows | None = None) -> torch.Tensor:
    """``(rows, R, V)`` logits (hidden states ``(rows, R, H)`` with the head bypassed) of the positions that
    predict the response tokens, from one padding-free row: each row's attended tokens back to back, its
    ``position_ids`` restarting at 0, so attention stays within each row (the varlen flash kernel on a GPU,
    :mod:`rlhf_core.models.attention`; a block-diagonal SDPA mask elsewhere) and no padded column is computed.

    ``packed``: the rows' layout (:func:`pack_rows`), worked out here when not given. The head runs on the
    scored positions only (``logits_to_keep`` as indices). A padded response column's log-prob is masked by
    the caller as on the padded path.
    """
    rows, W = exp["attention_mask"].shape
    packed = packed if packed is not None else pack_rows(model, exp, prompt_width)
    inputs = {"input_ids": exp["input_ids"].flatten()[packed.index][None], "position_ids": packed.positions}
    if _keeps_logits(model):
        out = model(**inputs, use_cache=False, logits_to_keep=packed.scored, **packed.forward_kwargs).logits[0]
    else:
        out = model(**inputs, use_cache=False, **packed.forward_kwargs).logits[0][packed.scored]
    return out.view(rows, W - prompt_width, -1)


def _response_logits(model: Any, exp: dict[str, torch.Tensor], prompt_width: int, share_prompts: bool,
                     packed: bool | PackedRows = False) -> torch.Tensor:
    """``(rows, R, V)`` logits (hidden states ``(rows, R, H)`` with the head bypassed) of the positions that
    predict the response tokens: one padding-free row (``packed``), the distinct prompts once
    (``share_prompts``), or the padded rows."""
    if packed:
        return _packed_response_logits(model, exp, prompt_width, packed if isinstance(packed, PackedRows) else None)
    logits = _shared_prompt_logits(model, exp, prompt_width) if share_prompts else None
    if logits is None:
        width = exp["input_ids"].shape[1]
        kwargs = {"logits_to_keep": width - prompt_width + 1} if _keeps_logits(model) else {}
        logits = model(**_model_inputs(exp), use_cache=False, **kwargs).logits[:, -(width - prompt_width + 1):-1]
    return logits


def token_logprobs(model: Any, exp: dict[str, torch.Tensor], prompt_width: int, temperature: float,
                   with_entropy: bool = False, entropy_grad: bool = False,
                   share_prompts: bool = False, head: LMHead = LMHead(),
                   packed: bool | PackedRows = False, parity: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rows, R)`` ``log_softmax(logits / T)`` of each response token, and optionally its entropy.

    The logits at position ``t`` predict token ``t + 1``, so the response tokens (columns
    ``P .. P+R-1``) are scored by columns ``P-1 .. P+R-2``; the LM head runs on those ``R + 1``
    positions only (``logits_to_keep``), never on the prompt. Dividing by the sampling temperature
    matches the engine's ``sampling_logprobs`` (see :mod:`rlhf_core.rollout.engine`), so on-policy ratios are 1.
    The entropy (a diagnostic unless it enters the loss) carries a gradient only with ``entropy_grad``.
    ``share_prompts`` runs each distinct prompt once (:func:`_shared_prompt_logits`); ``packed`` runs the rows
    as one padding-free row instead (:func:`_packed_response_logits`, ``rl.packing``; their layout from
    :func:`pack_rows` where already worked out).

    ``log_softmax(z)[y] = z_y - logsumexp(z)``: gathering before normalising keeps no ``(rows, R, V)``
    log-softmax tensor alive for backward. With ``head`` chunked or liger (:mod:`rlhf_core.models.lm_head`) the
    model returns hidden states and no ``(rows, R, V)`` logits exist at all.

    ``parity`` (``rl.rollout.parity``, a batch-invariant model): whole logits and ``log_softmax`` then gather, the HF
    engine's own arithmetic (:class:`rlhf_core.rollout.engine._SampledTokenLogprobs`), so the bits match its.
    """
    if not parity and bypasses_head(model, head):
        with head_bypassed(model) as lm_head:
            hidden = _response_logits(model, exp, prompt_width, share_prompts, packed)  # (rows, R, H): hidden states
        rows, R = exp["response_ids"].shape
        logp, entropy = head_logprobs(lm_head, hidden.reshape(rows * R, -1), exp["response_ids"].reshape(-1), head,
                                      temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)
        return logp.view(rows, R), (entropy.view(rows, R) if entropy is not None else None)
    logits = _response_logits(model, exp, prompt_width, share_prompts, packed).float()
    if temperature != 1.0:
        logits = logits / temperature
    if parity:
        logp = torch.log_softmax(logits, dim=-1).gather(-1, exp["response_ids"].unsqueeze(-1)).squeeze(-1)
    else:
        logp = logits.gather(-1, exp["response_ids"].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logp, entropy_from_logits(logits if entropy_grad else logits.detach())


def token_values(critic: Any, exp: dict[str, torch.Tensor], prompt_width: int) -> torch.Tensor:
    """``(rows, R)`` ``V(s_t)``: the critic's scalar head on the hidden state that precedes response token ``t``.

    ``critic`` is an ``AutoModelForSequenceClassification`` (:func:`rlhf_core.rewards.model.load_reward_model`);
    its backbone gives every position's hidden state and its ``score`` head maps each to a value,
    where the reward-model forward would keep only the last token's.
    """
    hidden = critic.base_model(**_model_inputs(exp), use_cache=False).last_hidden_state
    return critic.score(hidden[:, prompt_width - 1:-1]).squeeze(-1).float()


_SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")


def read_together(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU copies of ``tensors`` with one wait for the device: each copy queued into pinned memory, then one
    synchronize (a ``.cpu()`` or ``int()`` each would wait once each). On a CPU, the tensors themselves."""
    if not tensors or not tensors[0].is_cuda:
        return [t.cpu() for t in tensors]
    out = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return out


def trim_widths(attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """``(2,)`` on the rows' device: the longest prompt and the longest response among the rows of
    ``attention_mask (rows, P + R)``, what :func:`trim_padding` keeps (read on the host by the caller)."""
    return torch.stack([attention_mask[:, :prompt_width].sum(-1).max(), attention_mask[:, prompt_width:].sum(-1).max()])


def trim_padding(exp: dict[str, torch.Tensor], prompt_width: int,
                 widths: tuple[int, int] | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """A chunk of rows without the columns that are padding in all of them; and the chunk's prompt width.
    ``widths``: the chunk's :func:`trim_widths`, already read (else read here: a wait for the device).

    Prompts are left-padded to the batch's longest and responses right-padded to its longest, so a
    chunk of short rows carries columns nobody needs: those left of its own longest prompt and right
    of its own longest response are dropped (``(rows, P + R)`` keys and ``(rows, R)`` keys alike).
    Positions travel in ``position_ids``, so the kept tokens are scored exactly as before; dropped
    response columns are masked everywhere, so losses and log-probs of real tokens do not change.
    """
    att = exp["attention_mask"]
    R = att.shape[1] - prompt_width
    longest_prompt, longest_response = widths if widths is not None else trim_widths(att, prompt_width).tolist()
    start = prompt_width - int(longest_prompt)
    r = max(int(longest_response), 1)
    out = {}
    for k, v in exp.items():
        if k in _SEQUENCE_KEYS:
            out[k] = v[:, start:prompt_width + r]
        elif v.dim() >= 2 and v.shape[1] == R:
            out[k] = v[:, :r]
        else:
            out[k] = v
    return out, prompt_width - start


def by_length(exp: dict[str, torch.Tensor], rows: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """Positions into ``rows`` ordering them by prompt length, then prompt, then response length.

    Consecutive chunks then hold rows of similar widths (:func:`trim_padding` drops more columns)
    and whole groups of one prompt (:func:`_shared_prompt_logits` runs it once).
    """
    att = exp["attention_mask"][rows]
    prompt = torch.cat([exp["input_ids"][rows, :prompt_width], att[:, :prompt_width]], dim=1)
    prompt_id = torch.unique(prompt, dim=0, return_inverse=True)[1]
    order = torch.argsort(att[:, prompt_width:].sum(-1), stable=True)
    order = order[torch.argsort(prompt_id[order], stable=True)]
    return order[torch.argsort(att[order, :prompt_width].sum(-1), stable=True)]


def micro_batches(model: Any, mb: dict[str, torch.Tensor], prompt_width: int, n: int, aggregation: Any,
                  packing: bool) -> tuple[list, list, list[float], float]:
    """The policy update's mini-batch ``mb`` as ``n`` micro-batches ``(rows, prompt width)``: rows of similar length
    together (:func:`by_length`), each trimmed to its own widths (the summed gradient is the same whichever rows
    share a micro-batch); each one's packed layout (:func:`pack_rows`, with ``packing``; else False) and loss units
    (:func:`aggregation_units`); and the mini-batch's token count. Every width, unit count and packed layout comes
    from one read of the device (:func:`read_together`), before the first forward."""
    rows = torch.arange(mb["mask"].shape[0], device=mb["mask"].device)
    order = by_length(mb, rows, prompt_width)
    chunks = torch.tensor_split(order, n)
    if any(len(c) == 0 for c in chunks):
        raise ValueError(f"rl.micro_batch_size: a mini-batch share of {len(rows)} rows cannot fill "
                         f"{n} micro-batches; raise micro_batch_size or mini_batch_size")
    parts = [{k: v[chunk] for k, v in mb.items()} for chunk in chunks]
    # per micro-batch: longest prompt, longest response, loss units (over its untrimmed columns: the trimmed ones
    # carry no mask); then the mini-batch's tokens. Counts below 2^24: exact in float32 and float64 alike.
    counts = torch.cat([torch.cat([trim_widths(p["attention_mask"], prompt_width).double(),
                                   aggregation_units(p["mask"], aggregation).double().reshape(1)]) for p in parts]
                       + [mb["mask"].sum().double().reshape(1)])
    layout = [torch.stack([mb["attention_mask"].long(), mb["position_ids"].long()])[:, order]] if packing else []
    counts, *layout = read_together(counts, *layout)
    values = counts.tolist()
    micro, packed, units, at = [], [], [], 0
    for i, part in enumerate(parts):
        longest_prompt, longest_response, unit = values[3 * i:3 * i + 3]
        m, width = trim_padding(part, prompt_width, (int(longest_prompt), int(longest_response)))
        micro.append((m, width))
        units.append(unit)
        packed.append(False)
        if packing:  # this micro-batch's rows (consecutive in ``order``) and kept columns
            start, size = prompt_width - width, len(chunks[i])
            host = layout[0][:, at:at + size, start:start + m["attention_mask"].shape[1]]
            packed[-1], at = pack_rows(model, m, width, host=host), at + size
    return micro, packed, units, values[-1]


@torch.no_grad()
def in_chunks(fn: Any, exp: dict[str, torch.Tensor], prompt_width: int, rows: torch.Tensor,
              n_chunks: int) -> torch.Tensor:
    """``fn(chunk, chunk_prompt_width)`` over ``n_chunks`` chunks of the rows ``rows`` of ``exp`` (no gradient).

    Rows are grouped by length and each chunk trimmed (:func:`trim_padding`); results come back
    ``(len(rows), R)`` in the order of ``rows``, zero in trimmed columns. The chunk count is the
    same on every rank (ZeRO-3 gathers parameters in every forward, so ranks must run the same
    number of them).
    """
    R = exp["input_ids"].shape[1] - prompt_width
    order = by_length(exp, rows, prompt_width)
    out = None
    for chunk in torch.tensor_split(order, n_chunks):
        part, width = trim_padding({k: v[rows[chunk]] for k, v in exp.items()}, prompt_width)
        value = fn(part, width)
        if out is None:
            out = value.new_zeros((len(rows), R))
        out[chunk, :value.shape[1]] = value
    return out


def to(exp: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in exp.items()}


RELEASE_MEMORY = False
"""Whether :func:`release_memory` hands the cache back in this process: True in Ray's actors (colocated roles on
one GPU), set by :class:`rlhf_core.trainers.ray_launcher.Launcher` as it starts them; a bench A/B sets it by name."""


def release_memory() -> None:
    """Hand cached CUDA allocator blocks back between phases where this process shares its GPU with others
    (:data:`RELEASE_MEMORY`). One process holding every role needs no hand-back: its roles share
    one caching allocator, and each ``empty_cache`` (a ``cudaFree`` of every cached segment, which waits for
    the device) made the next phase allocate its segments afresh, three times an RL iteration. Nothing on a CPU.

    Only the allocator's cache: a full ``gc.collect()`` here cost 0.2 s per call (three per RL
    iteration) with transformers loaded, measured on the embedded default, and the phases'
    tensors are freed by reference counting, not by the cycle collector.
    """
    if RELEASE_MEMORY and torch.cuda.is_available() \
            and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# A no-grad log-prob pass keeps a chunk's largest transient tensor under this many bytes. Where the model's
# own head runs, that is the chunk's float32 logits (rows x R x V): at 512 rows x 256 tokens x 32k vocabulary
# one pass would otherwise hold 17 GB (measured: 46 GB peak). Where the head is bypassed (chunked, liger:
# :func:`rlhf_core.models.lm_head.head_logprobs` bounds its own logits), it is the decoder's MLP projection
# (rows x width x 2 intermediate, in the weights' dtype). Counting V there split a 1.5B GRPO reference
# pass (V = 151,936) into 38 forwards of 13-14 rows, which also split prompt groups across chunks.
_CHUNK_BYTES = 2 * 2**30


def chunk_bytes_per_row(model: Any, head: LMHead, width: int, response_len: int) -> int:
    """Bytes of a no-grad log-prob chunk's largest transient per row of ``width`` tokens (``response_len``
    of them scored): float32 logits over the vocabulary with the model's own head, else the decoder's MLP
    projection (:data:`_CHUNK_BYTES`). 0 for a model without a config (nothing to bound)."""
    config = getattr(unwrap(model), "config", None)
    if config is None:
        return 0
    if not bypasses_head(model, head):
        return response_len * (getattr(config, "vocab_size", 0) or 0) * 4
    hidden = getattr(config, "hidden_size", 0) or 0
    intermediate = getattr(config, "intermediate_size", 0) or 4 * hidden
    itemsize = next(unwrap(model).parameters()).element_size()
    return width * 2 * intermediate * itemsize


class Sharded:
    """Rows of this rank and the chunking every rank agrees on."""

    def __init__(self, world: World, rows: int, batch_size: int, row_bytes: int = 0):
        self.rows = torch.arange(rows)[world.rows(rows)]
        by_rows = -(-rows // (batch_size * world.size))
        per_rank = -(-rows // world.size)
        by_bytes = -(-per_rank * row_bytes // _CHUNK_BYTES)
        self.n_chunks = max(1, by_rows, by_bytes)


def sharded(world: World, exp: dict[str, torch.Tensor], prompt_width: int, batch_size: int, model: Any,
            head: LMHead) -> Sharded:
    rows, width = exp["input_ids"].shape
    return Sharded(world, rows, batch_size, chunk_bytes_per_row(model, head, width, width - prompt_width))
