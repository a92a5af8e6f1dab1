"""The cost-model file: one JSON file holding the fits of every graph family.

A family is a level the graphs are compiled at (:data:`FAMILIES`): ``attention``,
one graph per attention call, priced by a
:class:`~attnpolicy.graphs.costmodel.CostModel`, and ``model``, one graph per
whole-model forward, priced by a
:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel`. A file holds the
attention section's fields at its top level (as ``attnpolicy calibrate`` writes them,
so that every attention-only file reads as before) and the whole-model section under
the key ``model`` (``attnpolicy calibrate --model SPEC`` adds or replaces it and keeps
the rest). Either section may be missing; a whole-model file of an earlier attnpolicy
(a ``ModelCostModel``'s fields at the top level) reads as a file of that section only.

:meth:`CostFile.load` is the one reading of a file, for every command that takes one:
each section is validated whole, in pydantic's strict mode (a field missing, of
another type or out of range is an error naming it: see the section classes), and
:meth:`CostFile.attention_fits` and :meth:`CostFile.model_fits` say what a command
needs that the file lacks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, Literal

from attnpolicy.core import jsonfile
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.costmodel import COST_MODEL_VERSION, CostModel
from attnpolicy.modelling.whole_model_costs import ModelCostModel

#: The key of a file's whole-model section.
MODEL_SECTION: Final = "model"
#: The graph families a cost-model file prices.
Family = Literal["attention", "model"]
FAMILIES: tuple[Family, ...] = ("attention", "model")


@dataclass(frozen=True)
class CostFile:
    """The sections of one cost-model file (``None``: not calibrated)."""

    attention: CostModel | None = None
    model: ModelCostModel | None = None

    def attention_fits(self, source: str) -> CostModel:
        """The attention section; :class:`ConfigError` naming ``source`` and what to run when it is missing."""
        if self.attention is None:
            raise ConfigError(f"cost model {source} holds no attention fits (only the whole model's): give "
                              f"--family model, or run attnpolicy calibrate --out {source} to add them")
        return self.attention

    def model_fits(self, source: str, *, steps: bool = False) -> ModelCostModel:
        """The whole-model section (``steps``: with its step-graph fits, which whole
        requests run on); :class:`ConfigError` naming ``source`` and what to run when
        it is missing."""
        if self.model is None:
            raise ConfigError(f"cost model {source} holds no whole-model fits: run attnpolicy calibrate --model "
                              f"SPEC --out {source} to add them")
        if steps:
            self.model.step_fits()
        return self.model

    def with_attention(self, attention: CostModel) -> CostFile:
        return replace(self, attention=attention)

    def with_model(self, model: ModelCostModel) -> CostFile:
        return replace(self, model=model)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = ({"version": COST_MODEL_VERSION} if self.attention is None
                                else self.attention.model_dump(mode="json"))
        if self.model is not None:
            data[MODEL_SECTION] = self.model.model_dump(mode="json")
        return data

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the file as JSON to ``path`` atomically (parents created); returns the path."""
        return jsonfile.write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostFile:
        """Read a cost-model file; a problem raises :class:`ConfigError` naming the file (and each bad field)."""
        path = Path(path)
        return cls.from_json(jsonfile.read_text(path, "cost model"), str(path))

    @classmethod
    def from_json(cls, text: str, source: str) -> CostFile:
        """Parse and validate a cost-model file's JSON; errors are :class:`ConfigError` naming ``source``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if "dims" in data and "mask_build" not in data:  # an earlier attnpolicy's whole-model file
            return cls(model=jsonfile.validate(ModelCostModel, data, source, "model cost model", COST_MODEL_VERSION,
                                               strict=True))
        section = data.get(MODEL_SECTION)
        model = None if section is None else jsonfile.validate(
            ModelCostModel, section, f"{source} (section {MODEL_SECTION})", "model cost model", COST_MODEL_VERSION,
            strict=True)
        rest = {k: v for k, v in data.items() if k not in (MODEL_SECTION, "version")}
        attention = None if not rest else jsonfile.validate(
            CostModel, {k: v for k, v in data.items() if k != MODEL_SECTION}, source, "cost model", COST_MODEL_VERSION,
            strict=True)
        if attention is None and model is None:
            raise ConfigError(f"cost model {source} holds no fits: run attnpolicy calibrate --out {source}")
        return cls(attention, model)

