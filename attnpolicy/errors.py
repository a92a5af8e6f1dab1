"""Exceptions. Every message names the offending field (or plugin, or key) and its value."""

from __future__ import annotations


class AttnPolicyError(Exception):
    """Base class of every error attnpolicy raises on purpose."""


class LayoutError(AttnPolicyError, ValueError):
    """A BatchLayout, or tensors checked against one, are inconsistent."""


class IllegalModeError(AttnPolicyError, ValueError):
    """A mask mode was asked for on a layout where it would compute the wrong result."""


class PolicyError(AttnPolicyError):
    """A policy (built-in or plugin) failed, returned garbage, or chose an illegal mode."""


class PluginError(AttnPolicyError):
    """A plugin could not be registered (import failure, clash of names)."""


class GraphCompileError(AttnPolicyError):
    """Building (compiling) the graph for a key failed; nothing was cached."""


class GraphTooLargeError(AttnPolicyError, ValueError):
    """A single graph is larger than the cache's whole byte budget."""


class BucketOverflowError(AttnPolicyError, ValueError):
    """A length exceeds the largest compiled bucket."""


class StrictModeError(AttnPolicyError):
    """A graph was compiled after warm-up while strict mode is 'raise'."""


class ConfigError(AttnPolicyError, ValueError):
    """A configuration value or file is invalid, missing or corrupt."""


class AllocationError(AttnPolicyError, MemoryError):
    """A buffer the work needs cannot be allocated; the message names what it holds and
    its bytes."""


class NonFiniteError(AttnPolicyError, ValueError):
    """A number to write as JSON is NaN or infinite, which strict JSON cannot hold."""


class KernelError(AttnPolicyError):
    """A kernel returned an output of the wrong shape, dtype or device, or failed the
    verification of a capability it declares; the message names kernel, plugin and case."""
