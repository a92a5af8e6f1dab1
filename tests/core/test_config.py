"""AttnPolicyConfig: validation rules, the saved file, the environment and the CLI."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from attnpolicy.cli.config import register
from attnpolicy.config import CONFIG_FILENAME, AttnPolicyConfig
from attnpolicy.core.names import BACKENDS
from attnpolicy.dispatch import Dispatcher
from attnpolicy.errors import BucketOverflowError, ConfigError, PolicyError
from attnpolicy.graphs.buckets import Buckets
from attnpolicy.integrations.environment import from_env
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.plugins.registry import get_plugin_manager
from attnpolicy.policies.resolve import validate_names

pytestmark = pytest.mark.usefixtures("fresh_plugins")


def write(tmp_path, data) -> os.PathLike:
    path = tmp_path / CONFIG_FILENAME
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


# --- fields and rules ------------------------------------------------------------------


def test_defaults_resolve_attn_impl_to_sdpa():
    c = AttnPolicyConfig()
    assert c.attn_impl == "sdpa"
    assert (c.policy, c.eviction, c.backend, c.max_seq_len, c.buckets) == (
        "varlen", "lru", "inductor", 8192, Buckets())


def test_builtin_backends_are_the_registered_builtin_compilers():
    from attnpolicy.plugins.compilers import compiler_registry

    assert {n: c.plugin for n, c in compiler_registry().items()} == dict.fromkeys(
        BACKENDS, "attnpolicy.plugins.builtin_compilers")


def test_partition_len_unlike_max_seq_len_means_flash(caplog):
    with caplog.at_level(logging.INFO, logger="attnpolicy.config"):
        c = AttnPolicyConfig(partition_len=2048, max_seq_len=8192)
    assert c.attn_impl == "flash"
    assert [r.getMessage() for r in caplog.records] == [
        "partition_len=2048 differs from max_seq_len=8192: attn_impl set to 'flash'"]


def test_partition_len_equal_to_max_seq_len_keeps_sdpa(caplog):
    with caplog.at_level(logging.INFO, logger="attnpolicy.config"):
        assert AttnPolicyConfig(partition_len=4096, max_seq_len=4096).attn_impl == "sdpa"
        assert AttnPolicyConfig(attn_impl="flash", partition_len=4096, max_seq_len=4096).attn_impl == "flash"
        assert AttnPolicyConfig(attn_impl="eager").attn_impl == "eager"
    assert caplog.records == []


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_explicit_impl_conflicting_with_partition_len(impl):
    with pytest.raises(ValidationError, match=f"attn_impl '{impl}' conflicts with partition_len 1024"):
        AttnPolicyConfig(attn_impl=impl, partition_len=1024)


def test_flash_rules():
    with pytest.raises(ValidationError, match="attn_impl 'flash' needs partition_len"):
        AttnPolicyConfig(attn_impl="flash")
    with pytest.raises(ValidationError, match="max_seq_len 8192 must be a multiple of partition_len 3000"):
        AttnPolicyConfig(partition_len=3000)
    with pytest.raises(ValidationError, match="partition_len 9000 must be <= max_seq_len 8192"):
        AttnPolicyConfig(partition_len=9000)


@pytest.mark.parametrize("buckets, match", [
    (Buckets(kind="list", sizes=(512, 8192)), "buckets.sizes has bucket 8192 > max_batch_tokens 4096"),
    (Buckets(kind="list", sizes=(3000, 4096)), r"buckets.sizes has no bucket <= max_seq_len 2048: \[3000, 4096\]"),
    (Buckets(min=4096), "buckets.min has bucket 4096 > max_seq_len 2048"),
    (Buckets(kind="multiple", multiple=3000), "buckets.multiple has bucket 3000 > max_seq_len 2048"),
])
def test_buckets_that_do_not_fit(buckets, match):
    with pytest.raises(ValidationError, match=match):
        AttnPolicyConfig(buckets=buckets, max_seq_len=2048, max_batch_tokens=4096)


def test_list_buckets_above_max_seq_len_serve_packed_rows_only():
    c = AttnPolicyConfig(buckets=Buckets(kind="list", sizes=(16, 32, 64, 256)), max_seq_len=64,
                         max_batch_tokens=256)
    assert c.bucket(40) == 64 and c.batch_bucket(120) == 256
    with pytest.raises(BucketOverflowError):
        c.bucket(65)


def test_default_pow2_min_fits_a_short_max_seq_len():
    assert AttnPolicyConfig(max_seq_len=8).bucket(5) == 8


def test_bucket_uses_max_seq_len():
    c = AttnPolicyConfig(max_seq_len=1000)
    assert [c.bucket(n) for n in (1, 17, 600)] == [16, 32, 1000]


def test_unknown_field_is_named():
    with pytest.raises(ValidationError, match="max_graph\n  Extra inputs are not permitted"):
        AttnPolicyConfig(max_graph=4)


def test_building_a_config_imports_neither_torch_nor_plugins():
    """The config is plain data: no torch, no plugin registry, no entry point."""
    code = ("import sys; from attnpolicy import AttnPolicyConfig; AttnPolicyConfig(); "
            "AttnPolicyConfig(backend='no_such_module:backend', backend_options={'x': 1}); "
            "print(' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout.split()
    bad = [m for m in out if m.split(".")[0] in ("torch", "pluggy", "numpy", "attnpolicy_length_threshold")
           or m.startswith(("attnpolicy.plugins", "attnpolicy.policies"))]
    assert "attnpolicy.config" in out and bad == [] and "no_such_module" not in out


KNOWN_POLICIES = "always-causal, always-mask, always-rows, cost-aware, dynamic, varlen"


def test_unknown_policy_is_an_error_where_it_is_resolved():
    config = AttnPolicyConfig(policy="nope", backend="none")  # plain data: no registry yet
    match = f"policy 'nope' is not a registered policy; known policies: {KNOWN_POLICIES}"
    with pytest.raises(PolicyError, match=match):
        Dispatcher(config)
    with pytest.raises(ConfigError, match=match):
        validate_names(config)


def test_unknown_eviction_is_an_error_where_it_is_resolved():
    config = AttnPolicyConfig(eviction="mru", backend="none")
    match = "eviction 'mru'.*known evictions: belady, cost, fifo, lfu, lru"
    with pytest.raises(ConfigError, match=match):
        Dispatcher(config)
    with pytest.raises(ConfigError, match=match):
        validate_names(config)


@pytest.mark.parametrize("backend", ["tvm-ish", "no_such_module:backend"])
def test_unknown_backend_is_one_line_where_it_is_resolved_before_any_work(backend):
    """Not a registered compiler, a Dynamo backend or an importable module:function: one
    line naming the field, the value (and the known names), before the policy is built."""
    built = counted_policy()
    config = AttnPolicyConfig(policy="counted", backend=backend)  # plain data: accepted
    for build in (Dispatcher, validate_names):
        with pytest.raises(ConfigError) as err:
            build(config)
        message = str(err.value)
        assert "\n" not in message and f"backend {backend!r}" in message, message
        if ":" in backend:
            assert "No module named 'no_such_module'" in message
        else:
            assert "known: inductor, aot_eager, eager, none, " in message and "cudagraphs" in message
    assert built == []


@pytest.mark.parametrize("name", ["", "  "])
def test_empty_names_are_rejected_by_the_config(name):
    with pytest.raises(ValidationError, match="policy\n  Value error, must be a registered name"):
        AttnPolicyConfig(policy=name)


def counted_policy() -> list[int]:
    """Registers policy ``counted``, whose builds (their ``depth`` option) the returned list records."""
    built: list[int] = []

    class Counted:
        name = "counted"
        description = "counts its builds"

        def __init__(self, depth: int = 1) -> None:
            built.append(depth)

        def decide(self, layout, ctx):
            raise AssertionError("not called")

    class Plugin:
        @hookimpl
        def attnpolicy_register_policies(self, register):
            register(Counted)

    get_plugin_manager().register(Plugin(), name="counted-plugin")
    return built


def test_the_policy_is_built_once_per_dispatcher():
    built = counted_policy()
    config = AttnPolicyConfig(policy="counted", policy_options={"depth": 3}, backend="none")
    assert built == []
    Dispatcher(config)
    assert built == [3]


def test_belady_is_simulation_only():
    with pytest.raises(ValidationError, match="'belady' is simulation-only: it needs an oracle"):
        AttnPolicyConfig(eviction="belady")


def test_policy_options_are_checked_by_building_the_policy():
    config = AttnPolicyConfig(policy="varlen", policy_options={"depth": 2}, backend="none")
    match = r"policy 'varlen' .*rejected policy_options \{'depth': 2\}"
    with pytest.raises(PolicyError, match=match):
        Dispatcher(config)
    with pytest.raises(ConfigError, match=match):
        validate_names(config)
    with pytest.raises(ValidationError, match="policy_options.x"):
        AttnPolicyConfig(policy_options={"x": {1, 2}})


@pytest.mark.parametrize("field, value", [
    ("max_graphs", 0), ("max_bytes", -1), ("partition_len", 0), ("max_seq_len", 0),
    ("max_graphs", "8"), ("backend", " "), ("on_illegal", "ignore"), ("strict", True), ("version", 2),
])
def test_invalid_values_name_field_and_value(field, value):
    with pytest.raises(ValidationError) as info:
        AttnPolicyConfig(**{field: value})
    (error,) = info.value.errors()
    assert error["loc"] == (field,)
    assert error["input"] == value


def test_frozen():
    c = AttnPolicyConfig()
    with pytest.raises(ValidationError, match="frozen"):
        c.policy = "varlen"
    with pytest.raises(ValidationError, match="frozen"):
        c.max_seq_len = 4


# --- the file --------------------------------------------------------------------------


@st.composite
def configs(draw) -> AttnPolicyConfig:
    max_seq_len = draw(st.sampled_from([256, 1024, 4096]))
    impl = draw(st.sampled_from(["auto", "sdpa", "eager", "flash"]))
    partition_len = None
    if impl == "flash" or (impl == "auto" and draw(st.booleans())):
        partition_len = max_seq_len // draw(st.sampled_from([1, 2, 4, 8]))
    buckets = draw(st.one_of(
        st.builds(Buckets, min=st.integers(1, max_seq_len)),
        st.builds(Buckets, kind=st.just("multiple"), multiple=st.integers(1, max_seq_len)),
        st.lists(st.integers(1, max_seq_len), min_size=1, max_size=6, unique=True)
          .map(lambda s: Buckets(kind="list", sizes=sorted(s))),
        st.just(Buckets(kind="exact")),
    ))

    def lit(name):
        return st.sampled_from(typing.get_args(AttnPolicyConfig.model_fields[name].annotation))

    return AttnPolicyConfig(
        policy=draw(st.sampled_from(["always-mask", "always-causal", "dynamic", "varlen"])),
        buckets=buckets,
        max_graphs=draw(st.none() | st.integers(1, 64)),
        max_bytes=draw(st.none() | st.integers(1, 1 << 40)),
        eviction=draw(st.sampled_from(["lru", "lfu", "fifo", "cost"])),
        backend=draw(st.sampled_from(BACKENDS)),
        backend_options=draw(st.sampled_from([{}, {"config_patches": {"size_asserts": False}}])),
        attn_impl=None if impl == "auto" else impl,
        partition_len=partition_len,
        max_seq_len=max_seq_len,
        **{name: draw(lit(name)) for name in
           ("on_illegal", "fallback_mode", "on_overflow", "on_compile_error", "oversize", "strict")},
    )


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(configs())
def test_save_load_round_trip(tmp_path, config):
    path = config.save(tmp_path / "artefacts")
    assert path == tmp_path / "artefacts" / CONFIG_FILENAME
    assert AttnPolicyConfig.load(path.parent) == config
    assert AttnPolicyConfig.load(path) == config
    assert [p.name for p in path.parent.iterdir()] == [CONFIG_FILENAME]  # no temporary file left


def test_saved_file_holds_every_field_resolved(tmp_path):
    path = AttnPolicyConfig(partition_len=1024).save(tmp_path)
    data = json.loads(path.read_text())
    assert list(data) == list(AttnPolicyConfig.model_fields)
    assert data["attn_impl"] == "flash"
    assert data["buckets"] == {"kind": "pow2", "min": 16}
    assert path.read_text().startswith("{\n  \"version\": 1,")


def test_save_replaces_an_existing_file(tmp_path):
    first = AttnPolicyConfig(policy="dynamic", max_graphs=4)
    second = AttnPolicyConfig(policy="always-mask", max_graphs=8, eviction="fifo")
    first.save(tmp_path)
    assert AttnPolicyConfig.load(tmp_path) == first
    second.save(tmp_path)
    assert AttnPolicyConfig.load(tmp_path) == second != first


def test_save_leaves_no_temporary_file_when_writing_fails(tmp_path, monkeypatch):
    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        AttnPolicyConfig().save(tmp_path)
    assert list(tmp_path.iterdir()) == []


def valid_dict() -> dict:
    return AttnPolicyConfig(policy="varlen").model_dump(mode="json")


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(max_seq_len=0),
     r"max_seq_len: Input should be greater than or equal to 1 \(got 0\)"),
    (lambda d: d.update(eviction="belady"), r"eviction: eviction 'belady' is simulation-only"),
    (lambda d: d.update(colour="red"), r"colour: Extra inputs are not permitted \(got 'red'\)"),
    (lambda d: d.update(version=2), r"unsupported config version 2 \(this attnpolicy reads version 1\)"),
    (lambda d: d["buckets"].update(kind="list"), r"buckets: .*not used by buckets of kind 'list': min"),
    (lambda d: d["buckets"].update(min="16"), r"buckets.min: Input should be a valid integer \(got '16'\)"),
    (lambda d: d.update(attn_impl="eager", partition_len=512),
     r"attn_impl 'eager' conflicts with partition_len"),
    (lambda d: d.update(max_graphs=0, strict="yes"), r"\(2 errors\):\n  - max_graphs: .*\n  - strict: "),
])
def test_invalid_file_names_file_and_field(tmp_path, edit, match):
    data = valid_dict()
    edit(data)
    path = write(tmp_path, data)
    with pytest.raises(ConfigError, match=match) as info:
        AttnPolicyConfig.load(tmp_path)
    assert str(info.value).startswith(f"{path}: ")


@pytest.mark.parametrize("text, match", [
    ('{"policy": "varlen",\n  "max_seq_len": 4096,,\n}', r"invalid JSON at line 2, column 23"),
    ("", r"invalid JSON at line 1, column 1"),
    ("[1, 2]", "expected a JSON object, got list"),
])
def test_corrupt_json(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=match) as info:
        AttnPolicyConfig.load(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=f"config file {tmp_path / CONFIG_FILENAME} not found"):
        AttnPolicyConfig.load(tmp_path)
    with pytest.raises(ConfigError, match="nowhere.json not found"):
        AttnPolicyConfig.load(tmp_path / "nowhere.json")


def test_failed_load_changes_nothing(tmp_path):
    """A load that fails leaves the file as it was (nothing rewritten, migrated or added
    beside it); a save that fails half-way leaves the previous file whole."""
    data = valid_dict()
    data.update(max_graphs=8, max_seq_len=-1)  # one good edit, one bad
    path = write(tmp_path, data)
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="max_seq_len"):
        AttnPolicyConfig.load(tmp_path)
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]
    good = AttnPolicyConfig(policy="dynamic", max_graphs=4)
    good.save(tmp_path)
    saved = path.read_bytes()
    calls = []

    def crash(fd):  # the new text is written, not yet synced: the process dies here
        calls.append(fd)
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", crash)
        with pytest.raises(KeyboardInterrupt):
            AttnPolicyConfig(policy="always-mask", max_graphs=8).save(tmp_path)
    assert calls and path.read_bytes() == saved and AttnPolicyConfig.load(tmp_path) == good
    assert list(tmp_path.iterdir()) == [path]


def test_file_may_leave_fields_out(tmp_path):
    write(tmp_path, {"policy": "varlen", "partition_len": 1024})
    c = AttnPolicyConfig.load(tmp_path)
    assert (c.policy, c.attn_impl, c.max_seq_len) == ("varlen", "flash", 8192)


# --- environment -----------------------------------------------------------------------


def test_from_env_defaults():
    assert from_env({}) == AttnPolicyConfig()


def test_from_env_config_and_policy(tmp_path):
    AttnPolicyConfig(max_graphs=3).save(tmp_path)
    assert from_env({"ATTNPOLICY_CONFIG": str(tmp_path)}) == AttnPolicyConfig(max_graphs=3)
    assert from_env({"ATTNPOLICY_CONFIG": str(tmp_path / CONFIG_FILENAME)}).max_graphs == 3
    both = from_env({"ATTNPOLICY_CONFIG": str(tmp_path), "ATTNPOLICY_POLICY": "varlen"})
    assert (both.policy, both.max_graphs) == ("varlen", 3)
    assert from_env({"ATTNPOLICY_POLICY": "always-mask"}) == AttnPolicyConfig(policy="always-mask")


def test_from_env_reads_os_environ(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNPOLICY_CONFIG", str(tmp_path))
    monkeypatch.delenv("ATTNPOLICY_POLICY", raising=False)
    AttnPolicyConfig(policy="varlen").save(tmp_path)
    assert from_env().policy == "varlen"


def test_env_policy_drops_the_options_of_another_policy(tmp_path, caplog):
    AttnPolicyConfig(policy="cost-aware", policy_options={"x": 1}, max_graphs=3).save(tmp_path)
    env = {"ATTNPOLICY_CONFIG": str(tmp_path), "ATTNPOLICY_POLICY": "varlen"}
    with caplog.at_level(logging.WARNING, logger="attnpolicy.config"):
        config = from_env(env)
    assert (config.policy, config.policy_options, config.max_graphs) == ("varlen", {}, 3)
    assert [r.getMessage() for r in caplog.records] == [
        "ATTNPOLICY_POLICY=varlen replaces policy 'cost-aware': its policy_options {\"x\": 1} are dropped"]
    Dispatcher(config.model_copy(update={"backend": "none"}))  # the options would break varlen


def test_env_policy_equal_to_the_config_keeps_its_options(tmp_path, caplog):
    AttnPolicyConfig(policy="cost-aware", policy_options={"x": 1}).save(tmp_path)
    config = from_env({"ATTNPOLICY_CONFIG": str(tmp_path), "ATTNPOLICY_POLICY": "cost-aware"})
    assert config.policy_options == {"x": 1} and caplog.records == []


def test_from_env_errors_name_the_variable(tmp_path):
    with pytest.raises(ConfigError, match=f"ATTNPOLICY_CONFIG={tmp_path}: config file .* not found"):
        from_env({"ATTNPOLICY_CONFIG": str(tmp_path)})
    with pytest.raises(ConfigError, match="(?s)ATTNPOLICY_POLICY=nope: .*policy 'nope' is not a registered"):
        from_env({"ATTNPOLICY_POLICY": "nope"})


# --- CLI -------------------------------------------------------------------------------


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="attnpolicy")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_show_defaults(capsys):
    assert run_cli(["config", "show"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# defaults"
    rows = dict(line.split(None, 1) for line in out[1:])
    assert rows["policy"] == "varlen"
    assert rows["buckets"] == "pow2(min=16)"
    assert rows["attn_impl"] == "sdpa"
    assert rows["max_graphs"] == "null"
    assert rows["policy_options"] == "{}"


def test_cli_show_json(tmp_path, capsys):
    config = AttnPolicyConfig(policy="varlen", partition_len=2048)
    config.save(tmp_path)
    assert run_cli(["config", "show", str(tmp_path), "--json"]) == 0
    assert AttnPolicyConfig.model_validate_json(capsys.readouterr().out) == config


def test_cli_validate(tmp_path, capsys):
    path = AttnPolicyConfig().save(tmp_path)
    assert run_cli(["config", "validate", str(path)]) == 0
    assert capsys.readouterr().out == f"valid: {path}\n"


@pytest.mark.parametrize("command", ["validate", "show"])
def test_cli_invalid_file(tmp_path, capsys, command):
    write(tmp_path, {"policy": "nope"})
    assert run_cli(["config", command, str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "policy 'nope' is not a registered policy" in captured.err
    assert str(tmp_path) in captured.err


def test_cli_validate_needs_a_path():
    with pytest.raises(SystemExit):
        run_cli(["config", "validate"])


@pytest.mark.parametrize("sizes", [(), (4, 2), (2, 2), (0, 1)])
def test_row_buckets_must_be_positive_and_increasing(sizes: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="row_buckets"):
        AttnPolicyConfig(row_buckets=sizes)


def test_rows_bucket_is_the_first_row_bucket_that_holds_the_sequences() -> None:
    config = AttnPolicyConfig(row_buckets=(1, 4, 32))
    assert [config.rows_bucket(n) for n in (1, 2, 4, 5, 32)] == [1, 4, 4, 32, 32]
    with pytest.raises(ValueError, match="33 sequences exceed the largest of row_buckets"):
        config.rows_bucket(33)
