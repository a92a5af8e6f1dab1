"""Every hook in attnpolicy.plugins.hookspecs has a test here that exercises it."""

from __future__ import annotations

import cachetools
import pluggy
import pytest
import torch

from attnpolicy.cache.eviction_registry import eviction_registry
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, MaskMode
from attnpolicy.plugins import hookspecs
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.plugins.observers import Observers
from attnpolicy.plugins.registry import get_plugin_manager
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.guard import Guard
from attnpolicy.policies.registry import make_policy, policy_registry

pytestmark = pytest.mark.usefixtures("fresh_plugins")


class Observer:
    """Records what the observer hooks receive."""

    def __init__(self):
        self.seen = []

    @hookimpl
    def attnpolicy_on_decision(self, layout, decision, policy, fell_back):
        self.seen.append(("decision", layout, decision, policy, fell_back))

    @hookimpl
    def attnpolicy_on_compile(self, key, seconds, nbytes):
        self.seen.append(("compile", key, seconds, nbytes))

    @hookimpl
    def attnpolicy_on_evict(self, key, nbytes):
        self.seen.append(("evict", key, nbytes))


def observers(n=2):
    pm = get_plugin_manager()
    obs = [Observer() for _ in range(n)]
    for i, o in enumerate(obs):
        pm.register(o, name=f"observer-{i}")
    return pm, obs


def exercise_register_policies():
    class Half:
        name = "half"
        description = "MASK for even token counts"

        def decide(self, layout, ctx):
            return Decision(MaskMode.MASK if layout.q_tokens % 2 == 0 else MaskMode.VARLEN, "parity")

    class Plugin:
        @hookimpl
        def attnpolicy_register_policies(self, register):
            register(Half)

    get_plugin_manager().register(Plugin(), name="parity-plugin")
    info = policy_registry()["half"]
    assert (info.name, info.plugin, info.cls) == ("half", "parity-plugin", Half)
    assert make_policy("half").decide(BatchLayout.from_lens([3]), PolicyContext()).mode is MaskMode.VARLEN


def exercise_register_evictions():
    class Plugin:
        @hookimpl
        def attnpolicy_register_evictions(self, register):
            register("test-fifo", lambda: cachetools.FIFOCache(maxsize=2))

    get_plugin_manager().register(Plugin(), name="fifo-plugin")
    info = eviction_registry()["test-fifo"]
    assert (info.name, info.plugin) == ("test-fifo", "fifo-plugin")
    cache = info.factory()
    cache["a"], cache["b"] = 1, 2
    assert cache.popitem() == ("a", 1)


def exercise_on_decision():
    pm, (a, b) = observers()
    guard = Guard(make_policy("always-causal"), "always-causal", "attnpolicy.policies.builtin",
                  observers=Observers(pm))
    single, packed = BatchLayout.from_lens([8]), BatchLayout.from_lens([4, 4])
    d1 = guard.decide(single, PolicyContext())
    d2 = guard.decide(packed, PolicyContext())
    expected = [("decision", single, d1, "always-causal", False),
                ("decision", packed, d2, "always-causal", True)]
    assert a.seen == expected and b.seen == expected
    assert d2.mode is MaskMode.VARLEN


def _drive_a_bounded_cache():
    """A dispatcher with room for one graph over layouts that alternate two graphs:
    three compiles, two evictions. Returns the dispatcher's cache keys in compile order."""
    from attnpolicy import AttnPolicyConfig, Dispatcher
    from attnpolicy.graphs.keys import TensorSpec

    d = Dispatcher(AttnPolicyConfig(policy="varlen", backend="none", max_graphs=1))
    spec, keys = TensorSpec("float32", 2, 2, 8), []
    for n in (20, 40, 20):
        layout = BatchLayout.from_lens([n])
        q = torch.randn(n, 2, 8)
        d.attend(q, q, q, layout)
        keys += d.context_for(spec).keys_for(layout, MaskMode.VARLEN)
    stats = d.cache.stats()
    assert (stats.compiles, stats.evictions) == (3, 2)
    return keys


def exercise_on_compile():
    _, obs = observers()
    keys = _drive_a_bounded_cache()
    for o in obs:
        assert [e[1] for e in o.seen if e[0] == "compile"] == keys  # every compile, in order
        assert all(e[2] >= 0 and e[3] > 0 for e in o.seen if e[0] == "compile")


def exercise_on_evict():
    _, obs = observers()
    keys = _drive_a_bounded_cache()
    for o in obs:
        assert [e[1] for e in o.seen if e[0] == "evict"] == keys[:2]  # max_graphs=1: the older one goes
        assert all(e[2] > 0 for e in o.seen if e[0] == "evict")


def exercise_register_compilers():
    from plugin_compilers import RECORD, CompilerPlugin

    from attnpolicy import AttnPolicyConfig, Dispatcher

    RECORD.reset()
    get_plugin_manager().register(CompilerPlugin(), name="counting-plugin")
    d = Dispatcher(AttnPolicyConfig(policy="always-causal", backend="counting", max_seq_len=64))
    q = torch.randn(20, 2, 8)
    torch.testing.assert_close(d.attend(q, q, q, BatchLayout.from_lens([20])),
                               torch.nn.functional.scaled_dot_product_attention(
                                   *(q.transpose(0, 1),) * 3, is_causal=True).transpose(0, 1))
    assert d.stats().cache.compiles == RECORD.compiles == 1


def exercise_register_kernels():
    from plugin_kernels import recording_sdpa
    from reference import reference_for

    from attnpolicy import AttnPolicyConfig, Dispatcher
    from attnpolicy.errors import ConfigError
    from attnpolicy.plugins.kernels import KernelInfo, get_kernel

    plain, calls = recording_sdpa()

    class Plugin:
        @hookimpl
        def attnpolicy_register_kernels(self, register):
            register(KernelInfo("plain", "varlen", plain, gqa=False, context=False))

    get_plugin_manager().register(Plugin(), name="plain-plugin")
    assert get_kernel("varlen", "plain").plugin == "plain-plugin"
    d = Dispatcher(AttnPolicyConfig(policy="varlen", backend="none", kernels={"varlen": "plain"}))
    layout = BatchLayout.from_lens([3, 5], causal=False)  # bidirectional: VARLEN graphs
    q = torch.randn(8, 2, 8)
    torch.testing.assert_close(d.attend(q, q, q, layout).double(), reference_for(q, q, q, layout),
                               atol=1e-5, rtol=1e-5)
    assert len(calls) >= 2  # the plugin kernel computed both sequences
    with pytest.raises(ConfigError, match="kernel 'plain' cannot serve this varlen call.*GQA"):
        d.attend(q, q[:, :1], q[:, :1], layout)
    context = BatchLayout.from_lens([3, 5], [4, 5], causal=False)
    kv = torch.randn(9, 2, 8)
    with pytest.raises(ConfigError, match="kernel 'plain' cannot serve this varlen call.*cached context"):
        d.attend(q, kv, kv, context)


EXERCISED = {
    "attnpolicy_register_compilers": exercise_register_compilers,
    "attnpolicy_register_kernels": exercise_register_kernels,
    "attnpolicy_register_policies": exercise_register_policies,
    "attnpolicy_register_evictions": exercise_register_evictions,
    "attnpolicy_on_decision": exercise_on_decision,
    "attnpolicy_on_compile": exercise_on_compile,
    "attnpolicy_on_evict": exercise_on_evict,
}


def hook_names():
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return sorted(n for n in dir(pm.hook) if n.startswith("attnpolicy_"))


@pytest.mark.parametrize("hook_name", hook_names())
def test_every_hook_is_exercised(hook_name):
    assert hook_name in EXERCISED, f"no test exercises hook {hook_name}: add one to EXERCISED"


def test_exercised_names_are_hooks():
    assert sorted(EXERCISED) == hook_names()


@pytest.mark.parametrize("hook_name", sorted(EXERCISED))
def test_hook(hook_name):
    EXERCISED[hook_name]()


# -- observers never break attention ---------------------------------------------------------


class Raising:
    """An observer whose every hook raises."""

    def __init__(self):
        self.calls = 0

    @hookimpl
    def attnpolicy_on_decision(self, decision):
        self.calls += 1
        raise RuntimeError("observer bug")

    @hookimpl
    def attnpolicy_on_compile(self, key):
        self.calls += 1
        raise KeyError("observer bug")

    @hookimpl
    def attnpolicy_on_evict(self, key):
        self.calls += 1
        raise ValueError("observer bug")


def test_a_raising_observer_is_isolated_logged_once_and_counted(caplog):
    import torch

    from attnpolicy import AttnPolicyConfig, Dispatcher

    pm, (before,) = observers(1)
    raising = Raising()
    pm.register(raising, name="raising")
    after = Observer()
    pm.register(after, name="after")
    d = Dispatcher(AttnPolicyConfig(policy="varlen", backend="none", max_graphs=1))
    layouts = [BatchLayout.from_lens([n]) for n in (20, 40, 20, 40)]
    for layout in layouts:
        q = torch.randn(layout.q_tokens, 2, 8)
        d.attend(q, q, q, layout)  # no exception reaches attention
    kinds = [event[0] for event in after.seen]
    assert kinds == [event[0] for event in before.seen]  # every other observer saw everything
    assert kinds.count("decision") == 4 and kinds.count("compile") == 4 and kinds.count("evict") == 3
    assert d.stats().observer_errors == {"raising": raising.calls} and raising.calls == 11
    warned = [r.getMessage() for r in caplog.records if r.name == "attnpolicy.plugins"]
    assert len(warned) == 3 and all("'raising'" in m and "observer bug" in m for m in warned)  # once per hook


def test_observers_cost_no_hook_call_when_none_is_registered():
    from attnpolicy import AttnPolicyConfig, Dispatcher

    pm = get_plugin_manager()
    called: list[str] = []
    undo = pm.add_hookcall_monitoring(lambda name, impls, kwargs: called.append(name), lambda *a: None)
    try:
        def batches(d):
            for n in (20, 40, 20, 40):
                q = torch.randn(n, 2, 8)
                d.attend(q, q, q, BatchLayout.from_lens([n]))

        batches(Dispatcher(AttnPolicyConfig(policy="varlen", backend="none", max_graphs=1)))
        observed = [n for n in called if n.startswith("attnpolicy_on_")]
        assert observed == []  # no observer: not one hook call, whatever the batch did
        pm.register(Observer(), name="observer")  # the control: one observer sees each event once
        batches(Dispatcher(AttnPolicyConfig(policy="varlen", backend="none", max_graphs=1)))
        observed = [n for n in called if n.startswith("attnpolicy_on_")]
        assert observed.count("attnpolicy_on_decision") == 4
        assert observed.count("attnpolicy_on_compile") == 4 and observed.count("attnpolicy_on_evict") == 3
    finally:
        undo()
