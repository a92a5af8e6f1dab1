"""A stored graph's identity covers all the code it runs: a change anywhere in it (a
model graph's attention kernel, a plugin kernel's helper or captured value, its
declared version) is a miss, never a stale graph; unchanged code loads."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import types
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from reference import reference_for

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.core.code_identity import module_code, reached, stable_repr
from attnpolicy.dispatch.call_graphs import code_hash_of
from attnpolicy.errors import ConfigError
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.plugins.kernels import KERNEL_KINDS, KernelInfo
from attnpolicy.plugins.registry import get_plugin_manager, reset_plugin_manager

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = (BatchLayout.from_lens([12]), BatchLayout.from_lens([30]))


def _register(name: str, fn: object, version: str = "") -> None:
    """A fresh plugin manager holding one plugin with kernel ``name`` in every kind
    (what a new process that installed the plugin sees)."""
    reset_plugin_manager()

    class Plugin:
        @hookimpl
        def attnpolicy_register_kernels(self, register):
            for kind in KERNEL_KINDS:
                register(KernelInfo(name, kind, fn, version=version))
    get_plugin_manager().register(Plugin(), name=f"{name}-plugin")


def _attend(store: Path, name: str, layouts: tuple[BatchLayout, ...] = LAYOUTS[:1]) -> Dispatcher:
    d = Dispatcher(AttnPolicyConfig(backend="aot_eager", max_seq_len=64, store_dir=str(store),
                                    kernels=dict.fromkeys(KERNEL_KINDS, name)))
    for layout in layouts:
        g = torch.Generator().manual_seed(layout.q_tokens)
        q, k, v = (torch.randn(layout.q_tokens, 2, 16, generator=g) for _ in range(3))
        out = d.attend(q, k, v, layout)
        torch.testing.assert_close(out.double(), reference_for(q, k, v, layout), atol=1e-5, rtol=1e-5)
    return d


def _counts(d: Dispatcher) -> tuple[int, int]:
    """(graphs loaded from the store, graphs compiled)."""
    c = d.stats().cache
    return c.loads, c.compiles


KERNEL = """
import torch
from .helpers import finish


def kernel(q, k, v, causal, mask, scale, partition_len):
    out = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=causal and mask is None, scale=scale,
        enable_gqa=q.shape[0] != k.shape[0])[0]
    return finish(out)


def make(factor):
    def scaled(q, k, v, causal, mask, scale, partition_len):
        return kernel(q, k, v, causal, mask, scale, partition_len) * factor / factor
    return scaled
"""


@pytest.fixture
def plugin_package(tmp_path, monkeypatch, fresh_plugins):
    """``write(helper_body) -> module``: a plugin package on disk, imported anew each
    time (as a new process would import it after the file changed)."""
    name = f"storeplugin_{uuid.uuid4().hex[:8]}"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)

    def write(helper: str):
        package = tmp_path / name
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text(KERNEL)
        (package / "helpers.py").write_text(f"def finish(out):\n    return {helper}\n")
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]
        importlib.invalidate_caches()
        return importlib.import_module(name)
    yield write
    reset_plugin_manager()


def test_a_plugin_kernel_whose_helper_changed_is_not_loaded(tmp_path, plugin_package):
    _register("helped", plugin_package("out").kernel)
    assert _counts(_attend(tmp_path / "store", "helped")) == (0, 1)
    _register("helped", plugin_package("out").kernel)  # the same code, imported again: loaded
    assert _counts(_attend(tmp_path / "store", "helped")) == (1, 0)
    _register("helped", plugin_package("out + 0.0").kernel)  # only the helper changed
    d = _attend(tmp_path / "store", "helped")
    assert _counts(d) == (0, 1) and d.stats().disk.misses == 1  # type: ignore[union-attr]


def test_a_plugin_kernel_whose_captured_value_changed_is_not_loaded(tmp_path, plugin_package):
    module = plugin_package("out")
    _register("closure", module.make(2.0))
    assert _counts(_attend(tmp_path / "store", "closure")) == (0, 1)
    _register("closure", module.make(2.0))  # another closure of equal value: loaded
    assert _counts(_attend(tmp_path / "store", "closure")) == (1, 0)
    _register("closure", module.make(4.0))
    assert _counts(_attend(tmp_path / "store", "closure")) == (0, 1)


def test_a_declared_version_is_part_of_the_identity(plugin_package):
    kernel = plugin_package("out").kernel
    hashes = []
    for version in ("1.0", "1.0", "1.1"):
        _register("versioned", kernel, version)
        hashes.append(code_hash_of("versioned")[0])
    assert hashes[0] == hashes[1] != hashes[2] and None not in hashes


def test_a_kernel_capturing_what_has_no_stable_identity_is_compiled_not_stored(tmp_path, plugin_package):
    _register("tensorful", plugin_package("out").make(torch.tensor(2.0)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = _attend(tmp_path / "store", "tensorful", LAYOUTS)
    said = [str(w.message) for w in caught if "not stored" in str(w.message)]
    assert len(said) == 1 and "'tensorful'" in said[0] and "Tensor" in said[0]
    disk = d.stats().disk
    assert disk is not None and (disk.unidentified, disk.saves, disk.entries) == (2, 0, 0)
    assert _counts(d) == (0, 2)


def test_stable_repr_renders_plain_data_and_refuses_the_rest():
    def make(factor, *, eps=1e-6):
        def f(x, scale=factor):
            return x * scale + eps
        return f
    assert stable_repr({"b": (1, 2.5), "a": [None, True]}) == stable_repr({"a": [None, True], "b": (1, 2.5)})
    assert len({stable_repr(1), stable_repr(True), stable_repr(1.0)}) == 3
    assert stable_repr((torch.float32, torch.device("cpu"), torch.exp)) != stable_repr((torch.float16,))
    assert stable_repr(make(2.0)) == stable_repr(make(2.0)) != stable_repr(make(4.0))
    assert stable_repr(make(2.0)) != stable_repr(make(2.0, eps=0.0))
    for bad in (object(), torch.zeros(2), [[object()]]):
        with pytest.raises(ConfigError, match="no stable identity"):
            stable_repr(bad)
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ConfigError, match="nested too deeply"):
        stable_repr(deep)


def test_a_models_code_reaches_the_modules_its_forward_runs():
    from attnpolicy.engine.model_specs import parse_spec

    model = parse_spec("qwen3:layers=1,hidden=64,heads=2,kv_heads=1,intermediate=128,vocab=64").build()
    found = {m.__name__ for m in reached(sys.modules[type(model).__module__], "transformers")}
    assert {"transformers.modeling_utils", "transformers.modeling_rope_utils", "transformers.activations",
            "transformers.models.qwen3.configuration_qwen3"} <= found
    assert len(module_code(type(model).__module__)) == 16


def test_a_model_without_source_is_compiled_not_stored():
    from attnpolicy.engine.graph_family import model_code

    typed_in = types.ModuleType("typed_in")  # a model class typed into `python -c`: no file
    exec("class Model:\n    pass\n", typed_in.__dict__)
    sys.modules["typed_in"] = typed_in
    try:
        code, why = model_code(typed_in.Model(), "{}", torch.float32, torch.device("cpu"))
    finally:
        del sys.modules["typed_in"]
    assert code is None and "typed_in has no source file" in why


MODEL_CHILD = """
import json, sys, torch
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.model_specs import parse_spec
from attnpolicy.engine.runner import StaticModelRunner, eager_logits

spec = parse_spec("qwen3:layers=1,hidden=64,heads=2,kv_heads=1,intermediate=128,vocab=64")
model, reference = spec.build(), spec.build()
config = AttnPolicyConfig(backend="aot_eager", max_seq_len=64, max_batch_tokens=128, store_dir=sys.argv[1])
runner = StaticModelRunner(model, config)
layout = BatchLayout.from_lens([12])
ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(0))
err = float((runner.run(ids, layout, MaskMode.CAUSAL) - eager_logits(reference, ids, layout)).abs().max())
s = runner.stats()
print(json.dumps({"compiles": s.cache.compiles, "loads": s.cache.loads, "saves": s.disk.saves, "err": err}))
"""

SCALED_SDPA = """

_unscaled_sdpa = _sdpa


def _sdpa(*args, **kwargs):
    return 1.5 * _unscaled_sdpa(*args, **kwargs)


_IMPL_FNS["sdpa"] = _BUILTIN_FNS["sdpa"] = _sdpa
"""


def _model_run(package: Path | None, store: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (package or ROOT, ROOT / "tests"))}
    done = subprocess.run([sys.executable, "-c", MODEL_CHILD, str(store)], env=env, capture_output=True,
                          text=True, timeout=600, check=False, cwd=store.parent)  # no package in the cwd
    assert done.returncode == 0, done.stderr
    data: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return data


@pytest.mark.slow
def test_a_model_graph_is_not_loaded_by_a_package_whose_attention_kernel_differs(tmp_path):
    """Two copies of attnpolicy fill two stores, one with an ``_sdpa`` that scales its
    output by 1.5; this package loads the unchanged copy's graph and compiles the other's."""
    copies = {}
    for name, patch in (("same", ""), ("scaled", SCALED_SDPA)):
        copies[name] = tmp_path / name
        shutil.copytree(ROOT / "attnpolicy", copies[name] / "attnpolicy",
                        ignore=shutil.ignore_patterns("__pycache__"))
        with (copies[name] / "attnpolicy" / "kernels" / "attention.py").open("a") as f:
            f.write(patch)
    same, scaled = (_model_run(copies[n], tmp_path / f"store-{n}") for n in ("same", "scaled"))
    assert same["saves"] == scaled["saves"] == 1
    assert same["err"] < 1e-4 < scaled["err"]  # the scaled copy's graph computes other logits

    from attnpolicy.core.modes import MaskMode
    from attnpolicy.engine.model_specs import parse_spec
    from attnpolicy.engine.runner import StaticModelRunner, eager_logits

    spec = parse_spec("qwen3:layers=1,hidden=64,heads=2,kv_heads=1,intermediate=128,vocab=64")
    layout = BatchLayout.from_lens([12])
    ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(0))
    for name, counts in (("same", (1, 0)), ("scaled", (0, 1))):
        config = AttnPolicyConfig(backend="aot_eager", max_seq_len=64, max_batch_tokens=128,
                                  store_dir=str(tmp_path / f"store-{name}"))
        runner = StaticModelRunner(spec.build(), config)
        got = runner.run(ids, layout, MaskMode.CAUSAL)
        assert (runner.stats().cache.loads, runner.stats().cache.compiles) == counts, name
        assert float((got - eager_logits(spec.build(), ids, layout)).abs().max()) < 1e-4
