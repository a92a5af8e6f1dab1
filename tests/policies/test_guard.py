"""The guard: whatever a policy does, the decision that runs is legal (or PolicyError)."""

from __future__ import annotations

import logging

import pytest

from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, MaskMode, is_legal
from attnpolicy.errors import IllegalModeError, PolicyError
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.plugins.observers import Observers
from attnpolicy.plugins.registry import get_plugin_manager
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.guard import Guard
from attnpolicy.policies.registry import make_policy, policy_registry

CTX = PolicyContext()
SINGLE = BatchLayout.from_lens([64])
PACKED = BatchLayout.from_lens([10, 20, 30])


class Raises:
    name = "raises"
    description = "raises on every batch"

    def decide(self, layout, ctx):
        raise ValueError("boom")


class ReturnsString:
    name = "returns-string"
    description = "returns a bare string"

    def decide(self, layout, ctx):
        return "causal"


class Recorder:
    """A plugin that records every attnpolicy_on_decision call."""

    def __init__(self):
        self.calls = []

    @hookimpl
    def attnpolicy_on_decision(self, layout, decision, policy, fell_back):
        self.calls.append((layout, decision, policy, fell_back))


pytestmark = pytest.mark.usefixtures("fresh_plugins")


@pytest.fixture
def recorder():
    rec = Recorder()
    get_plugin_manager().register(rec, name="recorder")
    return rec


def guard(policy, name="test-policy", **kwargs):
    return Guard(policy, name, "test-plugin", observers=Observers(get_plugin_manager()), **kwargs)


BAD = {  # category -> (make policy, layout, type of the cause, words the message must contain)
    "illegal": (lambda: make_policy("always-causal"), PACKED, IllegalModeError,
                ["chose causal", "3 seqs", "CAUSAL needs one sequence"]),
    "exception": (Raises, SINGLE, ValueError, ["raised ValueError: boom"]),
    "bad-return": (ReturnsString, SINGLE, type(None), ["returned str", "not a Decision"]),
}


def bad_policy(category):
    make, layout, cause, words = BAD[category]
    return make(), layout, cause, words


@pytest.mark.parametrize("category", list(BAD))
def test_raise_names_plugin_policy_and_problem(category, recorder):
    policy, layout, cause, words = bad_policy(category)
    g = guard(policy, on_illegal="raise")
    with pytest.raises(PolicyError) as info:
        g.decide(layout, CTX)
    message = str(info.value)
    assert "'test-policy'" in message and "'test-plugin'" in message
    for word in words:
        assert word in message
    assert type(info.value.__cause__) is cause
    assert g.fallbacks == 0
    assert recorder.calls == []  # nothing ran


@pytest.mark.parametrize("fallback", [MaskMode.VARLEN, MaskMode.MASK])
@pytest.mark.parametrize("category", list(BAD))
def test_fallback_is_legal_counted_logged_and_observed(category, fallback, recorder, caplog):
    policy, layout, _, words = bad_policy(category)
    g = guard(policy, fallback=fallback)
    with caplog.at_level(logging.DEBUG, logger="attnpolicy.policies.guard"):
        first = g.decide(layout, CTX)
        g.decide(layout, CTX)
    assert first.mode is fallback
    assert is_legal(first.mode, layout)
    assert first.reason.startswith("guard: policy 'test-policy' (plugin 'test-plugin')")
    assert first.reason.endswith(f"; fell back to {fallback.value}")
    for word in words:
        assert word in first.reason
    assert g.fallbacks == 2
    assert g.fallback_reasons == {category: 2}
    warnings = [r for r in caplog.records if r.name == "attnpolicy.policies.guard"]
    # one warning per kind of failure, then debug lines (a wrong policy is wrong every batch)
    assert [r.levelno for r in warnings] == [logging.WARNING, logging.DEBUG]
    assert "test-policy" in warnings[0].getMessage()
    assert recorder.calls[0] == (layout, first, "test-policy", True)
    assert len(recorder.calls) == 2


def test_fallback_reasons_count_each_category_separately():
    g = guard(make_policy("always-causal"))
    g.decide(PACKED, CTX)
    g.decide(SINGLE, CTX)  # legal: not counted
    g2 = guard(Raises())
    g2.decide(SINGLE, CTX)
    assert g.fallbacks == 1 and g.fallback_reasons == {"illegal": 1}
    assert g2.fallback_reasons == {"exception": 1}


@pytest.mark.parametrize("name", ["dynamic", "varlen", "always-mask", "always-causal"])
def test_legal_decision_passes_through_and_is_observed(name, recorder):
    policy = make_policy(name)
    g = guard(policy, name=name)
    expected = policy.decide(SINGLE, CTX)
    decision = g.decide(SINGLE, CTX)
    assert decision is expected
    assert g.fallbacks == 0 and not g.fallback_reasons
    assert recorder.calls == [(SINGLE, decision, name, False)]


def test_manager_and_guard_still_usable_after_a_failure(recorder):
    g = guard(make_policy("always-causal"))
    assert g.decide(PACKED, CTX).mode is MaskMode.VARLEN
    assert g.decide(SINGLE, CTX).mode is MaskMode.CAUSAL
    assert "dynamic" in policy_registry()
    assert guard(make_policy("dynamic")).decide(PACKED, CTX).mode is MaskMode.MASK
    assert [call[3] for call in recorder.calls] == [True, False, False]


def test_default_hook_is_the_global_manager(recorder):
    g = Guard(make_policy("varlen"), "varlen", "attnpolicy.policies.builtin")
    g.decide(PACKED, CTX)
    assert recorder.calls[0][1:] == (Decision(MaskMode.VARLEN, "3 sequences packed"), "varlen", False)


def test_for_policy_builds_from_the_registry(recorder):
    g = Guard.for_policy("always-causal", on_illegal="raise")
    assert (g.policy_name, g.plugin) == ("always-causal", "attnpolicy.policies.builtin")
    with pytest.raises(PolicyError, match="attnpolicy.policies.builtin"):
        g.decide(PACKED, CTX)
    with pytest.raises(PolicyError, match="known policies"):
        Guard.for_policy("nope")
    with pytest.raises(PolicyError, match="rejected policy_options"):
        Guard.for_policy("dynamic", {"bogus": 1})


@pytest.mark.parametrize("category", sorted(BAD))
def test_preview_has_no_side_effect(recorder, caplog, category):
    make, layout, _, _ = BAD[category]
    g = guard(make())
    with caplog.at_level(logging.DEBUG, logger="attnpolicy.policies.guard"):
        previewed = g.preview(layout, CTX)
    assert (g.fallbacks, dict(g.fallback_reasons), recorder.calls, caplog.records) == (0, {}, [], [])
    assert previewed == g.decide(layout, CTX)  # the same answer decide gives
    assert g.fallbacks == 1 and len(recorder.calls) == 1


def test_preview_uses_the_policy_preview_when_it_has_one(recorder):
    class Stateful:
        def __init__(self):
            self.n = 0

        def decide(self, layout, ctx):
            self.n += 1
            return Decision(MaskMode.MASK, f"call {self.n}")

        def preview(self, layout, ctx):
            return Decision(MaskMode.MASK, f"call {self.n + 1}")

    policy = Stateful()
    g = guard(policy)
    assert [g.preview(SINGLE, CTX).reason for _ in range(3)] == ["call 1"] * 3
    assert policy.n == 0 and recorder.calls == []
    assert g.decide(SINGLE, CTX).reason == "call 1" and policy.n == 1


def test_preview_raises_like_decide_with_on_illegal_raise():
    with pytest.raises(PolicyError, match="chose causal"):
        guard(make_policy("always-causal"), on_illegal="raise").preview(PACKED, CTX)


def test_fallback_must_be_always_legal():
    with pytest.raises(PolicyError, match="fallback.*causal"):
        guard(make_policy("dynamic"), fallback=MaskMode.CAUSAL)
    with pytest.raises(PolicyError, match="fallback.*'flex'"):
        guard(make_policy("dynamic"), fallback="flex")
    assert guard(make_policy("dynamic"), fallback="mask").fallback is MaskMode.MASK


def test_on_illegal_is_validated():
    with pytest.raises(PolicyError, match="on_illegal.*'ignore'"):
        guard(make_policy("dynamic"), on_illegal="ignore")


@pytest.mark.usefixtures("fresh_plugins")
def test_modes_are_the_declared_ones_and_the_fallback():
    C, M, V = MaskMode.CAUSAL, MaskMode.MASK, MaskMode.VARLEN
    assert Guard.for_policy("varlen").modes == {C, V}
    assert Guard.for_policy("dynamic").modes == {C, M, V}  # a raising policy falls back to varlen
    assert Guard.for_policy("always-causal", on_illegal="raise").modes == {C}
    assert Guard.for_policy("always-causal", fallback=M).modes == {C, M}
    assert Guard(Raises(), "raises", "test").modes == set(MaskMode)  # no declaration: every mode
