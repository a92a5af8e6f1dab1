"""Third-party-style compilers for tests of the compiler hook and of ``module:function``
backends: a counting wrapper around a real Dynamo backend (``aot_eager``), the way a
runtime wraps its own compiler to see each compile (as vllm-rbln wraps its backend)."""

from __future__ import annotations

from typing import Any

from torch._dynamo import lookup_backend

from attnpolicy.plugins.compilers import CompilerInfo
from attnpolicy.plugins.hookspecs import hookimpl

#: What one graph holds on its device, as the counting compiler declares it.
GRAPH_BYTES = 1 << 20


class Record:
    """What the counting wrapper saw: its compiles, the options they got, and the
    compiled graphs it was asked to release (ids of what it returned)."""

    def __init__(self) -> None:
        self.compiles = 0
        self.options: list[dict[str, Any]] = []
        self.returned: list[int] = []
        self.released: list[int] = []

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


RECORD = Record()


def counting_aot_eager(gm: Any, example_inputs: list[Any], **options: Any) -> Any:
    """A backend with Dynamo's contract: ``aot_eager``'s compile, counted."""
    RECORD.compiles += 1
    RECORD.options.append(options)
    compiled = lookup_backend("aot_eager")(gm, example_inputs)
    RECORD.returned.append(id(compiled))
    return compiled


def release(compiled: Any) -> None:
    RECORD.released.append(id(compiled))


def graph_bytes(compiled: Any) -> int:
    return GRAPH_BYTES


def compiles() -> int:
    return RECORD.compiles


def declared(name: str, *, storable: bool) -> CompilerInfo:
    """The counting compiler, declaring everything a compiler can."""
    return CompilerInfo(name, backend=counting_aot_eager, version="counting 1", release=release,
                        device_bytes=graph_bytes, compiles=compiles, storable=storable,
                        description="aot_eager, counted")


#: What ``plugin_compilers:DECLARED`` names: a compiler declared in full, not registered.
DECLARED = declared("declared", storable=True)


class CompilerPlugin:
    """Registers the counting compiler through the hook: ``counting`` (its graphs stored)
    and ``counting-unstored`` (declared not reloadable)."""

    @hookimpl
    def attnpolicy_register_compilers(self, register: Any) -> None:
        register(declared("counting", storable=True))
        register(declared("counting-unstored", storable=False))
