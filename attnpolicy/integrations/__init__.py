"""Integrations with model runners.

- :mod:`attnpolicy.integrations.vllm`: the ``vllm.general_plugins`` entry point
  (an attention backend for vLLM's CPU platform); importable without vLLM.
- :mod:`attnpolicy.integrations.transformers`: ``attn_implementation="attnpolicy"``
  for HF transformers.
- :mod:`attnpolicy.integrations.runtime`: configuration from the environment and the
  decision log both share.
"""
