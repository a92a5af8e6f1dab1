"""Compiled graphs that a GraphCache can really evict.

Why a private code object per graph: TorchDynamo stores compiled code on the
*code object* of the compiled function (its ``co_extra`` cache entries), not on
the ``torch.compile`` wrapper. Every wrapper of one Python function therefore
shares one list of cache entries, capped by ``torch._dynamo.config.recompile_limit``
(8): past it Dynamo runs the function eagerly (or, with ``fullgraph=True``, raises
``FailOnRecompileLimitHit``). Evicting a wrapper would free nothing, and a cache
of more than 8 shapes of one attention function would silently stop compiling.

:func:`compile_graph` gives each graph a fresh function with a *copy* of the code
object, so each graph owns its Dynamo cache entries: 20 keys are 20 real
compiles, and :func:`release_graph` frees exactly one graph's compiled code with
``torch._dynamo.reset_code``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from attnpolicy.core.names import BACKENDS
from attnpolicy.errors import ConfigError


class CompiledGraph:
    """A callable graph: ``torch.compile`` of a private copy of a function (or the plain
    function for backend ``"none"``). ``code`` is the private code object (``None`` when
    nothing is compiled)."""

    __slots__ = ("backend", "code", "_call", "__weakref__")

    def __init__(self, call: Callable[..., Any], code: types.CodeType | None, backend: str) -> None:
        self._call = call
        self.code = code
        self.backend = backend

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __repr__(self) -> str:
        name = getattr(self.code, "co_name", getattr(self._call, "__name__", "?"))
        return f"CompiledGraph({name}, backend={self.backend!r})"


def _fresh_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a new code object (same bytecode, globals, defaults and closure)."""
    if isinstance(fn, types.MethodType):
        return types.MethodType(_fresh_copy(fn.__func__), fn.__self__)
    if not isinstance(fn, types.FunctionType):
        raise ConfigError(f"fn must be a Python function or bound method, got {fn!r}")
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                               fn.__defaults__, fn.__closure__)
    fresh.__kwdefaults__ = fn.__kwdefaults__
    fresh.__qualname__ = fn.__qualname__
    return fresh


def _code_of(fn: Callable[..., Any]) -> types.CodeType:
    return fn.__func__.__code__ if isinstance(fn, types.MethodType) else fn.__code__


def _counting(backend: str, counter: Callable[[torch.fx.GraphModule], None]) -> Callable[..., Any]:
    """The named Dynamo backend, calling ``counter(gm)`` before each compile."""
    inner = torch._dynamo.lookup_backend(backend)

    def compiler(gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        counter(gm)
        return inner(gm, inputs)

    return compiler


def compile_graph(
    fn: Callable[..., Any],
    backend: str,
    *,
    counter: Callable[[torch.fx.GraphModule], None] | None = None,
    example_inputs: tuple[Any, ...] | None = None,
) -> CompiledGraph:
    """Compile a private copy of ``fn`` with ``backend`` (``dynamic=False, fullgraph=True``).

    ``torch.compile`` compiles lazily, on the first call; with ``example_inputs``
    the graph is called once here, so the compile happens now (inside a cache's
    build, where its seconds are measured) rather than on the first real request.
    ``counter(graph_module)`` is called on every backend compile of this graph
    (a re-compile after :func:`release_graph` included). Backend ``"none"`` returns
    the plain function; nothing is compiled and ``counter`` is never called.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "none":
        graph = CompiledGraph(fn, None, backend)
    else:
        fresh = _fresh_copy(fn)
        compiler = backend if counter is None else _counting(backend, counter)
        compiled = torch.compile(fresh, backend=compiler, dynamic=False, fullgraph=True)
        graph = CompiledGraph(compiled, _code_of(fresh), backend)
    if example_inputs is not None:
        graph(*example_inputs)
    return graph


def release_graph(graph: CompiledGraph) -> None:
    """Free the compiled code of ``graph`` (``torch._dynamo.reset_code`` on its private code).

    Use as a GraphCache ``release`` callback (``lambda key, graph: release_graph(graph)``).
    The object stays callable: a thread that fetched it just before eviction still
    gets correct results (Dynamo compiles it again, which ``counter`` sees).
    """
    if graph.code is not None:
        torch._dynamo.reset_code(graph.code)  # type: ignore[attr-defined]
