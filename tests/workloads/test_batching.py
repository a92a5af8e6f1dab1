import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpolicy.errors import ConfigError
from attnpolicy.workloads.batching import BatchFormer, ScheduledBatch
from attnpolicy.workloads.traces import Request, load_azure_csv, synthetic_default

AZURE_CODE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "azure_llm_2023_code.csv"


def R(prompt: int, output: int, arrival: float = 0.0) -> Request:
    return Request(arrival, prompt, output)


def shape(step: ScheduledBatch) -> list[tuple[int, int, int]]:
    """(request id, q_len, kv_len) per sequence."""
    lay = step.layout
    return list(zip(step.seq_ids, lay.q_lens, lay.kv_lens))


# -- worked examples ----------------------------------------------------------------


def test_chunked_prefill_then_decodes():
    steps = list(BatchFormer(max_num_batched_tokens=2048).steps([R(5000, 3)]))
    assert [shape(s) for s in steps] == [
        [(0, 2048, 2048)],
        [(0, 2048, 4096)],
        [(0, 904, 5000)],  # samples output token 1
        [(0, 1, 5001)],  # decode of token 1 → token 2
        [(0, 1, 5002)],  # → token 3, done
    ]
    assert [(s.num_prefill, s.num_decode) for s in steps] == [(1, 0), (1, 0), (1, 0), (0, 1), (0, 1)]
    assert [s.index for s in steps] == [0, 1, 2, 3, 4]
    assert not steps[0].layout.has_context and steps[1].layout.has_context


def test_decodes_first_then_prefill_fills_the_budget():
    former = BatchFormer(max_num_seqs=4, max_num_batched_tokens=10)
    steps = list(former.steps([R(4, 3), R(5, 1), R(8, 2)]))
    assert [shape(s) for s in steps] == [
        [(0, 4, 4), (1, 5, 5), (2, 1, 1)],
        [(0, 1, 5), (2, 7, 8)],
        [(0, 1, 6), (2, 1, 9)],
    ]
    assert (steps[1].num_decode, steps[1].num_prefill) == (1, 1)


def test_without_chunking_the_queue_head_waits_for_room():
    former = BatchFormer(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=10,
                         chunked_prefill=False)
    steps = list(former.steps([R(6, 2), R(6, 1), R(2, 1)]))
    # request 2 fits step 0's leftover budget but must not overtake request 1
    assert [shape(s) for s in steps] == [
        [(0, 6, 6)],
        [(0, 1, 7), (1, 6, 6), (2, 2, 2)],
    ]


def test_max_num_seqs_bounds_admission():
    steps = list(BatchFormer(max_num_seqs=1, max_num_batched_tokens=64).steps([R(3, 2), R(3, 1)]))
    assert [shape(s) for s in steps] == [[(0, 3, 3)], [(0, 1, 4)], [(1, 3, 3)]]


def test_admission_follows_arrival_not_list_order():
    steps = list(BatchFormer(max_num_seqs=1, max_num_batched_tokens=64).steps(
        [R(3, 1, arrival=2.0), R(4, 1, arrival=1.0)]))
    assert [s.seq_ids for s in steps] == [(1,), (0,)]


def test_too_long_requests_are_rejected():
    former = BatchFormer(max_model_len=100)
    requests = [R(90, 11), R(90, 10), R(101, 0)]
    steps = former.steps(requests)
    assert former.rejected == (requests[0], requests[2])
    assert {i for s in steps for i in s.seq_ids} == {1}


def test_prefill_only_bidirectional():
    former = BatchFormer(max_num_batched_tokens=16, max_model_len=16, prefill_only=True,
                         chunked_prefill=False, causal=False)
    steps = list(former.steps([R(5, 7), R(9, 0), R(4, 3)]))
    assert [shape(s) for s in steps] == [[(0, 5, 5), (1, 9, 9)], [(2, 4, 4)]]
    assert all(not s.layout.causal and s.num_decode == 0 for s in steps)


def test_output_zero_is_prefill_only_for_that_request():
    steps = list(BatchFormer().steps([R(5, 0), R(5, 2)]))
    assert [shape(s) for s in steps] == [[(0, 5, 5), (1, 5, 5)], [(1, 1, 6)]]


def test_same_input_same_steps_and_no_requests_no_steps():
    reqs = synthetic_default(60)
    former = BatchFormer(max_num_seqs=8, max_num_batched_tokens=512)
    assert [(s.layout, s.seq_ids) for s in former.steps(reqs)] == [
        (s.layout, s.seq_ids) for s in former.steps(reqs)]
    assert list(former.steps([])) == []


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be an int >= 1, got 0"),
        ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens must be an int"),
        ({"max_model_len": -3}, "max_model_len must be"),
        ({"causal": 1}, "causal must be a bool"),
        ({"max_num_seqs": 32, "max_num_batched_tokens": 16}, "max_num_batched_tokens=16 must be >= max_num_seqs=32"),
        ({"chunked_prefill": False}, "max_num_batched_tokens=2048 must be >= max_model_len=8192"),
        ({"causal": False, "prefill_only": False}, "causal=False needs prefill_only=True"),
        ({"causal": False, "prefill_only": True}, "causal=False needs chunked_prefill=False"),
    ],
)
def test_bad_knobs(kwargs, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        BatchFormer(**kwargs)


# -- invariants ----------------------------------------------------------------------------


@st.composite
def scenarios(draw):
    max_num_seqs = draw(st.integers(1, 5))
    budget = draw(st.integers(max_num_seqs, 64))
    chunked = draw(st.booleans())
    prefill_only = draw(st.booleans())
    max_model_len = draw(st.integers(1, 96 if chunked else budget))
    requests = draw(st.lists(
        st.builds(Request, st.floats(0, 10), st.integers(1, 60), st.integers(0, 12)), max_size=10))
    former = BatchFormer(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         chunked_prefill=chunked, prefill_only=prefill_only,
                         max_model_len=max_model_len)
    return former, requests


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_batch_former_invariants(scenario):
    former, requests = scenario
    steps = list(former.steps(requests))
    need = [r.prompt_tokens + (0 if former.prefill_only else r.output_tokens) for r in requests]
    accepted = {i for i, n in enumerate(need) if n <= former.max_model_len}
    assert sorted(former.rejected, key=id) == sorted(
        (r for i, r in enumerate(requests) if i not in accepted), key=id)

    prefilled = dict.fromkeys(accepted, 0)
    generated = dict.fromkeys(accepted, 0)
    decodes = dict.fromkeys(accepted, 0)
    first_step = {}
    for k, step in enumerate(steps):
        lay = step.layout
        assert step.index == k and lay.causal
        assert lay.num_seqs <= former.max_num_seqs
        assert lay.total_tokens <= former.max_num_batched_tokens
        assert step.num_decode + step.num_prefill == lay.num_seqs == len(set(step.seq_ids))
        for pos, (rid, q, kv) in enumerate(shape(step)):
            r = requests[rid]
            first_step.setdefault(rid, k)
            if pos < step.num_decode:  # decode: kv = prompt + tokens generated so far
                assert prefilled[rid] == r.prompt_tokens and q == 1
                assert kv == r.prompt_tokens + generated[rid]
                generated[rid] += 1
                decodes[rid] += 1
            else:  # prefill chunk: context = tokens already prefilled
                assert prefilled[rid] < r.prompt_tokens
                assert kv == prefilled[rid] + q
                if not former.chunked_prefill:
                    assert q == r.prompt_tokens
                prefilled[rid] += q
                if prefilled[rid] == r.prompt_tokens and r.output_tokens and not former.prefill_only:
                    generated[rid] = 1
    for rid in accepted:
        r = requests[rid]
        assert prefilled[rid] == r.prompt_tokens
        assert decodes[rid] == (0 if former.prefill_only else max(0, r.output_tokens - 1))
    # first come, first served: admission order follows arrival order
    admitted = sorted(first_step, key=lambda rid: (requests[rid].arrival, rid))
    assert [first_step[rid] for rid in admitted] == sorted(first_step.values())


# -- realistic workloads ------------------------------------------------------------------------


def _check_accounts(former: BatchFormer, requests: list[Request]) -> list[ScheduledBatch]:
    steps = list(former.steps(requests))
    served = {i for s in steps for i in s.seq_ids}
    assert len(served) + len(former.rejected) == len(requests)
    assert all(s.layout.total_tokens <= former.max_num_batched_tokens for s in steps)
    return steps


def test_synthetic_default_forms_mixed_batches():
    steps = _check_accounts(BatchFormer(), synthetic_default())
    assert any(s.num_decode and s.num_prefill for s in steps)
    assert any(s.layout.has_context and s.num_prefill and not s.num_decode for s in steps)


@pytest.mark.skipif(not AZURE_CODE.is_file(), reason=f"{AZURE_CODE} not present")
def test_azure_code_trace_smoke():
    requests = load_azure_csv(AZURE_CODE, limit=500)
    assert len(requests) == 500
    steps = _check_accounts(BatchFormer(), requests)
    assert any(s.num_decode and s.num_prefill for s in steps)
