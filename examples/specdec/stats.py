"""A training step's statistics, as they travel with its gradients: the one place that says what they are and
where each one lies.

Each drafter replica keeps its gradients in one flat buffer (``steps.Replica``), and the step's statistics ride
behind them: the gradient average (``runtime.Reducer``: one sum, one division, one all-reduce) averages them with
the gradients, and the leader copies them to the host in one piece (``runtime.StatsLog``), so the loop never waits
for the device to log a loss. Everything else names the fields of ``StepStats``; no other module knows an offset.

A field is one of two kinds:

* measured on each batch by the loss (``models.ttt_loss`` hands them to ``pack`` by name): every batch of the step
  adds them into the buffer, and the average divides them like the gradients (a mean over the step's batches);
* set on the average (``after_average``): written into the averaged buffer afterwards (the gradient norm, by the
  clipping, ``steps.clip_gradients``).

A new statistic is one field here and its value in ``models.ttt_loss`` (``pack`` refuses a missing or unknown
one); the metrics log (``StepStats.record``) takes it from there.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


def stat(digits: int, *, per_ttt_step: bool = False, after_average: bool = False) -> Any:
    """A field of ``StepStats``: its rounding in the metrics log, one value per TTT step or one in all, and
    whether it is set on the average instead of measured per batch."""
    return field(metadata={"digits": digits, "per_ttt_step": per_ttt_step, "after_average": after_average})


@dataclass(frozen=True)
class StepStats:
    """One step's statistics on the host, in the order of the metrics log's ``train`` records."""

    loss: float = stat(6)  # the TTT loss: step losses weighted by --step-decay
    acc: tuple[float, ...] = stat(4, per_ttt_step=True)  # greedy accuracy of each TTT step against the target's token
    grad_norm: float = stat(4, after_average=True)  # norm of the averaged gradient, before clipping

    def record(self) -> dict[str, Any]:
        """The fields, rounded, for the metrics log."""
        return {f.name: _rounded(getattr(self, f.name), f.metadata["digits"]) for f in dataclasses.fields(self)}


def _rounded(value: float | tuple[float, ...], digits: int) -> float | list[float]:
    return [round(v, digits) for v in value] if isinstance(value, tuple) else round(value, digits)


# In buffer order: the measured fields first (one contiguous slice that each batch adds into), then the others.
_FIELDS = sorted(dataclasses.fields(StepStats), key=lambda f: f.metadata["after_average"])
MEASURED = tuple(f.name for f in _FIELDS if not f.metadata["after_average"])


def pack(**measured: torch.Tensor) -> torch.Tensor:
    """The measured statistics of one batch (each a tensor: one value, or one per TTT step) as the vector that is
    added into the buffer's measured slice; detached (statistics get no gradient). Called in compiled code."""
    if len(measured) != len(MEASURED) or any(name not in measured for name in MEASURED):
        raise TypeError(f"pack() takes exactly the measured statistics {MEASURED}, got {tuple(measured)}")
    return torch.cat([measured[name].detach().reshape(-1) for name in MEASURED])


class Layout:
    """Where the gradients and each statistic lie in a replica's flat buffer of ``size`` entries:
    ``[gradients | measured statistics | statistics set on the average]``."""

    def __init__(self, n_grad: int, ttt_steps: int) -> None:
        self.n_grad = n_grad
        self.slices: dict[str, slice] = {}
        self.per_step = {f.name: bool(f.metadata["per_ttt_step"]) for f in _FIELDS}
        at = n_grad
        for f in _FIELDS:
            width = ttt_steps if self.per_step[f.name] else 1
            self.slices[f.name] = slice(at, at + width)
            at += width
        self.size = at
        self.measured = slice(n_grad, self.slices[MEASURED[-1]].stop)

    def grads(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[:self.n_grad]

    def field(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """The entries of statistic ``name`` (a view: writing it writes the buffer)."""
        return flat[self.slices[name]]

    def stats(self, flat: torch.Tensor) -> torch.Tensor:
        """Every statistic, as the host copy takes them (``unpack`` reads that copy)."""
        return flat[self.n_grad:]

    def unpack(self, values: Sequence[float]) -> StepStats:
        """``StepStats`` from the host copy of ``stats``."""
        named: dict[str, Any] = {}
        for name, s in self.slices.items():
            part = tuple(values[s.start - self.n_grad:s.stop - self.n_grad])
            named[name] = part if self.per_step[name] else part[0]
        return StepStats(**named)
