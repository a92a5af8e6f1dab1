"""The whole-model engine: an HF causal LM's forward served as one compiled graph per key.

- :mod:`~attnpolicy.engine.runner`: :class:`~attnpolicy.engine.runner.StaticModelRunner`,
  its graph keys and forwards;
- :mod:`~attnpolicy.engine.model_specs`: the built-in tiny model specs.
"""
