import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from attnpolicy.plugins.registry import reset_plugin_manager

sys.path.insert(0, str(Path(__file__).parent))

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("default")


@pytest.fixture
def fresh_plugins(monkeypatch):
    """A plugin manager rebuilt from scratch, loading no installed entry-point plugin."""
    monkeypatch.setenv("ATTNPOLICY_LOAD_PLUGINS", "")
    reset_plugin_manager()
    yield
    reset_plugin_manager()
