"""How an offline trainer's examples become a step's micro-batches: the seeded sampler, the draw/collate
contract (:class:`MicroBatches`) and the empty micro-batch a data-parallel rank runs to keep in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch


class EpochSampler:
    """Indices of ``n`` examples in batches of ``batch_size``, reshuffled every epoch from ``seed``.

    Deterministic: the same seed gives the same order on every run (a batch may straddle two
    epochs; none is dropped). With a data-parallel ``world`` every rank draws the same global
    batch and keeps its rows ``rank::size`` of it, so N workers see the examples one would.
    """

    def __init__(self, n: int, batch_size: int, seed: int, world: Any = None):
        if n < 1:
            raise ValueError("cannot sample batches from an empty dataset")
        self.n, self.batch_size, self.world = n, batch_size, world
        self.generator = torch.Generator().manual_seed(seed)
        self.order: list[int] = []

    def next(self) -> list[int]:
        while len(self.order) < self.batch_size:
            self.order += torch.randperm(self.n, generator=self.generator).tolist()
        idx, self.order = self.order[:self.batch_size], self.order[self.batch_size:]
        return idx if self.world is None else idx[self.world.rows(len(idx))]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Generator state and the rest of the current epoch's order (checkpoint contents)."""
        return {"generator": self.generator.get_state(), "order": torch.tensor(self.order, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])
        self.order = [int(i) for i in state["order"].tolist()]


@dataclass
class MicroBatches:
    """How an offline trainer's data becomes a step's micro-batches (the loop draws, groups and collates).

    A step draws ``grad_accum`` times, so its examples are the same with or without packing. Without
    a token budget each draw is one micro-batch; with one (``micro_batch_tokens``) the step's examples
    are regrouped by :func:`rlhf_core.data.tokenize.group_by_tokens`. An example is whatever ``collate`` takes: a dataset
    index, or an index with its partner (a DPO pair travels as one example, so it is never split).
    """

    draw: Callable[[], list[Any]]
    """this rank's examples of the next ``batch_size`` draw (``EpochSampler.next``, or items made from it)"""
    collate: Callable[[list[Any]], dict[str, torch.Tensor]]
    """a micro-batch (padded or packed, as the config says) of some examples"""
    tokens: Callable[[Any], int]
    """an example's token count once collated packed (both sequences of a pair)"""
    ahead: bool = True
    """draw and collate the next step's micro-batches while the device runs this step's (False where a draw
    runs the model, as a batch-level reference point does: it must see the weights this step leaves)"""


@dataclass
class EmptyMicroBatch:
    """A micro-batch that adds nothing to a step: run so this rank joins a backward the others run.

    DDP reduces gradients in the last backward of a step and ZeRO in every backward, so all ranks
    must run as many micro-batches; a rank whose examples fit in fewer runs these (a one-token
    forward whose loss is multiplied by 0) until it has the count every rank agreed on.
    """

    input_ids: torch.Tensor
    """``(1, 1)``: one token of one of this rank's real micro-batches"""


def real_tokens(batch: Any) -> int:
    """Non-padding tokens of a micro-batch (``perf/tokens_per_s`` means the same padded or packed)."""
    if isinstance(batch, EmptyMicroBatch):
        return 0
    if "n_tokens" in batch:  # pairs as prefix trees (collate_pair_tree): their sequences' tokens, as padded
        return int(batch["n_tokens"])
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


def batched(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    """Consecutive slices of ``items`` of length ``size`` (the last may be shorter)."""
    for start in range(0, len(items), size):
        yield items[start:start + size]
