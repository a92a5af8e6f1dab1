"""The plugin manager: direct registration, clashes, entry-point discovery, the example package."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from importlib.metadata import EntryPoint
from pathlib import Path

import cachetools
import pytest

import attnpolicy.plugins.registry as plugins
from attnpolicy import AttnPolicyConfig, Dispatcher
from attnpolicy.cache.eviction_registry import eviction_registry
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, MaskMode
from attnpolicy.errors import PluginError, PolicyError
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.plugins.registry import get_plugin_manager, reset_plugin_manager
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.registry import make_policy, policy_registry
from attnpolicy.policies.resolve import failed_plugins

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "plugins" / "attnpolicy-length-threshold"
CTX = PolicyContext()


pytestmark = pytest.mark.usefixtures("fresh_plugins")


def policy_class(name, mode=MaskMode.MASK):
    return type(name, (), {
        "name": name,
        "description": f"{name} test policy",
        "decide": lambda self, layout, ctx: Decision(mode, name),
    })


class Registers:
    """A plugin object whose register hook calls ``register(*args)`` for each of ``items``."""

    def __init__(self, *items):
        self.items = items

    @hookimpl
    def attnpolicy_register_policies(self, register):
        for item in self.items:
            register(item)


# -- (a) direct registration -----------------------------------------------------------


def test_directly_registered_plugin_provides_a_policy():
    cls = policy_class("direct", MaskMode.VARLEN)
    get_plugin_manager().register(Registers(cls), name="direct-plugin")
    info = policy_registry()["direct"]
    assert (info.plugin, info.description, info.cls) == ("direct-plugin", "direct test policy", cls)
    assert make_policy("direct").decide(BatchLayout.from_lens([4]), CTX).mode is MaskMode.VARLEN


def test_registry_follows_registration_and_unregistration():
    pm = get_plugin_manager()
    before = policy_registry()
    assert "late" not in before
    pm.register(Registers(policy_class("late")), name="late-plugin")
    assert policy_registry()["late"].plugin == "late-plugin"
    pm.unregister(name="late-plugin")
    assert policy_registry() == before


def test_registry_is_cached_and_copies_are_safe_to_mutate():
    calls = []

    class Counting:
        @hookimpl
        def attnpolicy_register_policies(self, register):
            calls.append(1)
            register(policy_class("counted"))

    get_plugin_manager().register(Counting(), name="counting")
    first = policy_registry()
    first.pop("counted")
    assert "counted" in policy_registry()
    assert len(calls) == 1


# -- (b) clashes and broken register hooks: the bad plugin is rejected alone ------------


def assert_rejected(plugin, words, caplog):
    """``plugin`` is listed as failed (with ``words``), unregistered, warned about once
    in one line; built-ins, the config and a dispatcher stay usable."""
    failed = failed_plugins()
    assert plugin in failed, failed
    for word in words:
        assert word in failed[plugin]
    assert not get_plugin_manager().has_plugin(plugin)
    warned = [r.getMessage() for r in caplog.records if r.name == "attnpolicy.plugins"]
    assert len([m for m in warned if repr(plugin) in m]) == 1 and all("\n" not in m for m in warned)
    assert policy_registry()["dynamic"].plugin == "attnpolicy.policies.builtin"
    assert {"lru", "cost"} <= set(eviction_registry())
    Dispatcher(AttnPolicyConfig(policy="varlen", backend="none"))


def test_plugin_reusing_a_builtin_name_is_rejected_alone(caplog):
    pm = get_plugin_manager()
    pm.register(Registers(policy_class("dynamic"), policy_class("copycat-own")), name="copycat")
    pm.register(Registers(policy_class("fine")), name="fine-plugin")
    assert_rejected("copycat", ["'dynamic'", "'attnpolicy.policies.builtin'", "'copycat'"], caplog)
    registry = policy_registry()
    assert registry["fine"].plugin == "fine-plugin"
    assert "copycat-own" not in registry  # nothing of a rejected plugin is half-applied
    with pytest.raises(PolicyError, match="'copycat-own' is not a registered policy.*rejected plugins: copycat"):
        make_policy("copycat-own")


@pytest.mark.parametrize(
    ("item", "words"),
    [
        (42, ["42", "not a class"]),
        (type("NoName", (), {"description": "d", "decide": lambda self, layout, ctx: None}), ["'name'"]),
        (type("NoDescr", (), {"name": "x", "decide": lambda self, layout, ctx: None}), ["'description'"]),
        (type("NoDecide", (), {"name": "x", "description": "d"}), ["NoDecide", "decide()"]),
    ],
)
def test_bad_policy_class_rejects_the_plugin(item, words, caplog):
    get_plugin_manager().register(Registers(item), name="sloppy")
    assert_rejected("sloppy", ["'sloppy'", *words], caplog)


def test_register_hook_that_raises_rejects_the_plugin(caplog):
    class Exploding:
        @hookimpl
        def attnpolicy_register_policies(self, register):
            raise RuntimeError("kaput")

    get_plugin_manager().register(Exploding(), name="exploding")
    assert_rejected("exploding", ["'exploding'", "RuntimeError: kaput"], caplog)


def test_duplicate_eviction_rejects_the_second_plugin(caplog):
    class Fifo:
        def __init__(self, name):
            self.name = name

        @hookimpl
        def attnpolicy_register_evictions(self, register):
            register(self.name, lambda: cachetools.FIFOCache(maxsize=1))

    pm = get_plugin_manager()
    pm.register(Fifo("fifo-x"), name="one")
    pm.register(Fifo("fifo-x"), name="two")
    assert_rejected("two", ["'fifo-x'", "'one'", "'two'"], caplog)
    assert eviction_registry()["fifo-x"].plugin == "one"


def test_bad_eviction_factory_rejects_the_plugin(caplog):
    class Bad:
        @hookimpl
        def attnpolicy_register_evictions(self, register):
            register("bad", "not callable")

    get_plugin_manager().register(Bad(), name="bad-evictions")
    assert_rejected("bad-evictions", ["'bad-evictions'", "'bad'"], caplog)
    assert "bad" not in eviction_registry()


def test_kernel_hook_that_raises_is_listed_without_building_the_kernel_registry_first(caplog):
    class Exploding:
        @hookimpl
        def attnpolicy_register_kernels(self, register):
            raise RuntimeError("kaput")

    get_plugin_manager().register(Exploding(), name="exploding-kernels")
    assert_rejected("exploding-kernels", ["'exploding-kernels'", "RuntimeError: kaput"], caplog)


def test_builtin_plugin_that_fails_to_import_is_an_error(monkeypatch):
    monkeypatch.setattr(plugins, "BUILTIN_PLUGINS", (*plugins.BUILTIN_PLUGINS, "attnpolicy.no_such_module"))
    reset_plugin_manager()
    with pytest.raises(PluginError, match="built-in plugin 'attnpolicy.no_such_module' failed to load: "
                                          "ModuleNotFoundError"):
        policy_registry()


def test_register_hooks_go_through_pm_hook():
    """pluggy's argument pruning, monitoring and wrappers apply to the register hooks."""
    class NoArgs:  # implements the hook with a subset of its arguments, as pluggy allows
        @hookimpl
        def attnpolicy_register_policies(self):
            return None

    seen = []

    class Wrapper:
        @hookimpl(wrapper=True)
        def attnpolicy_register_policies(self, register):
            seen.append("wrapped")
            return (yield)

    pm = get_plugin_manager()
    pm.register(NoArgs(), name="no-args")
    pm.register(Wrapper(), name="wrapper")
    called = []
    undo = pm.add_hookcall_monitoring(lambda name, impls, kwargs: called.append(name), lambda *a: None)
    try:
        registry = policy_registry()
    finally:
        undo()
    assert "dynamic" in registry and "no-args" not in failed_plugins()
    # one call per implementing plugin: the two built-ins and no-args
    assert called.count("attnpolicy_register_policies") == len(seen) == 3


# -- entry points, in process (fake entry points) --------------------------------------


@pytest.fixture
def fake_entry_points(monkeypatch, tmp_path):
    (tmp_path / "ep_good.py").write_text(textwrap.dedent("""
        from attnpolicy.plugins.hookspecs import hookimpl
        from attnpolicy.core.modes import Decision, MaskMode

        class Good:
            name = "ep-good"
            description = "from an entry point"
            def decide(self, layout, ctx):
                return Decision(MaskMode.MASK, "good")

        @hookimpl
        def attnpolicy_register_policies(register):
            register(Good)
    """))
    (tmp_path / "ep_broken.py").write_text("raise ImportError('missing dependency xyz')\n")
    (tmp_path / "ep_badhook.py").write_text(textwrap.dedent("""
        from attnpolicy.plugins.hookspecs import hookimpl

        @hookimpl
        def attnpolicy_on_decision(layout, decision, policy, unknown_argument):
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [EntryPoint(name, value, "attnpolicy") for name, value in
           [("good", "ep_good"), ("broken", "ep_broken"), ("badhook", "ep_badhook")]]
    monkeypatch.setattr(plugins, "entry_points", lambda group: [e for e in eps if e.group == group])
    monkeypatch.delenv("ATTNPOLICY_LOAD_PLUGINS")
    for module in ("ep_good", "ep_broken", "ep_badhook"):
        monkeypatch.delitem(sys.modules, module, raising=False)


def test_failing_entry_points_warn_are_recorded_and_the_rest_loads(fake_entry_points, caplog):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a one-line log warning, not a UserWarning
        pm = get_plugin_manager()
    messages = "\n".join(r.getMessage() for r in caplog.records if r.name == "attnpolicy.plugins")
    assert "'broken'" in messages and "ImportError: missing dependency xyz" in messages
    assert "'badhook'" in messages and "unknown_argument" in messages
    failed = failed_plugins()
    assert {"broken", "badhook"} <= set(failed)
    assert "ep_broken" in failed["broken"]
    assert not pm.has_plugin("badhook")
    registry = policy_registry()
    assert registry["ep-good"].plugin == "good"
    assert registry["dynamic"].plugin == "attnpolicy.policies.builtin"


@pytest.mark.parametrize(("env", "loaded"), [("", set()), ("good", {"good"}), (" good ,, ", {"good"})])
def test_load_plugins_env_restricts_entry_points(fake_entry_points, monkeypatch, env, loaded):
    monkeypatch.setenv("ATTNPOLICY_LOAD_PLUGINS", env)
    reset_plugin_manager()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pm = get_plugin_manager()
    assert not [w for w in record if "broken" in str(w.message) or "badhook" in str(w.message)]
    assert {n for n in ("good", "broken", "badhook") if pm.has_plugin(n)} == loaded
    assert ("ep-good" in policy_registry()) == ("good" in loaded)
    assert not {"good", "broken", "badhook"} & set(failed_plugins())
    assert "ep_broken" not in sys.modules  # skipped plugins are not even imported


def test_load_plugins_env_warns_about_unknown_names(fake_entry_points, monkeypatch, caplog):
    monkeypatch.setenv("ATTNPOLICY_LOAD_PLUGINS", "good,nope")
    reset_plugin_manager()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a one-line log warning, not a UserWarning
        get_plugin_manager()
    assert [r.getMessage() for r in caplog.records] == [
        "ATTNPOLICY_LOAD_PLUGINS names 'nope' but no 'attnpolicy' entry point has that name"]
    assert policy_registry()["ep-good"].plugin == "good"


# -- (c) entry-point discovery in a subprocess ------------------------------------------

LIST_POLICIES = (
    "import json; from attnpolicy.policies.registry import policy_registry; "
    "from attnpolicy.policies.resolve import failed_plugins; "
    "print(json.dumps({'policies': {n: i.plugin for n, i in policy_registry().items()}, "
    "'failed': sorted(failed_plugins())}))"
)
#: ``attnpolicy`` policy commands run one after the other in one process (one import of torch):
#: argv[1] is a JSON list of argument lists; prints a JSON list of {status, stdout, stderr}.
RUN_CLI = (
    "import argparse, contextlib, io, json, sys; from attnpolicy.cli.policies import register\n"
    "def run(argv):\n"
    "    p = argparse.ArgumentParser(prog='attnpolicy'); register(p.add_subparsers(required=True))\n"
    "    out, err = io.StringIO(), io.StringIO()\n"
    "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
    "        try:\n"
    "            a = p.parse_args(argv)\n"
    "            status = a.func(a)\n"
    "        except SystemExit as exc:\n"
    "            status = exc.code\n"
    "    return {'status': status, 'stdout': out.getvalue(), 'stderr': err.getvalue()}\n"
    "print(json.dumps([run(argv) for argv in json.loads(sys.argv[1])]))"
)


def run_python(code, path, load_plugins=None, args=()):
    env = {k: v for k, v in os.environ.items() if k != "ATTNPOLICY_LOAD_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(path), str(REPO)])
    if load_plugins is not None:
        env["ATTNPOLICY_LOAD_PLUGINS"] = load_plugins
    return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=path,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def demo_distribution(tmp_path):
    (tmp_path / "demo_plugin.py").write_text(textwrap.dedent("""
        from attnpolicy.plugins.hookspecs import hookimpl
        from attnpolicy.core.modes import Decision, MaskMode

        class Demo:
            name = "demo"
            description = "demo policy from an installed distribution"
            def decide(self, layout, ctx):
                return Decision(MaskMode.MASK, "demo")

        @hookimpl
        def attnpolicy_register_policies(register):
            register(Demo)
    """))
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('broken on purpose')\n")
    info = tmp_path / "attnpolicy_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: attnpolicy-demo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[attnpolicy]\ndemo-plugin = demo_plugin\nbroken-plugin = broken_plugin\n")
    return tmp_path


def listed(result):
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_entry_point_plugins_are_discovered(demo_distribution):
    result = run_python(LIST_POLICIES, demo_distribution)
    out = listed(result)
    assert out["policies"]["demo"] == "demo-plugin"
    assert out["policies"]["dynamic"] == "attnpolicy.policies.builtin"
    assert "broken-plugin" in out["failed"]
    assert "'broken-plugin'" in result.stderr and "RuntimeError: broken on purpose" in result.stderr


def test_entry_point_plugins_can_be_disabled(demo_distribution):
    result = run_python(LIST_POLICIES, demo_distribution, load_plugins="")
    out = listed(result)
    assert "demo" not in out["policies"] and "dynamic" in out["policies"]
    assert "broken-plugin" not in result.stderr


def test_entry_point_plugins_can_be_selected(demo_distribution):
    result = run_python(LIST_POLICIES, demo_distribution, load_plugins="demo-plugin")
    out = listed(result)
    assert out["policies"]["demo"] == "demo-plugin"
    assert "broken-plugin" not in out["failed"] and "broken-plugin" not in result.stderr


# -- the example package -------------------------------------------------------------------


@pytest.fixture
def length_threshold_module(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.delitem(sys.modules, "attnpolicy_length_threshold", raising=False)
    import attnpolicy_length_threshold

    get_plugin_manager().register(attnpolicy_length_threshold, name="length-threshold")
    return attnpolicy_length_threshold


@pytest.mark.parametrize(
    ("lens", "kv_lens", "threshold", "mode"),
    [
        ([100, 200], None, 512, MaskMode.MASK),
        ([600], None, 512, MaskMode.CAUSAL),
        ([100, 600], None, 512, MaskMode.VARLEN),
        ([100, 200], None, 150, MaskMode.VARLEN),
        ([16], [600], 512, MaskMode.VARLEN),  # short queries, long context: measured on keys
        ([511], None, 512, MaskMode.MASK),
        ([512], None, 512, MaskMode.CAUSAL),
    ],
)
def test_length_threshold_policy(length_threshold_module, lens, kv_lens, threshold, mode):
    policy = make_policy("length-threshold", threshold=threshold)
    assert policy.decide(BatchLayout.from_lens(lens, kv_lens), CTX).mode is mode
    assert policy_registry()["length-threshold"].plugin == "length-threshold"


def test_the_option_help_example_is_an_option_its_policy_takes(length_threshold_module):
    from attnpolicy.cli import build_parser
    from attnpolicy.cli.common import option

    simulate = next(a for a in build_parser()._actions if a.dest == "command").choices["simulate"]
    text = next(a.help for a in simulate._actions if a.dest == "option")
    policy, key, value = option(re.search(r"e\.g\. (\S+)", text)[1])
    make_policy(policy, **{key: value})  # a policy that takes no such option raises PolicyError


@pytest.mark.parametrize("bad", [0, -1, 2.5, "512", True])
def test_length_threshold_validates_threshold(length_threshold_module, bad):
    with pytest.raises(PolicyError, match="threshold") as info:
        make_policy("length-threshold", threshold=bad)
    assert repr(bad) in str(info.value)


@pytest.mark.slow
def test_example_package_installs_and_is_used(tmp_path):
    src, target = tmp_path / "src", tmp_path / "site"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(src)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    decide = ["decide", "--policy", "length-threshold", "--seq-lens", "100,200", "--json"]
    ran = listed(run_python(RUN_CLI, target, args=[json.dumps([
        ["policies", "--json"], decide, [*decide, "--option", "threshold=150"],
        ["decide", "--policy", "length-threshold", "--seq-lens", "8", "--option", "threshold=0"]])]))
    (listing, default, lower, bad) = ran
    for good in (listing, default, lower):
        assert good["status"] == 0, good["stderr"]
    rows = json.loads(listing["stdout"])
    row = rows[[r["name"] for r in rows].index("length-threshold")]
    assert (row["plugin"], row["options"]) == ("length-threshold", {"threshold": 512})
    assert json.loads(default["stdout"]) == {"policy": "length-threshold", "mode": "mask",
                                             "reason": "longest sequence < 512 tokens", "fell_back": False}
    assert json.loads(lower["stdout"])["mode"] == "varlen"
    assert bad["status"] == 2 and "threshold" in bad["stderr"]
    assert "length-threshold" not in listed(run_python(LIST_POLICIES, target, load_plugins=""))["policies"]


def test_example_plugin_imports_only_the_top_level_package():
    source = (EXAMPLE / "attnpolicy_length_threshold.py").read_text()
    imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert [i for i in imports if "attnpolicy" in i] == [
        "from attnpolicy import BatchLayout, Decision, MaskMode, PolicyContext, hookimpl, is_legal"]


def test_a_gone_plugins_kernel_name_is_free_again(fresh_plugins):
    """A kernel name held by a plugin that is gone (a rebuilt plugin manager) can be
    registered by another plugin with another function; a built-in's name cannot."""
    from attnpolicy.plugins.kernels import KernelInfo, get_kernel

    def kernel_plugin(fn, name="plain"):
        class Plugin:
            @hookimpl
            def attnpolicy_register_kernels(self, register):
                register(KernelInfo(name, "varlen", fn, gqa=False))
        return Plugin()

    def first(q, k, v, causal, mask, scale, partition_len):
        return q

    def second(q, k, v, causal, mask, scale, partition_len):
        return k

    get_plugin_manager().register(kernel_plugin(first), name="first")
    assert get_kernel("varlen", "plain").fn is first
    plugins.reset_plugin_manager()
    get_plugin_manager().register(kernel_plugin(second), name="second")
    assert get_kernel("varlen", "plain").fn is second
    get_plugin_manager().register(kernel_plugin(second, "sdpa"), name="third")
    assert "is registered by two plugins" in failed_plugins()["third"]
    get_plugin_manager().register(kernel_plugin(second, "flex"), name="fourth")  # flex serves MASK alone
    assert "kernel name 'flex' is taken by another implementation" in failed_plugins()["fourth"]
