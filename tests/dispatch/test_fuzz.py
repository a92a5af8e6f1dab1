"""The acceptance fuzz test: every policy × impl × backend (parametrized, so each
combination runs) against the float64 reference, with hypothesis drawing the
layouts (cached context, bidirectional, padding rows), the dtype (fp32, bf16) and
the garbage: NaN, ±inf, large finite values (up to the dtype's max) or random bit
patterns (an uninitialised buffer) in the padding rows and in rows of the *other*
sequences. The chosen sequence's output is the clean run's, bit for bit, finite,
and matches the reference.

Compiles are the slow part, so one graph cache serves every dispatcher of an
(impl, backend) pair (graph keys do not depend on the policy) and lengths stay
within two buckets: at most a few dozen compiles in all.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_for
from strategies import layouts, random_qkv

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher, GraphCache
from attnpolicy.core.features import Features
from attnpolicy.core.names import IMPLS
from attnpolicy.dispatch.call_graphs import example_inputs
from attnpolicy.errors import LayoutError
from attnpolicy.graphs.compile import release_graph
from attnpolicy.graphs.execute import graph_fn
from attnpolicy.graphs.footprint import graph_bytes
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.policies.registry import policy_registry

BACKENDS = ("none", "eager", "aot_eager")
POLICIES = ("always-causal", "always-mask", "always-rows", "cost-aware", "dynamic", "varlen")
BAD = (float("nan"), float("inf"), float("-inf"))
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}

_caches: dict[tuple[str, str], GraphCache] = {}
_dispatchers: dict[tuple[str, str, str], Dispatcher] = {}


def _dispatcher(policy: str, impl: str, backend: str) -> Dispatcher:
    key = (policy, impl, backend)
    if key not in _dispatchers:
        config = AttnPolicyConfig(policy=policy, attn_impl=impl, backend=backend, max_seq_len=64,
                                  partition_len=16 if impl == "flash" else None, max_batch_tokens=256,
                                  buckets={"kind": "list", "sizes": [64, 256]})
        cache = _caches.setdefault((impl, backend), GraphCache.from_config(
            config, sizeof=graph_bytes, release=lambda k, graph: release_graph(graph)))
        _dispatchers[key] = Dispatcher(config, cache=cache)
    return _dispatchers[key]


def _run(d: Dispatcher, qkv, layout: BatchLayout) -> tuple[torch.Tensor, str]:
    """The output of one batch and the mode that ran it."""
    before = d.stats().modes
    out = d.attend(*qkv, layout)
    (mode,) = (m for m, n in d.stats().modes.items() if n != before[m])
    return out, mode


def _layouts():
    """2–4 sequences of at most 64 tokens (context included)."""
    return layouts(min_seqs=2, max_seqs=4, max_len=40, max_context=24, max_pad=16)


def _padding(starts, lens, tokens):
    real = torch.zeros(tokens, dtype=torch.bool)
    for s, n in zip(starts, lens):
        real[s:s + n] = True
    return ~real


def test_the_fuzz_covers_every_registered_policy(fresh_plugins):
    assert set(POLICIES) == set(policy_registry())


@st.composite
def garbage(draw, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """What a row a sequence does not own may hold: NaN or ±inf, a large finite value
    (up to the dtype's max, either sign), or random bits (every pattern of the dtype)."""
    kind = draw(st.sampled_from(["non-finite", "large", "bits"]))
    if kind == "bits":
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        ints = torch.int16 if dtype.itemsize == 2 else torch.int32
        low = torch.iinfo(ints).min
        return torch.randint(low, -low, shape, dtype=ints, generator=g).view(dtype)
    if kind == "large":
        value = torch.finfo(dtype).max * 2.0 ** -draw(st.integers(0, 100)) * draw(st.sampled_from([1, -1]))
    else:
        value = draw(st.sampled_from(BAD))
    return torch.full(shape, value, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=3, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_sequence_is_exact_and_untouched_by_its_neighbours(data, policy, impl, backend, dtype):
    layout = data.draw(_layouts())
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(layout.q_tokens, 4, 8, generator=g).to(dtype)  # GQA: 4 query heads, 2 kv heads
    k, v = (torch.randn(layout.kv_tokens, 2, 8, generator=g).to(dtype) for _ in range(2))
    pads = (_padding(layout.q_starts, layout.q_lens, layout.q_tokens),
            _padding(layout.kv_starts, layout.kv_lens, layout.kv_tokens),
            _padding(layout.kv_starts, layout.kv_lens, layout.kv_tokens))
    for t, pad in zip((q, k, v), pads):
        t[pad] = data.draw(garbage(t[pad].shape, dtype))  # an uninitialised buffer's garbage
    d = _dispatcher(policy, impl, backend)
    clean, clean_mode = _run(d, (q, k, v), layout)

    me = data.draw(st.integers(0, layout.num_seqs - 1))
    dirty = [t.clone() for t in (q, k, v)]
    for i in range(layout.num_seqs):
        if i == me:
            continue
        which = data.draw(st.integers(0, 2))
        starts, lens = (layout.q_starts, layout.q_lens) if which == 0 else (layout.kv_starts, layout.kv_lens)
        row = starts[i] + data.draw(st.integers(0, lens[i] - 1))
        if data.draw(st.booleans()):  # one element, or the whole row
            dirty[which][row] = data.draw(garbage(dirty[which][row].shape, dtype))
        else:
            head = data.draw(st.integers(0, dirty[which].shape[1] - 1))
            dirty[which][row, head, 0] = data.draw(garbage((), dtype))
    out, mode = _run(d, dirty, layout)

    rows = slice(layout.q_starts[me], layout.q_starts[me] + layout.q_lens[me])
    tol = TOL[dtype]
    assert torch.isfinite(out[rows]).all()
    if mode == clean_mode:
        assert torch.equal(out[rows], clean[rows])
    else:  # cost-aware may decide the same layout differently the second time
        torch.testing.assert_close(out[rows], clean[rows], atol=tol, rtol=tol)
    real = [t.masked_fill(pad[:, None, None], 0) for t, pad in zip((q, k, v), pads)]  # padding is never read
    torch.testing.assert_close(out[rows].double(), reference_for(*real, layout)[rows], atol=tol, rtol=tol)


#: Features the fuzz draws from: few distinct values, so graphs are shared across examples.
WINDOWS, SOFTCAPS = (None, 5, 17), (None, 2.0)


@pytest.mark.parametrize(("impl", "backend"), [("sdpa", "none"), ("eager", "none"), ("flash", "none"),
                                               ("sdpa", "aot_eager")])
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_windows_caps_and_sinks_are_exact_and_isolated(data, policy, impl, backend):
    """The same contract under a sliding window, a soft cap and sinks (fp32)."""
    layout = data.draw(_layouts())
    window, softcap = data.draw(st.sampled_from(WINDOWS)), data.draw(st.sampled_from(SOFTCAPS))
    sinks = data.draw(st.sampled_from([None, torch.tensor([0.5, -1.0, 2.0, 0.0])]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(layout.q_tokens, 4, 8, generator=g)
    k, v = (torch.randn(layout.kv_tokens, 2, 8, generator=g) for _ in range(2))
    d = _dispatcher(policy, impl, backend)
    feats = dict(window=window, softcap=softcap, sinks=sinks)
    clean = d.attend(q, k, v, layout, **feats)
    me = data.draw(st.integers(0, layout.num_seqs - 1))
    dirty = [t.clone() for t in (q, k, v)]
    for i in range(layout.num_seqs):
        if i != me:
            which = data.draw(st.integers(0, 2))
            starts, lens = (layout.q_starts, layout.q_lens) if which == 0 else (layout.kv_starts, layout.kv_lens)
            dirty[which][starts[i] + data.draw(st.integers(0, lens[i] - 1))] = data.draw(st.sampled_from(BAD))
    out = d.attend(*dirty, layout, **feats)
    rows = slice(layout.q_starts[me], layout.q_starts[me] + layout.q_lens[me])
    assert torch.isfinite(out[rows]).all()
    torch.testing.assert_close(out[rows], clean[rows], atol=1e-6, rtol=1e-6)
    want = reference_for(q, k, v, layout, **feats)
    torch.testing.assert_close(clean[rows].double(), want[rows], atol=1e-5, rtol=1e-5)


# -- graph inputs in every form ---------------------------------------------------------
# Compiled graphs run without guards, so every input reaches them in the form it was
# compiled for or is refused. A few graphs (one bucket, fixed layouts, compiled once per
# backend) serve many drawn forms of q, k, v and sinks.

INPUT_BACKENDS = ("none", "eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.inductor))
#: (q_lens, kv_lens, padded_to): packed, one whole-bucket sequence (the direct path when
#: there are no sinks), cached context (VARLEN under ``varlen``), trailing padding
INPUT_LAYOUTS = (BatchLayout.from_lens([5, 7]), BatchLayout.from_lens([16]), BatchLayout.from_lens([5, 7], [9, 7]),
                 BatchLayout.from_lens([3, 4], padded_to=10))
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])
_input_dispatchers: dict[tuple[str, str], Dispatcher] = {}


def _input_dispatcher(policy: str, backend: str) -> Dispatcher:
    """A dispatcher whose graphs are all compiled, on contiguous fp32 inputs: always-mask
    with and without sinks, varlen and always-rows with sinks."""
    key = (policy, backend)
    if key not in _input_dispatchers:
        d = Dispatcher(AttnPolicyConfig(policy=policy, backend=backend, max_seq_len=16, max_batch_tokens=16,
                                        buckets={"kind": "list", "sizes": [16]}))
        for layout in INPUT_LAYOUTS:
            q, k, v = _qkv(layout, 0)
            d.attend(q, k, v, layout, sinks=SINKS)
            if policy == "always-mask":
                d.attend(q, k, v, layout)
        _input_dispatchers[key] = d
    return _input_dispatchers[key]


_qkv = partial(random_qkv, head_dim=8)  # 4 heads over 2 kv heads of 8


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values every other element of a buffer whose other half is NaN."""
    return torch.stack([t, torch.full_like(t, float("nan"))], -1)[..., 0]


#: Forms of q, k or v that run: the same values (an expanded tensor: its own values)
#: in other strides or at an offset into a larger buffer.
QKV_FORMS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),
    "strided": _strided,
    "expanded": lambda t: t[:, :1].expand(t.shape),
    "offset": lambda t: torch.cat([torch.full_like(t[:3], float("nan")), t])[3:],
}
#: Forms of one of q, k, v that are refused, with what the error names.
QKV_REFUSED = {
    "float64": (lambda t: t.double(), "dtype differs"),
    "bfloat16": (lambda t: t.bfloat16(), "dtype differs"),
    "int32": (lambda t: t.int(), "dtype torch.int32"),
    "meta": (lambda t: t.to("meta"), "device differs"),
    "one token short": (lambda t: t[:-1], "tokens|same shape"),
    "head_dim 4": (lambda t: t[..., :4], "head_dim|same shape"),
    "2-D": (lambda t: t[:, 0], "3-D tensor"),
}
#: Forms of the sink logits that run, as the values the graphs get.
SINK_FORMS = {
    "contiguous": lambda s: s,
    "column": _strided,
    "float64": lambda s: s.double(),
    "bfloat16": lambda s: s.bfloat16(),
    "float16": lambda s: s.half(),
    "int64": lambda s: s.round().long(),
    "expanded": lambda s: s[:1].expand(4),
    "offset": lambda s: torch.cat([torch.full((2,), float("nan")), s])[2:],
}
SINKS_REFUSED = {
    "list": (lambda s: s.tolist(), "sinks must be a tensor"),
    "scalar": (lambda s: s[0], r"shape \[Hq=4\], got \(\)"),
    "Hq + 1": (lambda s: torch.cat([s, s[:1]]), r"got \(5,\)"),
    "2-D": (lambda s: s[None], r"got \(1, 4\)"),
    "bool": (lambda s: s > 0, "dtype torch.bool"),
    "complex": (lambda s: s.to(torch.complex64), "dtype torch.complex64"),
    "meta": (lambda s: s.to("meta"), "sinks are on meta"),
}


@pytest.mark.parametrize("backend", INPUT_BACKENDS)
def test_sinks_of_another_dtype_or_stride_are_exact(backend):
    """A column view (stride 2), fp64, bf16, int64 and expanded sinks under an always-mask
    dispatcher: each matches the float64 reference, on the graph compiled for fp32 sinks."""
    d = _input_dispatcher("always-mask", backend)
    layout = INPUT_LAYOUTS[0]
    q, k, v = _qkv(layout, 1)
    compiles = d.stats().cache.compiles
    for name in ("column", "float64", "bfloat16", "int64", "expanded"):
        sinks = SINK_FORMS[name](SINKS)
        want = reference_for(q, k, v, layout, sinks=sinks.double())
        torch.testing.assert_close(d.attend(q, k, v, layout, sinks=sinks).double(), want, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, name=name: f"sinks {name}: {m}")
    assert d.stats().cache.compiles == compiles


@pytest.mark.parametrize("backend", INPUT_BACKENDS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_graph_inputs_of_any_form_are_exact_or_refused(data, backend):
    """q, k, v and sinks drawn in every form (strides, offsets, dtypes, devices, shapes),
    through ``attend`` or a prepared ``Step``: a form that runs matches the float64
    reference on the graphs already compiled; any other is refused, naming the input,
    before any work."""
    policy = data.draw(st.sampled_from(["always-mask", "varlen", "always-rows"]))
    d = _input_dispatcher(policy, backend)
    layout = data.draw(st.sampled_from(INPUT_LAYOUTS))
    clean = _qkv(layout, data.draw(st.integers(0, 2**16)))
    ins = [data.draw(st.sampled_from(sorted(QKV_FORMS)), label=name) for name in "qkv"]
    qkv = [QKV_FORMS[form](t) for form, t in zip(ins, clean)]
    with_sinks = policy != "always-mask" or data.draw(st.booleans())
    sinks = None
    if with_sinks:
        sinks = SINK_FORMS[data.draw(st.sampled_from(sorted(SINK_FORMS)), label="sinks")](SINKS)
    through_step = data.draw(st.booleans(), label="through a prepared step")
    refused = data.draw(st.sampled_from([None, "q", "k", "v", "sinks", "spec dtype"]))
    match = None
    if refused in ("q", "k", "v"):
        bad, match = QKV_REFUSED[data.draw(st.sampled_from(sorted(QKV_REFUSED)), label=refused)]
        qkv["qkv".index(refused)] = bad(qkv["qkv".index(refused)])
    elif refused == "sinks" and with_sinks:
        bad, match = SINKS_REFUSED[data.draw(st.sampled_from(sorted(SINKS_REFUSED)), label="bad sinks")]
        sinks = bad(SINKS)
    elif refused == "spec dtype" and through_step:  # tensors of another spec than the step's
        qkv, match = [t.double() for t in qkv], "q has dtype torch.float64, but this step's graphs"
    before = d.stats()

    def run() -> torch.Tensor:
        if not through_step:
            return d.attend(*qkv, layout, sinks=sinks)
        spec = TensorSpec.of(clean[0], clean[1], None, Features(sinks=with_sinks))
        try:
            return d.prepare(layout, spec).run(*qkv, sinks)
        finally:
            d.release_batch()

    if match is not None:
        with pytest.raises(LayoutError, match=match):
            run()
        after = d.stats()
        assert after.cache.compiles == before.cache.compiles
        if not through_step:  # refused before any work: nothing counted
            assert after.batches == before.batches
        return
    out = run()
    assert d.stats().cache.compiles == before.cache.compiles  # every form ran on the graphs compiled before
    want = reference_for(*qkv, layout, sinks=None if sinks is None else sinks.double())
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def _form(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.stride(), x.dtype, x.device
    return x


@pytest.mark.parametrize("policy", ["always-mask", "varlen"])
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_graphs_get_exactly_the_forms_they_were_compiled_for(data, policy):
    """Whatever form q, k, v and sinks arrive in, every graph is called with inputs of the
    shapes, strides, dtypes and devices of the example inputs it was compiled on."""
    seen: list[tuple[object, ...]] = []

    def builder(call, key, spec):
        fn = graph_fn(call, key.impl, spec.scale, None, spec.features)
        want = tuple(_form(t) for t in example_inputs(call, spec))

        def recorded(*args):
            seen.append((tuple(_form(a) for a in args), want))
            return fn(*args)
        return recorded

    d = Dispatcher(AttnPolicyConfig(policy=policy, max_seq_len=16, max_batch_tokens=16,
                                    buckets={"kind": "list", "sizes": [16]}), builder=builder)
    layout = data.draw(st.sampled_from(INPUT_LAYOUTS))
    qkv = [QKV_FORMS[data.draw(st.sampled_from(sorted(QKV_FORMS)))](t) for t in _qkv(layout, 2)]
    sinks = data.draw(st.one_of(st.none(), st.sampled_from(sorted(SINK_FORMS)).map(lambda f: SINK_FORMS[f](SINKS))))
    out = d.attend(*qkv, layout, sinks=sinks)
    assert seen
    for got, want in seen:
        assert got == want
    want_out = reference_for(*qkv, layout, sinks=None if sinks is None else sinks.double())
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def _free_graphs():
    yield
    for cache in _caches.values():
        cache.clear()
    for d in _input_dispatchers.values():
        d.cache.clear()
    _dispatchers.clear()
    _caches.clear()
    _input_dispatchers.clear()
