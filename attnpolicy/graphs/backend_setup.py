"""The per-process set-up a backend's first graph pays, started ahead on a thread.

Inductor on CPU probes, once per process, which vector instruction sets (AVX2,
AVX-512, AMX …) its C++ compiler builds and this CPU loads: for each one it builds a
test library (kept in inductor's cache) and loads it in a child Python process. The
first graph with C++ kernels pays that probe whether it is compiled or loaded from a
graph store (the ISA is part of the cached library's key), about a second, mostly
spent waiting on the children. :func:`start` runs the probe on a thread, each ISA's
child at once, while the caller goes on compiling or loading; inductor keeps the
answers (``torch._inductor.cpu_vec_isa``'s own caches), so its own probe then finds
them. The caller joins the thread before it calls its warm set ready, so the probe's
seconds stay inside the start-up it measures.
"""

from __future__ import annotations

import importlib
import logging
import platform
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger("attnpolicy.graphs.backend_setup")


class Setup:
    """A set-up running on a thread; :meth:`join` waits for it (a no-op when nothing
    was started)."""

    __slots__ = ("thread",)

    def __init__(self, thread: threading.Thread | None) -> None:
        self.thread = thread

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


def start(backend: str, device: str) -> Setup:
    """Start the set-up of ``backend``'s first graph on ``device`` (inductor on CPU: the
    vector-ISA probe) on a thread, unless this process has done it already."""
    if backend != "inductor" or torch.device(device).type != "cpu":
        return Setup(None)
    # what the probe imports is imported here, not on the thread: two threads importing
    # one package at once can deadlock
    for module in ("torch._inductor.codecache", "torch.utils.cpp_extension"):
        importlib.import_module(module)
    from torch._inductor import cpu_vec_isa

    info = getattr(cpu_vec_isa.valid_vec_isa_list, "cache_info", None)  # inductor's own cache of the answer
    if info is None or info().currsize:  # probed already (or a torch that keeps no answer: nothing to start)
        return Setup(None)
    thread = threading.Thread(target=_probe_vec_isa, name="attnpolicy-vec-isa-probe", daemon=True)
    thread.start()
    return Setup(thread)


def _probe_vec_isa() -> None:
    """Inductor's vector-ISA probe, each ISA the CPU reports on its own thread (inductor
    probes them one after another), then its pick, which reads the cached answers."""
    from torch._inductor import cpu_vec_isa

    try:
        if platform.machine() in ("x86_64", "AMD64"):
            flags = cpu_vec_isa.x86_isa_checker()
            isas = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
            if isas:
                with ThreadPoolExecutor(len(isas), thread_name_prefix="attnpolicy-vec-isa") as pool:
                    list(pool.map(bool, isas))  # each ISA's check_build, cached by inductor
        cpu_vec_isa.pick_vec_isa()
    except Exception as e:  # inductor probes again on its first graph: slower, as correct
        log.info("probing inductor's vector ISAs ahead failed (%s: %s); inductor probes them itself",
                 type(e).__name__, e)
