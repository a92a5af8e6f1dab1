"""Kernel implementations as plugins: who can compute which call kind, and on what.

A plugin implements ``attnpolicy_register_kernels(register)`` and calls
``register(KernelInfo(...))`` once per (kind, implementation). An implementation
of the ``causal``, ``mask`` or ``varlen`` kind supplies ``fn``, the math of one
call (``fn(q, k, v, causal, mask, scale, partition_len)`` on heads-first
``[H, L, D]`` tensors, as :mod:`attnpolicy.kernels.attention` documents); the
built-in ``flex`` (MASK only) runs FlexAttention with a block mask instead of a
dense one. Each declares its capabilities (the features of
:mod:`attnpolicy.core.features` among them: a sliding window, a soft cap, sinks; a
plugin declares them off unless it says otherwise); :func:`why_unfit` says why an
implementation cannot serve a batch, and the dispatcher never runs one that cannot.
A kernel serving a window gets it inside ``mask`` (in the causal kind too, next
to ``causal=True``); one serving a soft cap or sinks is called with the keywords
``softcap=`` (a float) and ``sinks=`` (``[Hq]`` logits), only when they are set.
Built-ins register through the same hook (:mod:`attnpolicy.plugins.builtin_kernels`),
by name alone (:data:`BUILTIN_KERNELS`): this registry, and every choice of a kernel,
loads no torch, so a planner that only names kernels never does.

A plugin kernel is checked at the framework boundary: every call's output must have
the query's shape, dtype and device (:class:`~attnpolicy.errors.KernelError`
otherwise), and each capability a call needs (GQA, causal or bidirectional, cached
context, the kind's mask, each feature) is verified once per process, when the kernel is first
chosen for it, against a float64 reference on a small probe
(:mod:`attnpolicy.kernels.conformance`); a kernel that fails is rejected with the
case that failed. :func:`check_kernel` runs every declared case at once (what
``attnpolicy kernels check NAME`` runs, and what a plugin's own tests can call).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnpolicy.core.code_identity import callable_code
from attnpolicy.core.features import PLAIN, Features
from attnpolicy.core.modes import CALL_KINDS
from attnpolicy.core.names import IMPLS
from attnpolicy.errors import ConfigError, PluginError

if TYPE_CHECKING:
    import torch

    from attnpolicy.kernels.conformance import ProbeCase

#: The call kinds a kernel serves, by value (the kinds of the kernel registry's keys).
KERNEL_KINDS = tuple(kind.value for kind in CALL_KINDS)
ALL_DTYPES = frozenset({"float32", "bfloat16", "float16", "float64"})
#: The config's kernel choice "fastest fit" (``kernels: {kind: auto}``): no kernel may take the name.
AUTO = "auto"
#: The built-in kernels' names: they register without ``fn`` (the kernels of
#: :mod:`attnpolicy.kernels.attention` and :mod:`attnpolicy.kernels.flex`, loaded with
#: torch when a graph first runs one), and no plugin kernel may take one.
BUILTIN_KERNELS = frozenset((*IMPLS, "flex"))


@dataclass(frozen=True)
class KernelInfo:
    """One implementation of one call kind and what it can serve."""

    name: str
    kind: str
    fn: Callable[..., Any] | None = None  # None only for the built-ins (BUILTIN_KERNELS)
    dtypes: frozenset[str] = ALL_DTYPES
    gqa: bool = True
    causal: bool = True
    bidirectional: bool = True
    context: bool = True
    #: the device types it runs on; ``None``: any device torch runs its ops on (the built-ins)
    devices: frozenset[str] | None = frozenset({"cpu", "cuda"})
    compilable: bool = True
    window: bool = False  # a sliding window (inside the mask)
    softcap: bool = False  # a logit soft cap (the softcap= keyword)
    sinks: bool = False  # per-head sink logits (the sinks= keyword)
    description: str = ""
    #: the kernel's own version: part of its stored graphs' identity beside its package's
    #: source; give one when it runs code of another library (docs/store.md)
    version: str = ""
    plugin: str = field(default="", compare=False)

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The features it serves, e.g. ``("window", "softcap")``."""
        return tuple(f for f in ("window", "softcap", "sinks") if getattr(self, f))


def why_unfit(info: KernelInfo, *, causal: bool, context: bool, dtype: str, gqa: bool, device: str,
              compiled: bool, features: Features = PLAIN) -> str | None:
    """The capability ``info`` lacks for a call (causal or not, with cached context or
    not, a sliding window, ...), or None if it can serve it."""
    if dtype not in info.dtypes:
        return f"dtype {dtype} (supports {', '.join(sorted(info.dtypes))})"
    if gqa and not info.gqa:
        return "GQA (kv heads fewer than q heads)"
    if causal and not info.causal:
        return "causal attention"
    if not causal and not info.bidirectional:
        return "bidirectional attention"
    if context and not info.context:
        return "cached context"
    if info.devices is not None and device.split(":")[0] not in info.devices:
        return f"device {device}"
    if compiled and not info.compilable:
        return "compilation (use backend 'none')"
    if features.window is not None and not info.window:
        return f"a sliding window ({features.window})"
    if features.softcap is not None and not info.softcap:
        return f"a logit soft cap ({features.softcap:g})"
    if features.sinks and not info.sinks:
        return "attention sinks"
    if info.fn is not None:  # a plugin's function (built-ins: the conformance test)
        import torch

        from attnpolicy.kernels.conformance import ProbeCase

        verify(info, ProbeCase(info.kind, causal, context, gqa, getattr(torch, dtype), device.split(":")[0],
                               ProbeCase.probing(features)))
    return None


#: Probe cases already verified, per kernel function (once per process).
_verified: dict[tuple[Callable[..., Any] | None, str, ProbeCase], None] = {}


def _runner(info: KernelInfo, case: ProbeCase) -> Callable[..., Any]:
    """``run(q, k, v, causal, mask, sinks)`` of ``info`` as its kind calls it."""
    from attnpolicy.kernels.attention import bind
    from attnpolicy.kernels.conformance import probe_layout
    from attnpolicy.kernels.flex import build_block_mask, flex_attend, flex_graph

    feats = case.features
    if info.name != "flex":
        return bind(info.name, partition_len=4, softcap=feats.softcap)

    layout = probe_layout(case)

    def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: Any,
             sinks: torch.Tensor | None = None) -> torch.Tensor:
        rows, cols = q.shape[1], k.shape[1]
        block = build_block_mask(layout, rows, cols, str(q.device), feats.window)
        out = flex_attend(flex_graph(None, feats.softcap, feats.sinks), q.transpose(0, 1), k.transpose(0, 1),
                          v.transpose(0, 1), layout, block, rows, cols, sinks, feats.window)
        return out.transpose(0, 1)
    return flex


def verify(info: KernelInfo, case: ProbeCase) -> None:
    """Probe ``info`` for ``case`` once (remembered per kernel function and case);
    raise :class:`~attnpolicy.errors.KernelError` naming the case if it fails."""
    import torch

    from attnpolicy.kernels.conformance import probe

    key = (info.fn, info.name, case)
    if key in _verified:
        return
    with torch.no_grad():
        probe(case, _runner(info, case), info.name, info.plugin)
    _verified[key] = None


def declared_cases(info: KernelInfo) -> list[ProbeCase]:
    """Every probe case ``info`` declares it serves (on CPU when it runs there, else
    its first device): each dtype, causal and/or bidirectional (the causal kind is
    causal only), with and without cached context, with and without GQA; and each
    feature it declares, alone and all together, in its first dtype (every causality
    and context, GQA when it serves it)."""
    import torch

    from attnpolicy.kernels.conformance import PROBE_SOFTCAP, PROBE_WINDOW, ProbeCase

    device = "cpu" if info.devices is None or "cpu" in info.devices else sorted(info.devices)[0]
    causals = [c for c in (True, False) if (info.causal if c else info.bidirectional)]
    if info.kind == "causal":
        causals = [True] if info.causal else []
    contexts = [ctx for ctx in (False, True) if ctx is False or info.context]
    plain = [ProbeCase(info.kind, c, ctx, g, getattr(torch, d), device)
             for d in sorted(info.dtypes) for c in causals for ctx in contexts
             for g in (False, True) if g is False or info.gqa]
    on = {"window": Features(window=PROBE_WINDOW), "softcap": Features(softcap=PROBE_SOFTCAP),
          "sinks": Features(sinks=True)}
    feats = [on[f] for f in info.feature_names]
    if len(feats) > 1:
        feats.append(Features(PROBE_WINDOW if info.window else None, PROBE_SOFTCAP if info.softcap else None,
                              info.sinks))
    dtype = "float32" if "float32" in info.dtypes else sorted(info.dtypes)[0]
    return plain + [ProbeCase(info.kind, c, ctx, info.gqa, getattr(torch, dtype), device, f)
                    for f in feats for c in causals for ctx in contexts]


def check_kernel(name: str) -> list[str]:
    """Verify kernel ``name`` in every kind it is registered for and every case it
    declares (:func:`declared_cases`), against the float64 reference; raise
    :class:`~attnpolicy.errors.KernelError` naming the first case that fails, or
    :class:`~attnpolicy.errors.PluginError` if no kernel has that name. Returns the
    cases checked, described. For a plugin's own tests and ``attnpolicy kernels check``."""
    infos = [info for (_, n), info in kernel_registry().items() if n == name]
    if not infos:
        known = ", ".join(sorted({n for _, n in kernel_registry()}))
        raise PluginError(f"no kernel named {name!r}; registered: {known}")
    checked = []
    for info in infos:
        for case in declared_cases(info):
            verify(info, case)
            checked.append(case.describe())
    return checked


def _kernel_adder(plugin: str, registry: dict[Any, Any],
                  staged: dict[Any, Any]) -> Callable[[KernelInfo], None]:
    def register(info: KernelInfo) -> None:
        if not isinstance(info, KernelInfo):
            raise PluginError(f"plugin {plugin!r} registered {info!r}, not a KernelInfo")
        if info.kind not in KERNEL_KINDS:
            raise PluginError(f"plugin {plugin!r}: kernel {info.name!r} has call kind {info.kind!r}; "
                              f"call kinds: {', '.join(KERNEL_KINDS)}")
        if info.name == AUTO:
            raise PluginError(f"plugin {plugin!r}: kernel name {AUTO!r} is reserved (the config's "
                              "'choose for me'); register the kernel under another name")
        key = (info.kind, info.name)
        holder = registry.get(key) or staged.get(key)
        if holder is not None:
            raise PluginError(f"kernel {info.name!r} of call kind {info.kind!r} is registered by two "
                              f"plugins: {holder.plugin!r} and {plugin!r}")
        if info.fn is None and info.name not in BUILTIN_KERNELS:
            raise PluginError(f"plugin {plugin!r}: kernel {info.name!r} needs fn")
        if not isinstance(info.version, str):
            raise PluginError(f"plugin {plugin!r}: kernel {info.name!r} has version {info.version!r}, not a str")
        others = [i for (_, n), i in (*registry.items(), *staged.items()) if n == info.name]
        if any(i.fn is not info.fn for i in others) or (info.name in BUILTIN_KERNELS and info.fn is not None):
            raise PluginError(f"plugin {plugin!r}: kernel name {info.name!r} is taken by another "
                              "implementation")
        staged[key] = KernelInfo(**{**info.__dict__, "plugin": plugin})
    return register


def _register_impls(registry: dict[tuple[str, str], KernelInfo]) -> None:
    """Make each plugin kernel's ``fn`` callable as ``attention(..., impl=name)`` (the
    kernels, and torch, load with the first plugin kernel: built-ins have no ``fn``)."""
    plugin_fns = {info.name: info for info in registry.values() if info.fn is not None}
    if not plugin_fns:
        return
    from attnpolicy.kernels.attention import _IMPL_FNS, register_impl

    for name, info in plugin_fns.items():
        assert info.fn is not None
        if info.fn is not _IMPL_FNS.get(name):
            register_impl(name, info.fn, info.plugin)


def kernel_registry() -> dict[tuple[str, str], KernelInfo]:
    """Every registered implementation by (kind, name), cached until the plugins
    change. Built like the policy registry: plugin by plugin, a failing third-party
    plugin rejected alone."""
    from attnpolicy.plugins.registry import cached_registry

    return cached_registry("attnpolicy_register_kernels", "kernels", _kernel_adder, _register_impls)


def kernel_code(name: str) -> str:
    """The code identity of plugin kernel ``name`` (what its stored graphs' ``code_hash``
    covers besides attnpolicy's own code): its package's source, that package's installed
    version, what its function captures and the ``version`` it declares
    (:func:`~attnpolicy.core.code_identity.callable_code`). Raises
    :class:`~attnpolicy.errors.ConfigError` naming the kernel when that has no stable identity."""
    from attnpolicy.kernels.attention import _IMPL_FNS

    infos = [info for (_, n), info in kernel_registry().items() if n == name]  # registers their functions
    fn = _IMPL_FNS.get(name)
    if fn is None:
        raise ConfigError(f"kernel {name!r} has no function of its own to hash")
    try:
        code = callable_code(fn)
    except ConfigError as e:
        plugin = f" of plugin {infos[0].plugin!r}" if infos else ""
        raise ConfigError(f"kernel {name!r}{plugin}: {e}") from None
    return repr((code, *sorted({info.version for info in infos})))


def check_kernel_names(kernels: dict[str, str]) -> None:
    """Raise :class:`~attnpolicy.errors.ConfigError` naming the field unless every
    ``kernels`` entry (kind -> name) is ``auto`` or a registered kernel of its kind."""
    known = kernel_registry()
    for kind, name in kernels.items():
        if name != AUTO and (kind, name) not in known:
            names = ", ".join(n for f, n in known if f == kind)
            raise ConfigError(f"kernels: {name!r} is not a registered {kind} kernel; known: auto, {names}")


def impls_for(kind: str) -> list[KernelInfo]:
    """The implementations registered for ``kind``, in registration order."""
    return [info for (fam, _), info in kernel_registry().items() if fam == kind]


def get_kernel(kind: str, name: str) -> KernelInfo:
    """The implementation ``name`` of ``kind``, or :class:`PluginError` naming the known ones."""
    registry = kernel_registry()
    try:
        return registry[(kind, name)]
    except KeyError:
        known = ", ".join(n for f, n in registry if f == kind) or "(none)"
        raise PluginError(f"no kernel {name!r} for the {kind} call kind; registered: {known}") from None


def register_builtins(register: Callable[[KernelInfo], None]) -> None:
    """Register the built-in kernels (what :mod:`attnpolicy.plugins.builtin_kernels`'
    hook implementation calls)."""
    for name in IMPLS:
        for kind in KERNEL_KINDS:
            register(KernelInfo(name, kind, None, devices=None, window=True, softcap=True, sinks=True,
                                description=_BUILTIN_DESCRIPTIONS[name]))
    register(KernelInfo("flex", "mask", None, dtypes=frozenset({"float32", "bfloat16", "float16"}),
                        window=True, softcap=True, sinks=True,
                        description="FlexAttention with a block mask from the layout (block-sparse MASK; "
                                    "windows block-sparse, soft caps as score_mod, sinks from the lse)"))


_BUILTIN_DESCRIPTIONS = {
    "sdpa": "built-in sdpa (torch SDPA; sinks as an extra zero key; a soft cap computes the eager math)",
    "eager": "built-in eager (explicit softmax)",
    "flash": "built-in flash (KV partitions, online softmax; the sink starts the running sum)",
}
