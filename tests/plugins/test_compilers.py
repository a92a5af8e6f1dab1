"""A runtime's own compiler behind the graph cache: registered through the compiler hook,
named by ``module:function``, or registered with Dynamo; what it declares (release,
device bytes, its compile count, storable artifacts) is what the cache and the store do."""

from __future__ import annotations

import logging
import warnings

import plugin_compilers
import pytest
import torch
from plugin_compilers import GRAPH_BYTES, RECORD, CompilerPlugin
from reference import reference_for
from strategies import random_qkv

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.compile import compile_graph, release_graph
from attnpolicy.plugins.compilers import CompilerInfo, compiler_registry, resolve_compiler
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.plugins.registry import get_plugin_manager
from attnpolicy.policies.resolve import failed_plugins

pytestmark = pytest.mark.usefixtures("fresh_plugins")

#: One sequence each; buckets 16, 32, 64, 16, 64, 16. Under a bound of two graphs'
#: declared bytes: 4 compiles, 2 evictions (16, then 32), 2 hits.
LENGTHS = (10, 20, 40, 12, 50, 9)


@pytest.fixture(autouse=True)
def record():
    RECORD.reset()
    yield RECORD


@pytest.fixture
def plugin():
    get_plugin_manager().register(CompilerPlugin(), name="counting-plugin")


def config(backend: str, **fields: object) -> AttnPolicyConfig:
    return AttnPolicyConfig(**{"policy": "always-causal", "backend": backend, "max_seq_len": 64,
                               "max_bytes": 2 * GRAPH_BYTES + GRAPH_BYTES // 2,
                               "backend_options": {"marker": 1}, **fields})


def attend_all(d: Dispatcher) -> None:
    """Every length of :data:`LENGTHS` through ``d``, each output against the float64 reference."""
    for i, n in enumerate(LENGTHS):
        layout = BatchLayout.from_lens([n])
        q, k, v = random_qkv(layout, i, heads=2, kv_heads=2)
        torch.testing.assert_close(d.attend(q, k, v, layout).double(), reference_for(q, k, v, layout),
                                   atol=1e-5, rtol=1e-5)


def test_a_compiler_registered_through_the_hook_is_counted_released_and_bounded_by_its_bytes(plugin, record):
    d = Dispatcher(config("counting"))
    attend_all(d)
    s = d.stats()
    assert s.cache.compiles == record.compiles == s.backend_compiles == s.compiler_compiles == 4
    assert record.options == [{"marker": 1}] * 4  # backend_options, as keyword arguments
    # the cache bounds the bytes the compiler declares, not the few KiB it computes from the keys
    assert (s.cache.evictions, s.cache.graphs, s.cache.bytes) == (2, 2, 2 * GRAPH_BYTES)
    assert len(record.released) == 2 and set(record.released) <= set(record.returned)
    assert s.direct_call_fallbacks == 0  # called through Dynamo, as any compiler but the built-ins
    d.cache.clear()
    assert len(record.released) == 4  # every graph it compiled, released once


def test_a_storable_compiler_named_by_module_function_keeps_and_reloads_its_graphs(tmp_path, record):
    backend = "plugin_compilers:DECLARED"
    cold = Dispatcher(config(backend, store_dir=str(tmp_path)))
    attend_all(cold)  # 16, 32, 64 compiled and saved; 16, evicted by 64, loaded back
    s = cold.stats()
    assert s.cache.compiles == record.compiles == s.backend_compiles == s.compiler_compiles == 3
    assert s.disk is not None and s.disk.saves == s.disk.entries == 3 and s.cache.loads == 1
    assert len(record.released) == s.cache.evictions == 1  # compiled ahead of time: released all the same

    warm = Dispatcher(config(backend, store_dir=str(tmp_path)))
    attend_all(warm)
    s = warm.stats()
    assert (s.cache.loads, s.cache.compiles, record.compiles, s.compiler_compiles) == (3, 0, 3, 0)

    other = Dispatcher(config(backend, store_dir=str(tmp_path), backend_options={"marker": 2}))
    attend_all(other)  # other options: another compiler identity, nothing of the store serves it
    s = other.stats()
    assert (s.cache.compiles, record.compiles) == (3, 6) and record.options[-1] == {"marker": 2}


def test_a_compiler_that_stores_nothing_is_compiled_and_said_once(plugin, tmp_path, record):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = Dispatcher(config("counting-unstored", store_dir=str(tmp_path)))
        attend_all(d)
    said = [w for w in caught if "declares no artifacts that can be stored" in str(w.message)]
    assert len(said) == 1 and "counted in unstorable" in str(said[0].message)
    s = d.stats()
    assert s.disk is not None and (s.disk.unstorable, s.disk.saves, s.disk.entries) == (4, 0, 0)
    assert s.cache.compiles == record.compiles == 4


def test_a_backend_callable_declares_nothing(tmp_path, record):
    """A plain ``module:function`` backend: counted through attnpolicy's wrapper, its
    graphs not stored, eviction frees attnpolicy's references only."""
    with pytest.warns(RuntimeWarning, match="declares no artifacts"):
        d = Dispatcher(config("plugin_compilers:counting_aot_eager", store_dir=str(tmp_path)))
        attend_all(d)
    s = d.stats()
    assert s.cache.compiles == record.compiles == s.backend_compiles == 3 and s.compiler_compiles is None
    assert s.cache.evictions == 0 and s.cache.bytes < GRAPH_BYTES  # no declared bytes: the computed ones
    assert s.disk is not None and s.disk.unstorable == 3
    d.cache.clear()
    assert record.released == []


def test_a_dynamo_registered_backend_is_a_compiler(record):
    name = "attnpolicy_test_counting"
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(plugin_compilers.counting_aot_eager, name=name)
    d = Dispatcher(config(name))
    attend_all(d)
    s = d.stats()
    assert s.cache.compiles == record.compiles == s.backend_compiles == 3 and s.compiler_compiles is None
    assert resolve_compiler(name).plugin == "torch._dynamo"


@pytest.mark.parametrize(("info", "words"), [
    (CompilerInfo("eager", backend=plugin_compilers.counting_aot_eager), "'eager' is registered by two plugins"),
    (CompilerInfo("fine", version=2), "needs a str version"),  # type: ignore[arg-type]
    (CompilerInfo("a:b"), "without ':'"),
    (CompilerInfo("fine", release="not callable"), "release 'not callable', not callable"),  # type: ignore[arg-type]
    ("not-info", "not a CompilerInfo"),
])
def test_a_bad_registration_rejects_the_plugin_alone(plugin, info, words, caplog):
    class Bad:
        @hookimpl
        def attnpolicy_register_compilers(self, register):
            register(info)

    get_plugin_manager().register(Bad(), name="bad-compilers")
    with caplog.at_level(logging.WARNING, logger="attnpolicy.plugins"):
        registry = compiler_registry()
    assert "counting" in registry and "bad-compilers" in failed_plugins()
    assert words in failed_plugins()["bad-compilers"]


def test_a_second_plugin_taking_a_name_is_rejected(plugin):
    get_plugin_manager().register(CompilerPlugin(), name="counting-again")
    assert compiler_registry()["counting"].plugin == "counting-plugin"
    assert "registered by two plugins" in failed_plugins()["counting-again"]


@pytest.mark.parametrize(("backend", "words"), [
    ("plugin_compilers:GRAPH_BYTES", "names an object of type int, not a backend callable"),
    ("plugin_compilers:nothing_here", "AttributeError"),
    ("a:b:c", "is not a module:function path"),
])
def test_a_bad_path_is_one_line_naming_it(backend, words):
    with pytest.raises(ConfigError, match=f"backend {backend!r}.*{words}") as err:
        Dispatcher(config(backend))
    assert "\n" not in str(err.value)


def test_a_raising_release_is_logged_once_and_the_graph_freed(caplog):
    def fails(compiled):
        raise RuntimeError("cannot free")

    class Plugin:
        @hookimpl
        def attnpolicy_register_compilers(self, register):
            register(CompilerInfo("leaky", backend=plugin_compilers.counting_aot_eager, release=fails))

    get_plugin_manager().register(Plugin(), name="leaky-plugin")
    graphs = [compile_graph(lambda x: x + 1, "leaky", example_inputs=(torch.ones(n),)) for n in (1, 2)]
    with caplog.at_level(logging.WARNING, logger="attnpolicy.graphs.compile"):
        for graph in graphs:
            release_graph(graph)
    assert caplog.text.count("compiler 'leaky': release raised RuntimeError: cannot free") == 1
    assert all(g.compiled() == [] for g in graphs)
    torch.testing.assert_close(graphs[0](torch.ones(1)), torch.full((1,), 2.0))  # still callable
