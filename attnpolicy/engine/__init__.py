"""The whole-model engine: an HF causal LM's forward served as one compiled graph per key.

- :mod:`~attnpolicy.engine.graph_family`: the whole-model graph family (keys, the key
  rule, the size estimate, the forwards, the code identity of stored graphs, pad-up);
- :mod:`~attnpolicy.engine.runner`: :class:`~attnpolicy.engine.runner.StaticModelRunner`,
  which serves batches through them on the runtime of :mod:`attnpolicy.dispatch`;
- :mod:`~attnpolicy.engine.model_specs`: the built-in tiny model specs.
"""
