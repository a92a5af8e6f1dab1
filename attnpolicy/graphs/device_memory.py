"""What a device's allocator reports: the bytes it holds now, where the device's torch
module has a memory API (``torch.cuda``, ``torch.xpu``, and any out-of-tree device that
registers one, as ``torch.hpu``): ``torch.<device type>.memory_allocated(device)``,
after ``synchronize(device)``. ``None`` elsewhere (CPU, meta): a caller then measures
the process or counts the bytes it computes."""

from __future__ import annotations

import torch


def allocated(device: torch.device) -> int | None:
    """The bytes the allocator of ``device`` holds once its queued work is done, or
    ``None`` where the device reports none."""
    module = getattr(torch, device.type, None)
    measure, sync = getattr(module, "memory_allocated", None), getattr(module, "synchronize", None)
    if measure is None or sync is None:
        return None
    sync(device)
    nbytes = measure(device)
    return int(nbytes)
