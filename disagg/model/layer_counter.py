"""The per-layer progress counter the model bumps inside its forward pass (S3b, S3c).

The model cannot call back into Python per layer when its forward is a captured CUDA graph, so
it increments a 64-bit word instead, after each layer's attention output projection. The word
is monotonic across forwards (never reset), so a poller needs no handshake per forward:
after `value` bumps, layers `0..(value - 1) % num_layers` of forward `(value - 1) // num_layers`
are done. A poller thread in the messenger watches the word (`transfer_core.poller`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported where a counter gets one: the engine alone loads no transfer core
    from transfer_core.doorbell import Doorbell


class LayerCounter:
    """A 64-bit counter stored in a tensor the model increments in-graph.

    On CPU it is an ordinary int64 tensor; on a GPU it can wrap a CUDA view of mapped pinned
    host memory, so the host sees each bump without a copy.
    """

    def __init__(self, value: torch.Tensor | None = None, poll_target: object = None,
                 doorbell: Doorbell | None = None) -> None:
        # On the CPU even where a model is built on the meta device (`Transformer.holding`).
        self.value = (torch.zeros(1, dtype=torch.int64, device="cpu") if value is None
                      else value)
        if self.value.dtype != torch.int64 or self.value.numel() != 1:
            raise ValueError(f"a layer counter needs one int64 element, got "
                             f"{self.value.dtype} x {self.value.numel()}")
        # What a `CounterPoller` watches: the tensor itself on CPU, the host side of the
        # mapped word on a GPU (the poller cannot read device memory).
        self.poll_target = self.value if poll_target is None else poll_target
        # Rung after each bump on CPU, so the poller sleeps until then (a kernel cannot ring).
        self.doorbell = doorbell

    @classmethod
    def for_device(cls, device: str | torch.device) -> LayerCounter:
        """A counter the model on `device` can bump in stream order and a poller can watch.

        On CPU an ordinary tensor. On CUDA a word of mapped pinned host memory: a CPU tensor
        bumped from Python would run as soon as the op is *issued*, long before the GPU has
        written the layer's KV, and could not be captured in a graph.
        """
        device = torch.device(device)
        if device.type == "cpu":
            from transfer_core.doorbell import Doorbell

            return cls(doorbell=Doorbell())
        from transfer_core.cuda.mapped_counter import MappedCounter  # GPU only; imports cuda-python

        mapped = MappedCounter(device.index or 0)
        return cls(mapped.device_tensor, poll_target=mapped)

    def bump(self) -> None:
        """Record one more finished layer (a tensor op, so it is captured in a graph), then
        ring the doorbell if the counter has one."""
        self.value.add_(1)
        if self.doorbell is not None:
            self.doorbell.ring()

    def read(self) -> int:
        """The current count (a host read; use the poller rather than spinning on this)."""
        return int(self.value.item())

    @staticmethod
    def decode(value: int, num_layers: int) -> tuple[int, int]:
        """`(forward_index, layer_idx)` of the layer whose bump made the counter reach `value`.

        >>> LayerCounter.decode(7, num_layers=3)  # third forward, its first layer
        (2, 0)
        """
        if value <= 0:
            raise ValueError(f"counter value {value} means no layer has finished yet")
        return (value - 1) // num_layers, (value - 1) % num_layers


class NullLayerCounter(LayerCounter):
    """The default: counts nothing and costs nothing."""

    def __init__(self) -> None:
        super().__init__()

    def bump(self) -> None:
        """Do nothing."""
