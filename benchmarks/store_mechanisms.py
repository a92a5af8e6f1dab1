"""Which of torch's own mechanisms persists and reloads a compiled graph fastest.

Not a test: run it by hand on a machine as quiet as you can get::

    python benchmarks/store_mechanisms.py --json store_mechanisms.json

For every workload and mechanism one process compiles and saves (``cold_s``,
``save_s``, ``bytes``), then a NEW process loads (``load_s``), calls once
(``first_call_s``: for ``megacache`` this includes Dynamo's tracing and the
inductor cache hits) and compares with eager (``max_err``); ``again_s`` is a second
load and call in that process, once torch's lazy imports are paid. Each process gets its
own empty ``TORCHINDUCTOR_CACHE_DIR``, so a load reads only the saved artifact (another
machine); with ``--same-machine`` the loader shares the saver's (a restart on one host).

Workloads: ``attn`` (SDPA, causal, ``[1, 8, 512, 64]`` fp32), ``attn_mask`` (the
same with a boolean ``[1, 1, 512, 512]`` mask), ``model`` (a 4-layer pre-norm
transformer block stack, hidden 256, 4 heads of 64, 128 tokens, random weights).

Mechanisms:

- ``megacache``: ``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``
  (FX graph, AOTAutograd and inductor caches); ``torch.compile`` runs again after
  the load and hits them;
- ``aot_compile``: ``torch.compile(...).aot_compile`` under
  ``torch._dynamo.config.enable_aot_compile`` with guards dropped
  (``torch.compiler.skip_all_guards_unsafe``, as vLLM does: the graph key or the
  caller pins what the guards would check), saved with ``save_compiled_function``
  and loaded with ``torch.compiler.load_compiled_function``; ``aot_compile_eager``
  is the same with the ``aot_eager`` backend;
- ``aoti``: ``torch.export`` + ``torch._inductor.aoti_compile_and_package`` /
  ``aoti_load_package`` (a ``.pt2`` package, weights inside).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from attnpolicy.kernels.accuracy import MaxAbsError

WORKLOADS = ("attn", "attn_mask", "model")
MECHANISMS = ("megacache", "aot_compile", "aot_compile_eager", "aoti")


class Attn(nn.Module):
    """SDPA, causal without a mask, else with it."""

    def forward(self, q: Any, k: Any, v: Any, mask: Any = None) -> Any:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Block(nn.Module):
    """Pre-norm block: RMSNorm, causal SDPA, RMSNorm, SiLU MLP."""

    def __init__(self, hidden: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv, self.o = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: Any) -> Any:
        b, t, h = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.o(a)
        return x + self.down(F.silu(self.up(self.n2(x))))


class Stack(nn.Module):
    """Four blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: Any) -> Any:
        for block in self.blocks:
            x = block(x)
        return x


def _build(workload: str) -> tuple[Any, Any, tuple[Any, ...]]:
    """(module, plain function taking the module first, example inputs), seeded."""
    torch.manual_seed(0)
    if workload in ("attn", "attn_mask"):
        q, k, v = (torch.randn(1, 8, 512, 64) for _ in range(3))
        if workload == "attn":
            return Attn().eval(), Attn.forward, (q, k, v)
        mask = torch.ones(512, 512, dtype=torch.bool).tril()[None, None]
        return Attn().eval(), Attn.forward, (q, k, v, mask)
    return Stack().eval(), Stack.forward, (torch.randn(1, 128, 256),)


def _aot_compiled(fn: Any, backend: str) -> Any:
    with torch._dynamo.config.patch(enable_aot_compile=True):
        return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend,
                             options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})


def _save(workload: str, mechanism: str, path: Path) -> dict[str, Any]:
    module, fn, args = _build(workload)
    t0 = time.perf_counter()
    if mechanism == "megacache":
        compiled = torch.compile(module, fullgraph=True, dynamic=False)
        compiled(*args)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        saved = torch.compiler.save_cache_artifacts()
        assert saved is not None
        path.write_bytes(saved[0])
    elif mechanism in ("aot_compile", "aot_compile_eager"):
        backend = "inductor" if mechanism == "aot_compile" else "aot_eager"
        compiled = _aot_compiled(fn, backend).aot_compile(((module, *args), {}))
        compiled(module, *args)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled.save_compiled_function(str(path))
    else:
        exported = torch.export.export(module, args)
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path))
        torch._inductor.aoti_load_package(str(path))(*args)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
    return {"cold_s": cold, "save_s": time.perf_counter() - t0, "bytes": path.stat().st_size}


def _load_once(mechanism: str, module: Any, args: tuple[Any, ...], path: Path) -> tuple[float, float, Any]:
    """(load seconds, first-call seconds, output) of one load of the artifact at ``path``."""
    torch._dynamo.reset()
    t0 = time.perf_counter()
    if mechanism == "megacache":
        torch.compiler.load_cache_artifacts(path.read_bytes())
        load = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = torch.compile(module, fullgraph=True, dynamic=False)(*args)
    elif mechanism in ("aot_compile", "aot_compile_eager"):
        with path.open("rb") as f:
            loaded = torch.compiler.load_compiled_function(f)
        load = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = loaded(module, *args)
    else:
        runner = torch._inductor.aoti_load_package(str(path))
        load = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = runner(*args)
    return load, time.perf_counter() - t0, got


def _load(workload: str, mechanism: str, path: Path) -> dict[str, Any]:
    """The first load in a new process pays torch's lazy imports; ``again_s`` is a
    second load plus first call in the same process (what each further graph costs)."""
    module, _, args = _build(workload)
    with torch.no_grad():
        want = module(*args)
    load, first, got = _load_once(mechanism, module, args, path)
    again = sum(_load_once(mechanism, module, args, path)[:2])
    err = MaxAbsError()
    err.add(got, want)
    return {"load_s": load, "first_call_s": first, "again_s": again, "max_err": err.value,
            "non_finite": err.non_finite}


def _child(phase: str, workload: str, mechanism: str, path: Path, cache: str) -> dict[str, Any]:
    """Run one phase in a new process with ``cache`` as its inductor cache."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, __file__, "--phase", phase, "--workload", workload,
                          "--mechanism", mechanism, "--path", str(path)],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:160]}
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--mechanisms", default=",".join(MECHANISMS))
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--same-machine", action="store_true",
                   help="the loading process shares the saver's inductor cache (a restart on one host)")
    p.add_argument("--phase", choices=("save", "load"), help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--mechanism", help=argparse.SUPPRESS)
    p.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.phase is not None:
        run = _save if a.phase == "save" else _load
        print(json.dumps(run(a.workload, a.mechanism, a.path)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workload in a.workloads.split(","):
            for mechanism in a.mechanisms.split(","):
                path = Path(tmp) / f"{workload}-{mechanism}.pt2"
                row: dict[str, Any] = {"workload": workload, "mechanism": mechanism}
                caches = [tempfile.mkdtemp(dir=tmp), tempfile.mkdtemp(dir=tmp)]
                row |= _child("save", workload, mechanism, path, caches[0])
                if "error" not in row:
                    row |= _child("load", workload, mechanism, path, caches[0 if a.same_machine else 1])
                rows.append(row)
                print(json.dumps(row), flush=True)
    cols = ("cold_s", "save_s", "bytes", "load_s", "first_call_s", "again_s", "max_err")
    print("\n| workload | mechanism | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    for row in rows:
        cells = [row.get("error", "")] if "error" in row else [
            f"{row[c]:.3g}" if c in row else "-" for c in cols]
        print(f"| {row['workload']} | {row['mechanism']} | " + " | ".join(cells) + " |")
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
