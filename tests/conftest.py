import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from attnpolicy.plugins.registry import reset_plugin_manager

# the shared helpers (reference, strategies, cost_models, docs_blocks, tiny_models,
# plugin_kernels) live here, the test files in rooms below it (tests/<room>/, after the
# package's sub-packages)
TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))

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


@pytest.fixture(scope="module", autouse=True)
def module_calibration_cache(tmp_path_factory):
    """Every test module has its own empty calibration cache, set before its module
    fixtures run (they may calibrate): never the real home's."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("ATTNPOLICY_CACHE_DIR", str(tmp_path_factory.mktemp("calibration-cache")))
        yield


@pytest.fixture(autouse=True)
def calibration_cache_dir(tmp_path_factory, monkeypatch):
    """Every test has its own empty calibration cache."""
    path = tmp_path_factory.mktemp("calibration-cache")
    monkeypatch.setenv("ATTNPOLICY_CACHE_DIR", str(path))
    return path
