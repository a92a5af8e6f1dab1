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

The backend is a compiler a config names (:mod:`attnpolicy.plugins.compilers`: a built-in,
a plugin's, a Dynamo backend or a ``module:function`` path), called with the config's
backend options. Only the built-in ``inductor``, ``aot_eager`` and ``eager`` are called
directly (see :class:`CompiledGraph`); any other backend's graphs go through Dynamo.
:func:`release_graph` also calls the compiler's own ``release`` on what its backend
returned, and :func:`device_bytes` asks it what a graph holds on its device.

Every compile, ahead-of-time save and load of this package holds :func:`compile_lock`,
torch's own process-wide compile lock: torch's tracing keeps process-global state.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from attnpolicy.errors import ConfigError
from attnpolicy.plugins.compilers import CompilerInfo, resolve_compiler

log = logging.getLogger("attnpolicy.graphs.compile")


class CompiledGraph:
    """A callable graph: ``torch.compile`` of a private copy of a function (or the plain
    function for backend ``"none"``). ``code`` is the private code object (``None`` when
    nothing is compiled); ``backend`` the compiler's name, ``compiler`` what it declares.

    ``call`` is what to run: once :func:`compile_graph` compiled the graph with example
    inputs on a built-in ``inductor``, ``aot_eager`` or ``eager``, it is the backend's own
    callable, captured at compile time and called directly, without Dynamo's per-call
    frame evaluation and guards (``direct`` is then True). That is sound because a graph
    key pins everything the guards check (shapes, strides, dtype, device); graphs are
    compiled and called in no-grad mode. When the capture fails, ``call`` is the Dynamo
    wrapper (``direct`` False): slower, as correct; any other compiler's graphs are called
    so. ``capture``: what the backend returned on each compile of ``call`` (released and
    dropped by :func:`release_graph`).
    """

    __slots__ = ("__weakref__", "_capture", "_dynamo", "backend", "call", "code", "compiler", "direct")

    def __init__(self, call: Callable[..., Any], code: types.CodeType | None, backend: str, *,
                 capture: Capture | None = None, compiler: CompilerInfo | None = None) -> None:
        self._dynamo = self.call = call
        self.code = code
        self.backend = backend
        self.compiler = compiler
        self.direct = backend == "none"
        self._capture = capture

    def __call__(self, *args: Any) -> Any:
        return self.call(*args)

    def use_direct(self, call: Callable[..., Any]) -> None:
        """Run ``call``, the backend's own callable captured for this graph, without Dynamo."""
        self.call, self.direct = call, True

    def drop_direct(self) -> None:
        """Forget the captured callable and graph: calls go through Dynamo again."""
        self.call = self._dynamo
        self.direct = self.backend == "none"
        if self._capture is not None:
            self._capture.gm = self._capture.fn = None

    def compiled(self) -> list[Any]:
        """What the backend returned for this graph since it was compiled or last released."""
        return [] if self._capture is None else list(self._capture.compiled)

    def take_compiled(self) -> list[Any]:
        """:meth:`compiled`, forgotten here (what a release frees)."""
        return [] if self._capture is None else self._capture.taken()

    def __repr__(self) -> str:
        name = getattr(self.code, "co_name", getattr(self._dynamo, "__name__", "?"))
        return f"CompiledGraph({name}, backend={self.backend!r}, direct={self.direct})"


def compile_lock() -> contextlib.AbstractContextManager[Any]:
    """Torch's process-wide compile lock (Dynamo's re-entrant ``convert_frame.compile_lock``,
    which Dynamo holds while it compiles a frame). Torch's ahead-of-time compile, save and
    load do not take it, yet their tracing uses process-global state (``torch.fx``'s
    ``CURRENT_PATCHER``, inductor's and functorch's patched configs): two threads compiling
    at once failed. Held around each of them here (and around the store I/O of a load or
    save, taken before the store's file lock), they run one at a time in the process, and
    never beside another thread's lazy Dynamo compile."""
    from torch._dynamo import convert_frame

    lock: contextlib.AbstractContextManager[Any] = convert_frame.compile_lock
    return lock


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


class Capture:
    """What the backend produced: Dynamo's graph module and the backend's callable of the
    last compile, and every callable it returned (``compiled``, under its own lock: a
    released graph may compile again in another thread)."""

    __slots__ = ("compiled", "fn", "gm", "lock")

    def __init__(self) -> None:
        self.gm: torch.fx.GraphModule | None = None
        self.fn: Callable[..., Any] | None = None
        self.compiled: list[Any] = []
        self.lock = threading.Lock()

    def record(self, gm: torch.fx.GraphModule, fn: Callable[..., Any]) -> None:
        """One compile: its graph module and what the backend returned."""
        self.gm, self.fn = gm, fn
        with self.lock:
            self.compiled.append(fn)

    def taken(self) -> list[Any]:
        """Every callable the backend returned, forgotten here (what a release frees)."""
        with self.lock:
            compiled, self.compiled = self.compiled, []
        return compiled


def capturing(compiler: CompilerInfo, options: Mapping[str, Any],
              counter: Callable[[torch.fx.GraphModule], None] | None, box: Capture) -> Callable[..., Any]:
    """``compiler``'s backend called with ``options``, calling ``counter(gm)`` before each
    compile and recording the graph module and the backend's result in ``box``."""
    inner = compiler.dynamo_backend()
    kwargs = dict(options)

    def backend(gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        if counter is not None:
            counter(gm)
        fn: Callable[..., Any] = inner(gm, inputs, **kwargs)
        box.record(gm, fn)
        return fn

    backend.__name__ = compiler.name  # what Dynamo's messages call it
    return backend


def _closure(fn: Any) -> dict[str, Any]:
    fn = getattr(fn, "__func__", fn)
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, cells, strict=True):
        with contextlib.suppress(ValueError):  # an empty cell
            out[name] = cell.cell_contents
    return out


def _inductor_call(fn: Any, depth: int = 0, seen: set[int] | None = None) -> Callable[..., Any] | None:
    """The generated ``call(args: list)`` of the inductor graph wrapped by ``fn``
    (``CompiledFxGraph.current_callable``), found through the AOT wrappers' closures."""
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError:  # older torch keeps it in codecache
        from torch._inductor.codecache import CompiledFxGraph  # type: ignore[attr-defined]

    seen = set() if seen is None else seen
    if id(fn) in seen or depth > 8:
        return None
    seen.add(id(fn))
    if isinstance(fn, CompiledFxGraph):
        return fn.current_callable
    inner = list(_closure(fn).values()) + [getattr(fn, a) for a in ("compiled_fn", "__wrapped__", "fn")
                                           if hasattr(fn, a)]
    for c in inner:
        if callable(c) or hasattr(c, "current_callable"):
            found = _inductor_call(c, depth + 1, seen)
            if found is not None:
                return found
    return None


def _direct(box: Capture, backend: str, argnames: tuple[str, ...]) -> Callable[..., Any] | None:
    """A guard-free callable ``f(*args) -> tensor`` equivalent to the compiled graph,
    or None when the captured graph is not of the expected shape.

    Dynamo orders the graph's placeholders by first use, not by argument order; the
    placeholder names (``L_q_``) map them back. eager and aot_eager call Dynamo's graph
    module (the same aten ops; AOT's wrappers cost ~10 µs per call), its code
    generated first; inductor calls its generated code, which takes a list.
    """
    gm = box.gm
    if gm is None or box.fn is None:
        return None
    names = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        order = tuple(argnames.index(name[2:-1]) for name in names)
    except ValueError:
        return None
    if sorted(order) != list(range(len(argnames))):
        return None
    same = order == tuple(range(len(order)))
    if backend in ("eager", "aot_eager"):
        # a lazy graph module (AOT leaves one) generates its code on first call; until
        # then ``forward`` is a stub that checks for that on every call (~3 µs)
        recompile = getattr(gm, "real_recompile", None)
        if recompile is not None:
            recompile()
        fwd = gm.forward
        if same:
            return lambda *a: fwd(*a)[0]
        return lambda *a: fwd(*[a[i] for i in order])[0]
    call = _inductor_call(box.fn)
    if call is None:
        return None
    if same:
        return lambda *a: call(list(a))[0]
    return lambda *a: call([a[i] for i in order])[0]


def _argnames(fn: Callable[..., Any]) -> tuple[str, ...]:
    code = _code_of(fn)
    names = code.co_varnames[:code.co_argcount]
    return names[1:] if isinstance(fn, types.MethodType) else names


def _verified(direct: Callable[..., Any], dynamo: Callable[..., Any], example_inputs: tuple[Any, ...]) -> bool:
    """Whether ``direct`` computes what the Dynamo wrapper computes, on random values
    in the example inputs' shapes and strides (boolean and integer inputs kept); false
    where that cannot be told (a device whose values cannot be read, as ``meta``)."""
    probe = tuple(torch.randn_like(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                  for t in example_inputs)
    try:
        got, want = direct(*probe), dynamo(*probe)
        return (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
                and got.shape == want.shape and got.dtype == want.dtype
                and bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)))
    except Exception:
        return False


def _codegen_options(compiler: CompilerInfo) -> contextlib.AbstractContextManager[Any]:
    """The built-in inductor's generated code without its per-call size and stride
    assertions (about 0.5 µs per input): a graph key pins the shapes and strides of every
    call, and a graph called through Dynamo has them checked by its guards anyway."""
    if compiler.builtin and compiler.name == "inductor":
        import torch._inductor.config as inductor_config

        patched: contextlib.AbstractContextManager[Any] = inductor_config.patch(size_asserts=False)
        return patched
    return contextlib.nullcontext()


def compile_graph(
    fn: Callable[..., Any],
    backend: str,
    *,
    options: Mapping[str, Any] | None = None,
    counter: Callable[[torch.fx.GraphModule], None] | None = None,
    example_inputs: tuple[Any, ...] | None = None,
    guards: bool = True,
) -> CompiledGraph:
    """Compile a private copy of ``fn`` with the compiler ``backend`` names
    (:func:`~attnpolicy.plugins.compilers.resolve_compiler`; an unknown name is a
    :class:`ConfigError` naming the known ones), its backend called with ``options`` as
    keyword arguments (``dynamic=False, fullgraph=True``).

    ``torch.compile`` compiles lazily, on the first call; with ``example_inputs``
    the graph is called once here (in no-grad mode), so the compile happens now
    (inside a cache's build, where its seconds are measured) rather than on the first
    real request, and a built-in backend's callable is captured for guard-free calls (see
    :class:`CompiledGraph`; checked against the Dynamo wrapper before use).
    ``counter(graph_module)`` is called on every backend compile of this graph
    (a re-compile after :func:`release_graph` included). Backend ``"none"`` returns
    the plain function; nothing is compiled and ``counter`` is never called.

    ``guards=False`` drops Dynamo's guards (``torch.compiler.skip_all_guards_unsafe``,
    as for graphs compiled ahead of time): every call runs this compile, checking
    nothing. For a caller whose key pins what the guards check, and that calls the
    graph while another thread may compile: guards read process-global state that
    torch changes while any thread traces (``torch.fx`` replaces ``torch.nn.Module.__call__``
    for the length of a trace, and a module's graph guards on its code), so a call
    checked then fails its guards and compiles again.
    """
    compiler = resolve_compiler(backend)
    if backend == "none":
        graph = CompiledGraph(fn, None, backend, compiler=compiler)
        if example_inputs is not None:
            with torch.no_grad():
                graph(*example_inputs)
        return graph
    fresh = _fresh_copy(fn)
    box = Capture()
    dynamo_options: dict[str, str | int | bool | Callable[..., Any]] | None = (
        None if guards else {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})
    compiled = torch.compile(fresh, backend=capturing(compiler, options or {}, counter, box), dynamic=False,
                             fullgraph=True, options=dynamo_options)
    graph = CompiledGraph(compiled, _code_of(fresh), backend, capture=box, compiler=compiler)
    if example_inputs is not None:
        direct_capable = compiler.direct
        with torch.no_grad(), compile_lock():  # the config patch is process-wide too
            with _codegen_options(compiler):
                compiled(*example_inputs)
            direct = _direct(box, backend, _argnames(fresh)) if direct_capable else None
            if direct is not None and _verified(direct, compiled, example_inputs):
                graph.use_direct(direct)
            elif direct_capable:
                log.info("could not capture the %s graph of %s for direct calls; "
                         "calling it through Dynamo", backend, graph)
    return graph


def release_graph(graph: CompiledGraph) -> None:
    """Free the compiled code of ``graph``: the compiler's own ``release`` of each
    callable its backend returned for the graph (where it declares one), then
    ``torch._dynamo.reset_code`` on the graph's private code.

    Use as a GraphCache ``release`` callback (``lambda key, graph: release_graph(graph)``).
    The object stays callable: a thread that fetched it just before eviction still
    gets correct results (Dynamo compiles it again, which ``counter`` sees). A raising
    ``release`` is logged (once per compiler) and the rest is freed all the same.
    """
    compiled = graph.take_compiled()
    graph.drop_direct()
    free = graph.compiler.release if graph.compiler is not None else None
    if free is not None:
        for each in compiled:
            try:
                free(each)
            except Exception as e:
                _warn_release(graph.backend, e)
    if graph.code is not None:
        with compile_lock():  # as Dynamo's own reset_code_caches
            torch._dynamo.reset_code(graph.code)  # type: ignore[attr-defined]


_release_warned: set[str] = set()


def _warn_release(backend: str, error: Exception) -> None:
    if backend not in _release_warned:
        _release_warned.add(backend)
        log.warning("compiler %r: release raised %s: %s; the graph's references are dropped all the same "
                    "(further failures of this compiler are not logged)", backend, type(error).__name__, error)


def device_bytes(graph: CompiledGraph) -> int | None:
    """The bytes ``graph`` holds on its device, as its compiler declares them (the sum over
    what its backend returned for it); ``None`` where the compiler declares none or
    nothing was compiled yet (the cache then bounds the bytes it computes)."""
    measure = graph.compiler.device_bytes if graph.compiler is not None else None
    compiled = graph.compiled()
    if measure is None or not compiled:
        return None
    return sum(measure(each) for each in compiled)
