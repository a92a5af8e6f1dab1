"""A test-only policy that always runs ROWS (registered as a plugin policy), so the
whole-model level's ROWS graphs run and are priced through a policy."""

from __future__ import annotations

from collections.abc import Iterator

from attnpolicy.core.modes import Decision, MaskMode
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.plugins.registry import get_plugin_manager, reset_plugin_manager

#: The test policy's name.
ROWS_POLICY = "test-rows"


class TestRows:
    name = ROWS_POLICY
    description = "every batch as ROWS (tests)"

    def decide(self, layout, ctx) -> Decision:
        return Decision(MaskMode.ROWS, "rows")


class _Plugin:
    @hookimpl
    def attnpolicy_register_policies(self, register):
        register(TestRows)


def registered() -> Iterator[str]:
    """Register :data:`ROWS_POLICY` for the duration (a fixture's body), then forget it."""
    reset_plugin_manager()
    get_plugin_manager().register(_Plugin(), name="test-rows-plugin")
    try:
        yield ROWS_POLICY
    finally:
        reset_plugin_manager()
