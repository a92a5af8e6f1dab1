import re
from pathlib import Path

import pytest

from attnpolicy.errors import AttnPolicyError
from attnpolicy.workloads.traces import (
    OUTPUT_RANGE,
    PROMPT_RANGE,
    Request,
    TraceError,
    load_azure_csv,
    load_trace,
    synthetic_default,
)

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write(tmp_path: Path, body: str, header: str = HEADER) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(header + body)
    return path


# -- Request ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"arrival": -1.0, "prompt_tokens": 5, "output_tokens": 1}, "arrival"),
        ({"arrival": float("nan"), "prompt_tokens": 5, "output_tokens": 1}, "arrival"),
        ({"arrival": 0.0, "prompt_tokens": 0, "output_tokens": 1}, "prompt_tokens"),
        ({"arrival": 0.0, "prompt_tokens": 5, "output_tokens": -1}, "output_tokens"),
        ({"arrival": 0.0, "prompt_tokens": 5.0, "output_tokens": 1}, "prompt_tokens"),
    ],
)
def test_request_validates(kwargs, field):
    with pytest.raises(TraceError, match=field):
        Request(**kwargs)


def test_trace_error_is_an_attnpolicy_value_error():
    assert issubclass(TraceError, AttnPolicyError) and issubclass(TraceError, ValueError)


# -- synthetic default --------------------------------------------------------------


def test_synthetic_is_deterministic_and_seeded():
    a = synthetic_default(200, seed=3)
    assert a == synthetic_default(200, seed=3)
    assert a != synthetic_default(200, seed=4)
    assert synthetic_default(50, seed=3) == a[:50]


def test_synthetic_distribution_sanity():
    reqs = synthetic_default()
    assert len(reqs) == 400
    assert reqs[0].arrival == 0.0
    assert all(a.arrival <= b.arrival for a, b in zip(reqs, reqs[1:]))
    prompts = [r.prompt_tokens for r in reqs]
    outputs = [r.output_tokens for r in reqs]
    assert PROMPT_RANGE[0] <= min(prompts) and max(prompts) <= PROMPT_RANGE[1]
    assert OUTPUT_RANGE[0] <= min(outputs) and max(outputs) <= OUTPUT_RANGE[1]
    short = sum(p < 512 for p in prompts)
    long_ = sum(p >= 2048 for p in prompts)
    assert short >= 40 and long_ >= 80  # both classes well represented


def test_synthetic_rejects_bad_n():
    with pytest.raises(TraceError, match="n must be"):
        synthetic_default(-1)


# -- Azure CSV ----------------------------------------------------------------------------


def test_load_azure_csv(tmp_path):
    path = write(
        tmp_path,
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:04.0319600,3180,8\n"
        "\n"
        "2023-11-16 18:17:05,110,0\n",
    )
    reqs = load_azure_csv(path)
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == [(4808, 10), (3180, 8), (110, 0)]
    assert reqs[0].arrival == 0.0
    assert reqs[1].arrival == pytest.approx(0.052, abs=1e-9)
    assert reqs[2].arrival == pytest.approx(1.02004, abs=1e-9)
    assert load_azure_csv(path, limit=2) == reqs[:2]
    assert load_azure_csv(path, limit=0) == []


def test_load_azure_csv_crosses_midnight(tmp_path):
    path = write(tmp_path, "2023-11-16 23:59:59.5,5,1\n2023-11-17 00:00:00.25,5,1\n")
    assert load_azure_csv(path)[1].arrival == pytest.approx(0.75)


@pytest.mark.parametrize(
    ("body", "line", "needle"),
    [
        ("2023-11-16 18:17:03.97,5,1\n2023-11-16 18:17:04.0,7\n", 3, "expected 3 columns"),
        ("2023-11-16 18:17:03.97,5,1\n2023-11-16 18:17:04.0,7,1,9\n", 3, "expected 3 columns"),
        ("2023-11-16 18:17:03.97,five,1\n", 2, "ContextTokens must be an integer, got 'five'"),
        ("2023-11-16 18:17:03.97,5.5,1\n", 2, "ContextTokens must be an integer, got '5.5'"),
        ("2023-11-16 18:17:03.97,0,1\n", 2, "ContextTokens must be >= 1, got 0"),
        ("2023-11-16 18:17:03.97,-4,1\n", 2, "ContextTokens must be >= 1, got -4"),
        ("2023-11-16 18:17:03.97,5,-1\n", 2, "GeneratedTokens must be >= 0, got -1"),
        ("2023-11-16 18:17:03.97,5,x\n", 2, "GeneratedTokens must be an integer"),
        ("2023-11-16,5,1\n", 2, "TIMESTAMP '2023-11-16' is not a timestamp"),
        ("2023-13-16 18:17:03.97,5,1\n", 2, "TIMESTAMP '2023-13-16 18:17:03.97'"),
        ("2023-11-16 18:17:04,5,1\n2023-11-16 18:17:03,5,1\n", 3, "earlier than the previous"),
    ],
)
def test_load_azure_csv_malformed_rows_name_file_line_and_field(tmp_path, body, line, needle):
    path = write(tmp_path, body)
    with pytest.raises(TraceError) as info:
        load_azure_csv(path)
    message = str(info.value)
    assert f"{path}:{line}:" in message
    assert needle in message


@pytest.mark.parametrize("header", ["", "time,prompt,output\n", "ContextTokens,TIMESTAMP,GeneratedTokens\n"])
def test_load_azure_csv_wrong_header(tmp_path, header):
    path = write(tmp_path, "2023-11-16 18:17:03.97,5,1\n" if header else "", header=header)
    with pytest.raises(TraceError, match=r":1: header must be TIMESTAMP,ContextTokens,GeneratedTokens"):
        load_azure_csv(path)


def test_load_azure_csv_without_rows(tmp_path):
    with pytest.raises(TraceError, match="holds no requests"):
        load_azure_csv(write(tmp_path, ""))


def test_load_azure_csv_bad_limit(tmp_path):
    with pytest.raises(TraceError, match="limit must be"):
        load_azure_csv(write(tmp_path, "2023-11-16 18:17:03.97,5,1\n"), limit=-1)


# -- load_trace -------------------------------------------------------------------------------


def test_load_trace_default():
    assert load_trace("default") == synthetic_default()
    assert load_trace("default", limit=10) == synthetic_default()[:10]


def test_load_trace_path(tmp_path):
    path = write(tmp_path, "2023-11-16 18:17:03.97,5,1\n")
    assert load_trace(str(path)) == [Request(0.0, 5, 1)]


def test_load_trace_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.csv"
    with pytest.raises(TraceError, match="nope.csv"):
        load_trace(str(missing))


def test_load_azure_csv_undecodable_or_badly_quoted(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_bytes(HEADER.encode() + b"2023-11-16 18:17:03.97,5,1\n\xff\xfe,1,1\n")
    with pytest.raises(TraceError, match=rf"{re.escape(str(path))}:3: not UTF-8 text"):
        load_azure_csv(path)
    path.write_bytes(HEADER.encode() + b"2023-11-16 18:17:03.97,1\xff0,1\n" + b"2023-11-16 18:17:04,5,1\n" * 5000)
    with pytest.raises(TraceError, match=rf"{re.escape(str(path))}:2: not UTF-8 text"):
        load_azure_csv(path)
    path.write_bytes(HEADER.encode() + b"2023-11-16 18:17:03.97,5,1\n2023-11-16 18:17:04,\"5\"x,1\n")
    with pytest.raises(TraceError, match=rf"{re.escape(str(path))}:3: not a CSV line"):
        load_azure_csv(path)
