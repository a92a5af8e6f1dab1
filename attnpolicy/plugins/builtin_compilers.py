"""The built-in compilers as a plugin: the hook implementation through which they
register, like any third-party compiler, by name (Dynamo's backend of that name is
looked up when a graph first compiles: registering loads no torch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from attnpolicy.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from attnpolicy.plugins.compilers import CompilerInfo


@hookimpl
def attnpolicy_register_compilers(register: Callable[[CompilerInfo], None]) -> None:
    from attnpolicy.plugins.compilers import register_builtin_compilers

    register_builtin_compilers(register)
