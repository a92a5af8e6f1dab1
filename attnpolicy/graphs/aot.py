"""Graphs compiled ahead of time into a file: ``torch.compile(...).aot_compile``.

The mechanism a :class:`~attnpolicy.cache.disk_store.DiskStore` keeps (measured
against the compile-cache artifacts and AOTInductor in
``benchmarks/store_mechanisms.py``; see ``docs/store.md``): the saved file holds
Dynamo's bytecode and the backend's compiled graph, so a load in a new process pays
neither tracing nor compiling.

Guards are dropped when compiling (``torch.compiler.skip_all_guards_unsafe``, as vLLM
does): Dynamo's ``ID_MATCH`` guards on globals cannot be serialized, and whatever
the guards would check (shapes, strides, dtype, device) is pinned by the graph key
the artifact is stored under. A loaded graph must therefore only be called with
inputs of its key's shapes and strides.

Each function here holds :func:`~attnpolicy.graphs.compile.compile_lock`: torch's
ahead-of-time compile and load are not safe from several threads at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from attnpolicy.errors import ConfigError, GraphCompileError
from attnpolicy.graphs.compile import Capture, capturing, compile_lock
from attnpolicy.plugins.compilers import resolve_compiler

MECHANISM = "aot_compile"
SUFFIX = ".aot"


def aot_compile_graph(fn: Callable[..., Any], backend: str, example_inputs: tuple[Any, ...], *,
                      options: Mapping[str, Any] | None = None,
                      counter: Callable[[torch.fx.GraphModule], None] | None = None,
                      capture: Capture | None = None) -> Any:
    """``fn`` compiled now by the compiler ``backend`` names (its backend called with
    ``options``) for ``example_inputs`` (``fullgraph``, static shapes, no guards,
    no-grad): a callable with ``save_compiled_function(path)``. Only a compiler that
    declares its artifacts storable compiles so. ``counter(gm)`` sees the compile;
    ``capture`` records what the backend returned (for the compiler's ``release``)."""
    compiler = resolve_compiler(backend)
    if not compiler.storable:
        raise ConfigError(f"backend {backend!r} declares no artifacts that can be stored and reloaded: it cannot "
                          "compile ahead of time")
    compiled_by = capturing(compiler, options or {}, counter, capture or Capture())
    try:
        with compile_lock():
            with torch._dynamo.config.patch(enable_aot_compile=True):
                compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=compiled_by,
                                         options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})
            with torch.no_grad():
                return compiled.aot_compile((example_inputs, {}))  # type: ignore[attr-defined]
    except Exception as e:
        raise GraphCompileError(f"aot_compile of {getattr(fn, '__qualname__', fn)!r} with backend "
                                f"{backend!r} failed: {type(e).__name__}: {e}") from e


def save_graph(compiled: Any, path: Path) -> None:
    """Write ``compiled`` (from :func:`aot_compile_graph`) to ``path``: a store writer."""
    with compile_lock():
        compiled.save_compiled_function(str(path))


def load_graph(path: Path) -> Callable[..., Any]:
    """The graph saved at ``path``, ready to call: a store reader. Its (empty) guard
    check is switched off: nothing is checked per call, as when it was compiled."""
    with compile_lock(), path.open("rb") as f:
        graph = torch.compiler.load_compiled_function(f)
        graph.disable_guard_check()  # type: ignore[attr-defined]
    return graph
