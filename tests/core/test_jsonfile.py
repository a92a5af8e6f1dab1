"""JSON files: every one attnpolicy writes is strict JSON."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import pytest

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.jsonfile import dumps, write_json
from attnpolicy.errors import NonFiniteError
from attnpolicy.graphs.costmodel import CostModel, Fit


@dataclass(frozen=True)
class Row:
    seconds: float


@pytest.mark.parametrize(("data", "where", "value"), [
    ({"rows": [{"total": 1.0}, {"total": math.inf}]}, "rows[1].total", "inf"),
    ({"ratio": math.nan}, "ratio", "nan"),
    ([Row(1.0), Row(-math.inf)], "[1].seconds", "-inf"),
    (math.nan, "the value", "nan"),
])
def test_a_non_finite_number_is_never_written(tmp_path, data, where, value):
    path = tmp_path / "out.json"
    path.write_text('{"before": 1}\n')
    with pytest.raises(NonFiniteError, match=rf"{path}: not written: {re.escape(where)} is {value}, and strict JSON"):
        write_json(path, data)
    assert json.loads(path.read_text()) == {"before": 1}  # the previous file stands
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary left


def test_dumps_writes_models_and_dataclasses_as_their_json():
    assert json.loads(dumps({"row": Row(0.5), "fit": Fit(base=1.0)}, "x")) == {
        "row": {"seconds": 0.5}, "fit": {"base": 1.0, "per_cell": 0.0, "per_token": 0.0}}


def test_a_cost_model_holding_a_non_finite_number_is_not_saved(tmp_path):
    """A model is checked when built or read; one changed in code past its checks is
    still never written as non-strict JSON."""
    model = CostModel.default()
    broken = model.model_copy(update={"warmup_seconds": math.inf})
    with pytest.raises(NonFiniteError, match="warmup_seconds is inf"):
        broken.save(tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()


def test_a_config_holding_a_non_finite_option_is_not_saved(tmp_path):
    """Once written as ``null``, silently: now refused, naming the option."""
    config = AttnPolicyConfig(policy_options={"margin": math.inf})
    with pytest.raises(NonFiniteError, match=r"policy_options.margin is inf"):
        config.save(tmp_path)
    assert not (tmp_path / "attnpolicy_config.json").exists()
