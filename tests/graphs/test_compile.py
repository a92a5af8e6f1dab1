"""compile_graph / release_graph: real compiles per key, real frees on eviction."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.compile import compile_graph, release_graph


def attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def qkv(length):
    torch.manual_seed(length)
    return tuple(torch.randn(1, 2, length, 4) for _ in range(3))


class Compiles:
    """Counts backend compiles and keeps a weak reference to each compiled GraphModule."""

    def __init__(self):
        self.modules = []

    def __call__(self, gm):
        self.modules.append(weakref.ref(gm))

    def __len__(self):
        return len(self.modules)


def cache_of_lengths(compiles, **kwargs):
    cache = GraphCache(release=lambda key, graph: release_graph(graph), **kwargs)

    def get(length):
        return cache.get_or_compile(length, lambda: compile_graph(
            attention, "eager", counter=compiles, example_inputs=qkv(length)))

    return cache, get


def test_twenty_keys_of_one_function_are_twenty_real_compiles():
    compiles = Compiles()
    cache, get = cache_of_lengths(compiles)
    for length in range(1, 21):  # far past Dynamo's recompile_limit of 8 per code object
        get(length)
    assert len(compiles) == 20 and cache.stats().compiles == 20
    for length in (1, 9, 20):
        assert torch.allclose(get(length)(*qkv(length)), attention(*qkv(length)))
    assert len(compiles) == 20  # hits reuse the compiled code


def test_evicted_graph_is_freed_and_recompiled_on_request():
    compiles = Compiles()
    cache, get = cache_of_lengths(compiles, max_graphs=2)
    first = get(2)
    get(3)
    assert len(compiles) == 2
    get(4)  # evicts 2
    gc.collect()
    assert 2 not in cache
    assert compiles.modules[0]() is None  # freed although `first` is still referenced
    get(2)
    assert len(compiles) == 4 and cache.stats().compiles == 4
    assert torch.allclose(first(*qkv(2)), attention(*qkv(2)))  # a released graph still runs
    assert len(compiles) == 5


def test_compile_happens_in_the_build_with_example_inputs():
    compiles = Compiles()
    lazy = compile_graph(attention, "eager", counter=compiles)
    assert len(compiles) == 0
    lazy(*qkv(3))
    assert len(compiles) == 1
    compile_graph(attention, "eager", counter=compiles, example_inputs=qkv(3))
    assert len(compiles) == 2  # a fresh code object: not served by the first graph's entry


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_graph_matches_the_plain_function(backend):
    graph = compile_graph(attention, backend)
    q, k, v = qkv(5)
    torch.testing.assert_close(graph(q, k, v), attention(q, k, v))


def test_backend_none_is_the_plain_function():
    compiles = Compiles()
    graph = compile_graph(attention, "none", counter=compiles, example_inputs=qkv(2))
    assert graph.code is None and len(compiles) == 0
    torch.testing.assert_close(graph(*qkv(2)), attention(*qkv(2)))
    release_graph(graph)


def test_bound_methods_and_keyword_defaults_are_copied():
    class Scaled:
        def __init__(self, factor):
            self.factor = factor

        def __call__(self, x, *, shift=1.0):
            return x * self.factor + shift

    graph = compile_graph(Scaled(3.0).__call__, "eager")
    x = torch.ones(2)
    torch.testing.assert_close(graph(x), x * 3.0 + 1.0)


@pytest.mark.parametrize(("fn", "backend", "field"), [
    (attention, "tvm-ish", "backend"),
    (len, "eager", "fn"),
])
def test_invalid_arguments_name_field_and_value(fn, backend, field):
    with pytest.raises(ConfigError) as err:
        compile_graph(fn, backend)
    assert field in str(err.value) and repr(backend if field == "backend" else fn) in str(err.value)


@pytest.mark.inductor
def test_inductor_graph_matches_the_plain_function():
    compiles = Compiles()
    q, k, v = qkv(2)
    graph = compile_graph(attention, "inductor", counter=compiles, example_inputs=(q, k, v))
    assert len(compiles) == 1
    torch.testing.assert_close(graph(q, k, v), attention(q, k, v))


def _attention_v_last(q, k, mask, v):
    """Touches ``v`` after ``mask``: Dynamo's placeholders come out [q, k, mask, v]."""
    s = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_graph_is_called_directly_and_matches_dynamo(backend):
    q, k, v = qkv(6)
    mask = torch.rand(6, 6) > 0.3
    mask[:, 0] = True
    compiles = Compiles()
    graph = compile_graph(_attention_v_last, backend, counter=compiles, example_inputs=(q, k, mask, v))
    assert graph.direct and graph.call is not graph._dynamo
    q2, k2, v2 = qkv(6)  # other values, same shapes: no recompile through the direct call
    torch.testing.assert_close(graph(q2, k2, mask, v2), _attention_v_last(q2, k2, mask, v2))
    assert len(compiles) == 1
    release_graph(graph)
    assert not graph.direct and graph._capture.gm is None  # the captured graph is dropped
    torch.testing.assert_close(graph(q2, k2, mask, v2), _attention_v_last(q2, k2, mask, v2))
    assert len(compiles) == 2  # after release the call goes through Dynamo again


def test_graph_compiled_lazily_is_not_direct():
    graph = compile_graph(attention, "eager")
    assert not graph.direct
    torch.testing.assert_close(graph(*qkv(5)), attention(*qkv(5)))


@pytest.mark.inductor
def test_inductor_graph_is_called_directly_and_matches():
    q, k, mask, v = *qkv(6)[:2], torch.ones(6, 6, dtype=torch.bool), qkv(6)[2]
    graph = compile_graph(_attention_v_last, "inductor", example_inputs=(q, k, mask, v))
    assert graph.direct
    q2, k2, v2 = qkv(6)
    torch.testing.assert_close(graph(q2, k2, mask, v2), _attention_v_last(q2, k2, mask, v2))


@pytest.mark.inductor
def test_inductor_code_called_directly_has_no_per_call_size_assertions():
    """The key pins shapes and strides: the generated code is compiled without
    inductor's size and stride assertions (the default for other compiles is kept)."""
    import inspect

    import torch._inductor.config as inductor_config

    graph = compile_graph(attention, "inductor", example_inputs=qkv(7))
    assert graph.direct and inductor_config.size_asserts
    code = inspect.getsource(inspect.getmodule(graph.call.__closure__[0].cell_contents))  # type: ignore[union-attr]
    assert "def call(" in code and "assert_size_stride(" not in code
