"""Buckets: lengths round up to the smallest compiled size that holds them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from attnpolicy.errors import BucketOverflowError, ConfigError, LayoutError
from attnpolicy.graphs.buckets import Buckets


@st.composite
def bounded_buckets(draw) -> tuple[Buckets, int]:
    """A bounded Buckets (pow2, multiple or list) and a max_len it has buckets for."""
    max_len = draw(st.integers(1, 5000))
    kind = draw(st.sampled_from(["pow2", "multiple", "list"]))
    if kind == "pow2":
        return Buckets(min=draw(st.integers(1, 600))), max_len
    if kind == "multiple":
        return Buckets(kind="multiple", multiple=draw(st.integers(1, 600))), max_len
    sizes = draw(st.lists(st.integers(1, 6000), min_size=1, max_size=12, unique=True))
    sizes = sorted({*sizes, draw(st.integers(1, max_len))})  # at least one size <= max_len
    return Buckets(kind="list", sizes=sizes), max_len


@given(bounded_buckets(), st.data())
def test_bucket_is_the_smallest_bucket_that_holds_n(bm, data):
    b, max_len = bm
    sizes = b.sizes_up_to(max_len)
    assert list(sizes) == sorted(set(sizes))
    assert sizes[-1] <= max_len
    n = data.draw(st.integers(1, sizes[-1]))
    got = b.bucket(n, max_len)
    assert got >= n
    assert got in sizes
    assert all(s < n for s in sizes if s < got)


@given(bounded_buckets(), st.data())
def test_bucket_is_monotone(bm, data):
    b, max_len = bm
    top = b.sizes_up_to(max_len)[-1]
    n1, n2 = sorted(data.draw(st.lists(st.integers(1, top), min_size=2, max_size=2)))
    assert b.bucket(n1, max_len) <= b.bucket(n2, max_len)


@given(bounded_buckets(), st.integers(1, 100))
def test_above_the_largest_bucket_overflows(bm, over):
    b, max_len = bm
    top = b.largest(max_len)
    assert top == b.sizes_up_to(max_len)[-1]
    assert b.bucket(top, max_len) == top
    with pytest.raises(BucketOverflowError, match=f"length {top + over} exceeds the largest bucket {top}"):
        b.bucket(top + over, max_len)


@pytest.mark.parametrize("buckets, max_len, expected", [
    (Buckets(), 8192, (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)),
    (Buckets(), 1000, (16, 32, 64, 128, 256, 512, 1000)),
    (Buckets(min=24), 100, (24, 48, 96, 100)),
    (Buckets(min=64), 50, (50,)),
    (Buckets(kind="multiple", multiple=48), 200, (48, 96, 144, 192, 200)),
    (Buckets(kind="multiple", multiple=64), 128, (64, 128)),
    (Buckets(kind="list", sizes=(128, 512, 2048)), 1024, (128, 512)),
])
def test_sizes_up_to(buckets, max_len, expected):
    assert buckets.sizes_up_to(max_len) == expected


def test_examples():
    b = Buckets()
    assert [b.bucket(n, 1000) for n in (1, 16, 17, 511, 512, 513, 1000)] == [16, 16, 32, 512, 512, 1000, 1000]
    m = Buckets(kind="multiple", multiple=100)
    assert [m.bucket(n, 250) for n in (1, 100, 101, 201, 250)] == [100, 100, 200, 250, 250]
    e = Buckets(kind="exact")
    assert [e.bucket(n, 64) for n in (1, 17, 64)] == [1, 17, 64]
    with pytest.raises(BucketOverflowError, match="length 65 exceeds the largest bucket 64"):
        e.bucket(65, 64)


def test_bucket_cache_is_per_max_len():
    b = Buckets()
    assert b.bucket(600, 1000) == 1000
    assert b.bucket(600, 4096) == 1024
    assert b.bucket(600, 1000) == 1000


def test_list_overflow_names_largest_size_not_max_len():
    b = Buckets(kind="list", sizes=(64, 256))
    with pytest.raises(BucketOverflowError, match="length 300 exceeds the largest bucket 256"):
        b.bucket(300, 8192)


def test_length_below_one_is_an_error():
    with pytest.raises(LayoutError, match="n=0"):
        Buckets().bucket(0, 64)


def test_invalid_max_len():
    with pytest.raises(ConfigError, match="max_len must be >= 1, got 0"):
        Buckets().sizes_up_to(0)
    with pytest.raises(ConfigError, match="max_len must be >= 1, got 0"):
        Buckets(kind="multiple", multiple=4).bucket(3, 0)
    with pytest.raises(ConfigError, match=r"no size <= max_len 32"):
        Buckets(kind="list", sizes=(64,)).bucket(3, 32)


@given(st.integers(1, 5000), st.integers(1, 100))
def test_the_largest_exact_bucket_is_max_len(max_len, over):
    b = Buckets(kind="exact")
    assert b.largest(max_len) == b.bucket(max_len, max_len) == max_len
    with pytest.raises(BucketOverflowError):
        b.bucket(max_len + over, max_len)


def test_exact_has_no_finite_size_list():
    with pytest.raises(ConfigError, match="exact.*unbounded"):
        Buckets(kind="exact").sizes_up_to(64)


def test_padding_waste():
    b = Buckets(kind="multiple", multiple=100)
    assert b.padding_waste([100, 50, 50], 1000) == pytest.approx(100 / 200)
    assert b.padding_waste([100, 200], 1000) == 0.0
    assert b.padding_waste([], 1000) == 0.0
    assert Buckets(kind="exact").padding_waste([3, 7, 9], 64) == 0.0


@pytest.mark.parametrize("kwargs, match", [
    ({"sizes": (16, 32)}, "not used by buckets of kind 'pow2': sizes"),
    ({"multiple": 8}, "not used by buckets of kind 'pow2': multiple"),
    ({"kind": "list", "sizes": (16,), "min": 8}, "not used by buckets of kind 'list': min"),
    ({"kind": "exact", "multiple": 8, "sizes": (4,)}, "kind 'exact': multiple, sizes"),
    ({"kind": "multiple"}, "kind 'multiple' need multiple"),
    ({"kind": "list"}, "kind 'list' need sizes"),
    ({"kind": "list", "sizes": ()}, "sizes must not be empty"),
    ({"kind": "list", "sizes": (16, 16)}, "strictly increasing, got 16 then 16"),
    ({"kind": "list", "sizes": (32, 16)}, "strictly increasing, got 32 then 16"),
    ({"kind": "list", "sizes": (0, 16)}, "greater than or equal to 1"),
    ({"min": 0}, "greater than or equal to 1"),
    ({"kind": "multiple", "multiple": 0}, "greater than or equal to 1"),
    ({"kind": "fib"}, "kind"),
    ({"min": "16"}, "valid integer"),
    ({"min": True}, "valid integer"),
    ({"step": 4}, "step"),
])
def test_invalid_buckets(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        Buckets(**kwargs)


def test_serialised_with_own_fields_only():
    assert Buckets().model_dump() == {"kind": "pow2", "min": 16}
    assert Buckets(kind="list", sizes=[8, 64]).model_dump(mode="json") == {"kind": "list", "sizes": [8, 64]}
    assert Buckets(kind="exact").model_dump() == {"kind": "exact"}
    for b in (Buckets(min=32), Buckets(kind="multiple", multiple=7), Buckets(kind="list", sizes=[3, 9])):
        assert Buckets.model_validate_json(b.model_dump_json()) == b


def test_frozen_and_hashable():
    b = Buckets()
    with pytest.raises(ValidationError, match="frozen"):
        b.min = 32
    assert hash(b) == hash(Buckets(min=16))


def test_describe():
    assert Buckets().describe() == "pow2(min=16)"
    assert Buckets(kind="list", sizes=[8, 64]).describe() == "list(sizes=[8, 64])"
    assert Buckets(kind="exact").describe() == "exact()"
