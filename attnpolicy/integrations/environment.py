"""The config a runtime integration reads from its environment.

- ``ATTNPOLICY_CONFIG``: a config directory or file (unset: defaults);
- ``ATTNPOLICY_POLICY``: a registered policy name that replaces the config's ``policy``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping

from attnpolicy.config import CONFIG_VERSION, AttnPolicyConfig
from attnpolicy.core import jsonfile
from attnpolicy.errors import ConfigError, PolicyError
from attnpolicy.policies.resolve import check_policy_name

CONFIG_ENV = "ATTNPOLICY_CONFIG"
POLICY_ENV = "ATTNPOLICY_POLICY"

logger = logging.getLogger("attnpolicy.config")


def from_env(environ: Mapping[str, str] | None = None) -> AttnPolicyConfig:
    """The config named by the environment (``os.environ`` by default):
    ``ATTNPOLICY_CONFIG`` (a directory or file) if set, else defaults; then
    ``ATTNPOLICY_POLICY``, if set, replaces the policy and must be a registered one.
    When it names another policy than the config's, the config's ``policy_options``
    (meant for that policy) are dropped with one warning naming them. Errors:
    :class:`ConfigError` naming the variable."""
    env = os.environ if environ is None else environ
    path = env.get(CONFIG_ENV)
    config = AttnPolicyConfig()
    if path:
        try:
            config = AttnPolicyConfig.load(path)
        except ConfigError as exc:
            raise ConfigError(f"{CONFIG_ENV}={path}: {exc}") from None
    policy = env.get(POLICY_ENV)
    if policy and policy != config.policy:
        try:
            check_policy_name(policy)
        except PolicyError as exc:
            raise ConfigError(f"{POLICY_ENV}={policy}: {exc}") from None
        if config.policy_options:
            logger.warning("%s=%s replaces policy %r: its policy_options %s are dropped",
                           POLICY_ENV, policy, config.policy, json.dumps(config.policy_options))
        # only the fields the file set stay set: an integration fills the others from its runtime
        config = _validate({**config.model_dump(mode="json", exclude_unset=True), "policy": policy,
                            "policy_options": {}},
                           f"{POLICY_ENV}={policy}")
    return config


def _validate(data: object, source: str) -> AttnPolicyConfig:
    return jsonfile.validate(AttnPolicyConfig, data, source, "config", CONFIG_VERSION)
