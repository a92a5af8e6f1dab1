"""Built-in policies (through the plugin manager) and the `policies` / `decide` CLI."""

from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from attnpolicy.cli.policies import register
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, MaskMode, is_legal
from attnpolicy.errors import PolicyError
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.builtin import why_not_causal
from attnpolicy.policies.registry import make_policy, policy_registry

CTX = PolicyContext()
#: name -> (q_lens, kv_lens, causal, q_tokens): the raw lengths each layout is built from
RAW = {
    "single": ([512], [512], True, 512),
    "packed": ([100, 200, 300], [100, 200, 300], True, 600),
    "padded": ([500], [500], True, 512),
    "bidirectional": ([512], [512], False, 512),
    "context": ([16], [512], True, 16),
}
LAYOUTS = {name: BatchLayout.from_lens(q, kv, causal=causal, padded_to=tokens)
           for name, (q, kv, causal, tokens) in RAW.items()}


def causal_is_correct(q_lens: list[int], kv_lens: list[int], causal: bool, q_tokens: int) -> bool:
    """The legality rule from its definition, on the raw lengths (not through the
    library): CAUSAL computes the right answer only for one causal sequence whose keys
    are its queries (kv_len == q_len) with no padding row."""
    return len(q_lens) == 1 and causal and kv_lens[0] == q_lens[0] and q_tokens == q_lens[0]
REASONS = {
    "packed": "3 sequences packed",
    "padded": "padded",
    "bidirectional": "bidirectional",
    "context": "cached context",
}
C, M, V = MaskMode.CAUSAL, MaskMode.MASK, MaskMode.VARLEN
EXPECTED = {  # policy -> mode per layout, in LAYOUTS order
    "always-mask": (M, M, M, M, M),
    "always-causal": (C, C, C, C, C),
    "dynamic": (C, M, M, M, M),
    "varlen": (C, V, V, V, V),
    "always-rows": (MaskMode.ROWS,) * 5,
}


pytestmark = pytest.mark.usefixtures("fresh_plugins")


def test_builtins_are_registered_by_the_policies_plugin():
    registry = policy_registry()
    for name in EXPECTED:
        info = registry[name]
        assert info.name == name
        assert info.plugin == "attnpolicy.policies.builtin"
        assert info.description
        assert info.cls.name == name


@pytest.mark.parametrize("policy", sorted(EXPECTED))
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_builtin_modes(policy, layout_name):
    decision = make_policy(policy).decide(LAYOUTS[layout_name], CTX)
    assert isinstance(decision, Decision)
    assert decision.mode is EXPECTED[policy][list(LAYOUTS).index(layout_name)]
    assert decision.reason


@pytest.mark.parametrize("policy", ["dynamic", "varlen"])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_causal_when_legal_reasons(policy, layout_name):
    decision = make_policy(policy).decide(LAYOUTS[layout_name], CTX)
    assert decision.reason == REASONS.get(layout_name, "single unpadded causal sequence")


def test_dynamic_and_varlen_only_choose_legal_modes():
    for policy in ("dynamic", "varlen", "always-mask"):
        p = make_policy(policy)
        for name, layout in LAYOUTS.items():
            mode = p.decide(layout, CTX).mode
            assert mode is not C or causal_is_correct(*RAW[name]), (policy, name)
            assert is_legal(mode, layout)


def test_always_causal_is_illegal_on_a_packed_batch():
    layout = LAYOUTS["packed"]
    assert not is_legal(make_policy("always-causal").decide(layout, CTX).mode, layout)


@given(
    lens=st.lists(st.integers(1, 64), min_size=1, max_size=4),
    extra_ctx=st.integers(0, 8),
    pad=st.integers(0, 8),
    causal=st.booleans(),
)
@example(lens=[5], extra_ctx=0, pad=3, causal=True)  # one padded sequence
@example(lens=[5], extra_ctx=2, pad=0, causal=True)  # one sequence with cached context
@example(lens=[5], extra_ctx=0, pad=0, causal=False)
@example(lens=[5], extra_ctx=0, pad=0, causal=True)  # the one legal case
@example(lens=[5, 5], extra_ctx=0, pad=0, causal=True)
def test_why_not_causal_agrees_with_the_legality_rule(lens, extra_ctx, pad, causal):
    kv = [n + extra_ctx for n in lens]
    tokens = sum(lens) + (0 if extra_ctx else pad)
    layout = (BatchLayout.from_lens(lens, kv, causal=causal) if extra_ctx
              else BatchLayout.from_lens(lens, causal=causal, padded_to=tokens))
    legal = causal_is_correct(lens, kv, causal, tokens)
    assert (why_not_causal(layout) is None) == legal
    assert is_legal(MaskMode.CAUSAL, layout) == legal


def test_unknown_policy_lists_known_names():
    with pytest.raises(PolicyError) as info:
        make_policy("nope")
    message = str(info.value)
    assert "'nope'" in message
    for name in EXPECTED:
        assert name in message


def test_bad_options_name_policy_and_options():
    with pytest.raises(PolicyError) as info:
        make_policy("dynamic", threshold=3)
    message = str(info.value)
    assert "'dynamic'" in message and "threshold" in message and "attnpolicy.policies.builtin" in message
    assert isinstance(info.value.__cause__, TypeError)


# -- CLI --------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="attnpolicy")
    register(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_policies_json(capsys):
    assert run_cli(["policies", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_name = {r["name"]: r for r in rows}
    assert set(EXPECTED) <= set(by_name)
    assert by_name["dynamic"]["plugin"] == "attnpolicy.policies.builtin"
    assert by_name["dynamic"]["description"] == policy_registry()["dynamic"].description


def test_cli_policies_table(capsys):
    assert run_cli(["policies"]) == 0
    out = capsys.readouterr().out
    for name in EXPECTED:
        assert name in out


@pytest.mark.parametrize(
    ("argv", "mode", "fell_back"),
    [
        (["--policy", "dynamic", "--seq-lens", "512"], "causal", False),
        (["--policy", "dynamic", "--seq-lens", "100,200"], "mask", False),
        (["--policy", "varlen", "--seq-lens", "100,200"], "varlen", False),
        (["--policy", "dynamic", "--seq-lens", "64", "--bidirectional"], "mask", False),
        (["--policy", "varlen", "--seq-lens", "16", "--kv-lens", "512"], "varlen", False),
        (["--policy", "always-causal", "--seq-lens", "100,200"], "varlen", True),
        (["--policy", "always-causal", "--seq-lens", "100,200", "--fallback", "mask"], "mask", True),
    ],
)
def test_cli_decide_json(capsys, argv, mode, fell_back):
    assert run_cli(["decide", *argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == argv[1]
    assert out["mode"] == mode
    assert out["fell_back"] is fell_back
    assert out["reason"].startswith("guard:") is fell_back


def test_cli_decide_text(capsys):
    assert run_cli(["decide", "--policy", "dynamic", "--seq-lens", "1,2,3"]) == 0
    assert capsys.readouterr().out.strip() == "dynamic: mask (3 sequences packed)"


def test_cli_decide_unknown_policy(capsys):
    assert run_cli(["decide", "--policy", "nope", "--seq-lens", "8"]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "dynamic" in err and "always-mask" in err


def test_cli_decide_bad_option(capsys):
    assert run_cli(["decide", "--policy", "varlen", "--seq-lens", "8", "--option", "x=1"]) == 2
    assert "'varlen'" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["abc", "1,,2", "0", "-3", ""])
def test_cli_decide_bad_seq_lens(capsys, value):
    with pytest.raises(SystemExit) as info:
        run_cli(["decide", "--policy", "dynamic", "--seq-lens", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--seq-lens" in err and repr(value) in err


def test_cli_decide_inconsistent_kv_lens(capsys):
    assert run_cli(["decide", "--policy", "dynamic", "--seq-lens", "8,8", "--kv-lens", "8"]) == 2
    assert "kv_lens" in capsys.readouterr().err


def test_cli_decide_on_illegal_raise(capsys):
    argv = ["decide", "--policy", "always-causal", "--seq-lens", "4,4", "--on-illegal", "raise"]
    assert run_cli(argv) == 1
    err = capsys.readouterr().err
    assert "always-causal" in err and "attnpolicy.policies.builtin" in err


def _rows_ctx() -> PolicyContext:
    """A context that plans like a dispatcher of the default config (length buckets pow2
    from 16, row buckets 1..32)."""
    from attnpolicy.config import AttnPolicyConfig
    from attnpolicy.dispatch import Dispatcher
    from attnpolicy.graphs.keys import TensorSpec

    d = Dispatcher(AttnPolicyConfig(policy="dynamic", backend="none"))
    return d.context_for(TensorSpec("float32", 4, 4, 16))


def test_dynamic_keeps_its_rule_by_default_and_runs_rows_within_its_padding_option():
    ctx = _rows_ctx()
    equal, spread = BatchLayout.from_lens([64, 64, 64, 64]), BatchLayout.from_lens([64, 3, 2, 5])
    assert make_policy("dynamic").decide(equal, ctx).mode is M  # the default is unchanged
    assert MaskMode.ROWS not in make_policy("dynamic").modes
    rows = make_policy("dynamic", rows=0.25)
    assert MaskMode.ROWS in rows.modes
    assert rows.decide(equal, ctx) == Decision(MaskMode.ROWS, "4 sequences packed; rows pad 0 tokens")
    # spread: 4 rows of 64 pad 256 - 74 = 182 tokens, more than 25 % of 74
    assert rows.decide(spread, ctx).mode is M
    assert make_policy("dynamic", rows=3.0).decide(spread, ctx).mode is MaskMode.ROWS
    assert rows.decide(LAYOUTS["single"], ctx).mode is C  # one sequence: CAUSAL whenever legal
    assert rows.decide(equal, CTX).mode is M  # no config, no buckets to pad to: its own choice
    # the config alone (a runner's context) pads as a dispatcher plans: the same rule at both levels
    bare = PolicyContext(config=ctx.config)
    assert [rows.decide(x, bare) for x in (equal, spread)] == [rows.decide(x, ctx) for x in (equal, spread)]
    # three decodes in a [4, 1] call pad one row, the prefill beside them 60 -> 64 in its own call
    step = BatchLayout.from_lens([1, 1, 1, 60], [30, 9, 70, 60])
    assert rows.decide(step, bare) == Decision(MaskMode.ROWS, "4 sequences packed; rows pad 5 tokens")
    # a sequence beyond the largest bucket has no rows graph to pad to: its own choice, no error
    long = BatchLayout.from_lens([1, 9000], [30, 9000])
    assert rows.decide(long, bare) == Decision(M, "2 sequences packed")


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "0.2", True])
def test_dynamics_rows_option_is_validated(bad):
    with pytest.raises(PolicyError, match=r"policy 'dynamic' .*rows must be a finite fraction >= 0"):
        make_policy("dynamic", rows=bad)
