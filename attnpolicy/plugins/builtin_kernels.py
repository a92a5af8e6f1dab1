"""The built-in kernels as a plugin: the hook implementation through which they register,
like any third-party kernel. The kernels themselves (and torch) load when the kernel
registry is first built, not when the plugin manager is: a command that only checks
policy names, or names its cost model, loads neither."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from attnpolicy.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from attnpolicy.plugins.kernels import KernelInfo


@hookimpl
def attnpolicy_register_kernels(register: Callable[[KernelInfo], None]) -> None:
    from attnpolicy.plugins.kernels import register_builtins

    register_builtins(register)
