"""Helpers shared by the subcommands: the parser class (one error style), argument
types, the shared argument groups and their checks, output paths, per-policy
options, progress, the one table."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar, cast

from pydantic import ValidationError
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from attnpolicy.bench.settings import BENCH_DTYPES
from attnpolicy.engine.model_specs import max_positions, parse_spec
from attnpolicy.errors import ConfigError
from attnpolicy.modelling.cost_file import FAMILIES, Family
from attnpolicy.workloads.batching import BatchFormer, ScheduledBatch, Workload, model_former
from attnpolicy.workloads.traces import Request

console = Console(stderr=True)
T = TypeVar("T")
#: Bytes are printed in MiB everywhere.


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose every error is one line, ``attnpolicy: error: ...``, exit 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        fail(message)


def fail(message: str, status: int = 2) -> NoReturn:
    """Print ``attnpolicy: error: message`` (one line) on stderr and exit with ``status``
    (2, a mistake on the command line; 1, a failure after the work, as a write)."""
    print(f"attnpolicy: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(status)


def warn(message: str) -> None:
    """Print ``attnpolicy: warning: message`` on stderr."""
    print(f"attnpolicy: warning: {message}", file=sys.stderr)


def command(subparsers: Any, name: str, summary: str, example: str,
            func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """A subcommand with a one-line summary and an example in its epilog."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        name, help=summary, description=summary[0].upper() + summary[1:] + ".",
        epilog=f"example:\n  {example}")
    p.set_defaults(func=func)
    return p


def check_writable(flag: str, path: str | os.PathLike[str] | None, *, directory: bool = False) -> None:
    """Fail (one line, exit 2) unless ``path`` can be written, before any work: an
    existing ``path`` must be a file (a directory when ``directory``), and its nearest
    existing parent a directory this process can create a file in (tried: a probe file
    made and removed, as permission bits do not tell for root or a read-only or
    virtual file system). Nothing is left behind."""
    if path is None:
        return
    shown_path = os.fspath(path)
    target = os.path.abspath(os.path.expanduser(shown_path))
    if os.path.exists(target) and os.path.isdir(target) != directory:
        fail(f"argument {flag}: {shown_path} is {'not ' if directory else ''}a directory")
    parent = target if directory and os.path.isdir(target) else os.path.dirname(target)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        fail(f"argument {flag}: cannot write {shown_path}: {parent} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".attnpolicy-probe.", dir=parent)
    except OSError as exc:
        fail(f"argument {flag}: cannot write {shown_path}: {parent} is not writable ({exc.strerror or exc})")
    os.close(fd)
    os.unlink(probe)


@contextmanager
def writing(flag: str, path: str | os.PathLike[str]) -> Iterator[None]:
    """The writes of ``flag``'s output (checked by :func:`check_writable` before the
    work): one that still fails (a full disk, the folder removed meanwhile) is one
    line naming the flag and the file, exit 1."""
    try:
        yield
    except OSError as exc:
        fail(f"argument {flag}: cannot write {exc.filename or os.fspath(path)}: {exc.strerror or exc}", status=1)


# -- argument types -------------------------------------------------------------------


def _int(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int(text, 1)


def natural_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int(text, 0)


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive integers, e.g. ``128,256``."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def str_list(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated names."""
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return values


def capacity_list(text: str) -> tuple[int | None, ...]:
    """argparse type: graph-cache capacities, e.g. ``2,4,8,inf`` (``inf``: unbounded)."""
    try:
        return tuple(None if part == "inf" else int_list(part)[0] for part in str_list(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers >= 1 or 'inf', got {text!r}") from None


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def byte_list(text: str) -> tuple[int | None, ...]:
    """argparse type: byte sizes, e.g. ``512MiB,1GiB,inf`` (a plain number is bytes;
    units KiB, MiB, GiB; ``inf``: unbounded)."""
    out: list[int | None] = []
    for part in str_list(text):
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]*)", part)
        unit = _UNITS.get(match.group(2).lower()) if match else None
        value = int(float(match.group(1)) * unit) if match and unit else 0
        if part == "inf":
            out.append(None)
        elif value < 1:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated sizes >= 1 byte (e.g. 512MiB, 1GiB, 1048576) or 'inf', got {text!r}")
        else:
            out.append(value)
    return tuple(out)


def model_spec(text: str) -> str:
    """argparse type: a model SPEC (``qwen3``, ``llama:layers=2,...`` or a local HF
    directory), checked whole before any work; the text is kept as given."""
    try:
        parse_spec(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def option(text: str) -> tuple[str, str, Any]:
    """argparse type: ``POLICY:KEY=VALUE`` (VALUE parsed as JSON when it can be)."""
    head, sep, raw = text.partition("=")
    policy, colon, key = head.rpartition(":")
    if not sep or not colon or not policy or not key:
        raise argparse.ArgumentTypeError(f"expected POLICY:KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return policy, key, value


def shown(value: Any) -> str:
    """A default as a user types it: ``2,4,inf`` for a tuple, ``none`` for None."""
    if isinstance(value, (tuple, list)):
        return ",".join("inf" if v is None else str(v) for v in value)
    return "none" if value is None else str(value)


# -- shared argument groups -----------------------------------------------------------


#: The defaults of --heads, --kv-heads, --head-dim and --dtype.
SPEC_DEFAULTS: dict[str, Any] = {"heads": 8, "kv_heads": 8, "head_dim": 64, "dtype": "float32"}


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """The tensor spec of one attention layer: --heads, --kv-heads, --head-dim, --dtype."""
    d = SPEC_DEFAULTS
    p.add_argument("--heads", type=positive_int, default=d["heads"], help=f"query heads (default: {d['heads']})")
    p.add_argument("--kv-heads", type=positive_int, default=d["kv_heads"],
                   help=f"key/value heads; must divide --heads (default: {d['kv_heads']})")
    p.add_argument("--head-dim", type=positive_int, default=d["head_dim"],
                   help=f"channels per head (default: {d['head_dim']})")
    p.add_argument("--dtype", choices=sorted(BENCH_DTYPES), default=d["dtype"],
                   help=f"tensor dtype (default: {d['dtype']})")


def check_positions(flag: str, spec: str, max_model_len: int) -> None:
    """Refuse (exit 2) a --max-seq-len beyond the positions of the model of ``spec``
    (given to ``flag``)."""
    positions = max_positions(spec)
    if positions is not None and max_model_len > positions:
        fail(f"argument --max-seq-len: {max_model_len} is more than the {positions} positions of {flag} {spec}: "
             f"set --max-seq-len {positions} or less")


def check_spec_args(args: argparse.Namespace, *, not_with: str | None = None) -> None:
    """--kv-heads must divide --heads; with ``not_with`` (what the spec comes from
    instead, e.g. ``--model``) a spec flag set off its default is refused."""
    if not_with is not None:
        for name, default in SPEC_DEFAULTS.items():
            if getattr(args, name) != default:
                fail(f"argument --{name.replace('_', '-')}: {getattr(args, name)}: not taken with {not_with}")
        return
    if args.heads % args.kv_heads:
        fail(f"argument --kv-heads: {args.kv_heads} must divide --heads {args.heads}")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """--trace/--limit and the batch former's knobs, defaults :class:`BatchFormer`'s own
    (one workload for simulate, stalls, plan, run and report)."""
    f = BatchFormer()
    p.add_argument("--trace", default="default", metavar="default|PATH",
                   help="'default' (the built-in synthetic trace, 400 requests) or an Azure-format "
                        "CSV (TIMESTAMP,ContextTokens,GeneratedTokens) (default: default)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="first N requests only (default: all)")
    p.add_argument("--max-num-seqs", type=positive_int, default=f.max_num_seqs, metavar="N",
                   help=f"most requests running at once, as vLLM's max_num_seqs (default: {f.max_num_seqs})")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None, metavar="N",
                   help="most query tokens per step, as vLLM's max_num_batched_tokens "
                        f"(default: {f.max_num_batched_tokens}; without chunked prefill, as with "
                        "--no-chunked-prefill and on whole-model graphs, at least --max-seq-len, as vLLM)")
    p.add_argument("--max-seq-len", type=positive_int, default=f.max_model_len, metavar="N",
                   help=f"longest request (prompt + output) admitted, as vLLM's max_model_len "
                        f"(default: {f.max_model_len})")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill each prompt in one step (default: chunked prefill on)")


def add_cost_args(p: argparse.ArgumentParser, *, by_model: bool = False) -> None:
    """--cost-model FILE and --family, the level whose graphs are modelled (``by_model``:
    a command whose --model SPEC chooses the whole-model level)."""
    p.add_argument("--cost-model", metavar="PATH",
                   help="cost-model file from 'attnpolicy calibrate' (its attention fits) and 'attnpolicy calibrate "
                        "--model SPEC' (its whole-model fits) (default: this machine's cached calibration, else the "
                        "built-in one; --family model needs a file)")
    default = "model with --model SPEC, else attention" if by_model else "attention"
    p.add_argument("--family", choices=FAMILIES, default=None,
                   help="the graphs modelled: one per attention call, or one per whole-model forward (prefill-only "
                        f"batches) (default: {default})")


def family_of(args: argparse.Namespace, *, by_model: bool = False) -> Family:
    """The --family of ``args`` (``by_model``: ``model`` when --model SPEC is given and
    --family is not); ``--family model`` needs --model SPEC where ``by_model``."""
    if not by_model:
        return cast(Family, args.family or "attention")
    if args.family is None:
        return "model" if args.model is not None else "attention"
    if (args.family == "model") != (args.model is not None):
        fail(f"argument --family: {args.family}: " + ("needs --model SPEC" if args.model is None
                                                      else "not taken with --model SPEC (the whole-model level)"))
    return cast(Family, args.family)


def by_family(args: argparse.Namespace, choices: Mapping[Family, T], *, by_model: bool = False) -> T:
    """What ``choices`` holds for the --family of ``args`` (:func:`family_of`): the one
    place a command picks what differs between the levels."""
    return choices[family_of(args, by_model=by_model)]


def not_taken(args: argparse.Namespace, why: str, *names: str) -> None:
    """Refuse (exit 2) each flag of ``names`` (``args`` attributes) that is set: not taken ``why``."""
    for name in names:
        if getattr(args, name, None):
            fail(f"argument --{name.replace('_', '-')}: not taken {why}")


def add_policies_arg(p: argparse.ArgumentParser, policies: tuple[str, ...]) -> None:
    p.add_argument("--policies", type=str_list, default=policies, metavar="P[,P...]",
                   help=f"registered policies, see 'attnpolicy policies' (default: {shown(policies)})")


def add_capacities_arg(p: argparse.ArgumentParser, capacities: tuple[int | None, ...]) -> None:
    p.add_argument("--capacities", type=capacity_list, default=capacities, metavar="K[,K...]",
                   help=f"graph-cache capacities (max_graphs); 'inf' for unbounded (default: {shown(capacities)})")


def add_option_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--option", action="append", type=option, default=[], metavar="POLICY:KEY=VALUE",
                   help="an option of one policy, e.g. length-threshold:threshold=256 (repeatable; VALUE is "
                        "parsed as JSON when it can be) (default: none)")


#: BatchFormer argument → the flag that sets it.
FORMER_FLAGS = {"max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
                "max_model_len": "--max-seq-len"}


def former_options(args: argparse.Namespace, *, prefill_only: bool = False) -> dict[str, Any]:
    """The batch former's knobs of the workload flags. ``--max-num-batched-tokens``
    defaults as vLLM's: 2048, and without chunked prefill (``--no-chunked-prefill``,
    or ``prefill_only``: the whole-model-graph workload, each prompt in one step) at
    least ``--max-seq-len``, so that every admitted prompt fits one step."""
    chunked = not (args.no_chunked_prefill or prefill_only)
    tokens = args.max_num_batched_tokens
    if tokens is None:
        default = BatchFormer().max_num_batched_tokens
        tokens = default if chunked else max(default, args.max_seq_len)
    return {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": tokens,
            "max_model_len": args.max_seq_len, "chunked_prefill": chunked}


def former_from(args: argparse.Namespace, *, prefill_only: bool = False) -> BatchFormer:
    """The batch former of the workload flags (``prefill_only``: the whole-model-graph
    workload, see :func:`~attnpolicy.workloads.batching.model_former`); an error
    names the flags."""
    o = former_options(args, prefill_only=prefill_only)
    try:
        if prefill_only:
            return model_former(o["max_num_seqs"], o["max_num_batched_tokens"], o["max_model_len"])
        return BatchFormer(**o)
    except ConfigError as exc:
        message = str(exc).replace(
            "without chunked_prefill (a whole prompt must fit one step)",
            "on whole-model graphs (each prompt runs in one step)" if prefill_only
            else "with --no-chunked-prefill (a whole prompt must fit one step)")
        for name, flag in FORMER_FLAGS.items():
            message = message.replace(name, flag)
        fail(f"argument {message.split('=')[0].split()[0]}: {message}")


def source_name(args: argparse.Namespace) -> str:
    """The workload's name: ``--trace``, and ``--limit`` when given."""
    limit = f" (first {args.limit} requests)" if args.limit else ""
    return f"{args.trace}{limit}"


def formed(args: argparse.Namespace, former: BatchFormer,
           requests: Sequence[Request]) -> tuple[list[ScheduledBatch], Workload]:
    """The batches of ``requests``; prints the workload (stdout, one line: requests,
    rejected, batches, the former's knobs) and, when requests are rejected, one warning
    line saying how many and why."""
    steps = list(former.steps(requests))
    w = Workload.of(len(requests), former, len(steps))
    print(f"workload: {source_name(args)}: {w.describe()}")
    if w.why_rejected:
        warn(f"{w.why_rejected}: left out of every figure (raise --max-seq-len to admit them)")
    return steps, w


def policy_options(args: argparse.Namespace, flag: str, policies: Sequence[str],
                   base: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Per-policy options from ``--option`` (over ``base``), each checked by building
    the policy; errors name the flag and the value."""
    from attnpolicy.errors import PolicyError
    from attnpolicy.policies.registry import make_policy

    check_policies(flag, policies)
    out: dict[str, dict[str, Any]] = {p: dict((base or {}).get(p, {})) for p in policies}
    for policy, key, value in args.option:
        if policy not in out:
            fail(f"argument --option: {policy}:{key}={json.dumps(value)} names policy {policy!r}, "
                 f"which is not run (policies: {', '.join(policies)})")
        out[policy][key] = value
    for name, opts in out.items():
        try:
            make_policy(name, **opts)
        except PolicyError as exc:
            fail(f"argument --option: {exc}")
    return out


def check_policies(flag: str, names: Sequence[str]) -> None:
    """Refuse (exit 2, naming ``flag``) a name that is not a registered policy."""
    from attnpolicy.policies.registry import policy_registry

    known = policy_registry()
    for name in names:
        if name not in known:
            fail(f"argument {flag}: {name!r} is not a registered policy; known policies: {', '.join(sorted(known))}")


def check_evictions(flag: str, names: Sequence[str], simulation: bool) -> None:
    from attnpolicy.cache.eviction_registry import eviction_registry

    known = set(eviction_registry()) - (set() if simulation else {"belady"})
    for name in names:
        if name not in known:
            extra = " ('belady' is simulation-only)" if name == "belady" else ""
            fail(f"argument {flag}: {name!r} is not a registered eviction strategy{extra}; "
                 f"known evictions: {', '.join(sorted(known))}")


def settings(cls: Callable[..., T], flags: Mapping[str, str], **values: Any) -> T:
    """``cls(**values)``; a validation error names the flag (``flags[field]``) and the value."""
    try:
        return cls(**values)
    except ValidationError as exc:
        e = exc.errors(include_url=False)[0]
        msg = e["msg"].removeprefix("Value error, ")
        if e["loc"]:
            field = str(e["loc"][0])
            got = "" if ", got " in msg else f", got {shown(e['input'])}"  # the message may say it already
            fail(f"argument {flags.get(field, '--' + field.replace('_', '-'))}: {msg}{got}")
        # a rule between fields: name each field by its flag
        named = re.sub(r"\b[a-z]+(?:_[a-z]+)*\b",
                       lambda m: flags.get(m[0], "--" + m[0].replace("_", "-")) if m[0] in values else m[0], msg)
        flag = re.search(r"--[a-z-]+", named)
        fail(f"argument {flag[0] if flag else ''}: {named}")


def describe_options(options: Mapping[str, Mapping[str, Any]]) -> str:
    """``length-threshold threshold=256; x k=1`` for the policies that have options, else ``""``."""
    return "; ".join(f"{p} " + " ".join(f"{k}={json.dumps(v)}" for k, v in o.items())
                     for p, o in options.items() if o)


# -- output ------------------------------------------------------------------------------


@contextmanager
def progress(total: int | None, what: str) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr (``total`` None: steps counted, no end known); yields ``advance(label)``."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task(what, total=total)

        def advance(label: str) -> None:
            bar.update(task, advance=1, description=f"{what}: {label}")
        yield advance


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                caption: str | None = None) -> None:
    """The one table style of the CLI (stdout): floats to 4 significant digits."""
    table = Table(title=title, caption=caption)
    for i, col in enumerate(columns):
        numeric = all(isinstance(row[i], (int, float)) or row[i] is None for row in rows)
        table.add_column(col, justify="right" if numeric else "left")
    for row in rows:
        table.add_row(*("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in row))
    out = Console()
    if not out.is_terminal:  # piped: do not squeeze columns into 80 characters
        out = Console(width=200)
    out.print(table)
