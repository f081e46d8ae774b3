"""Shared setup for the Triton kernel tests.

Without a GPU the kernels run under Triton's interpreter. Triton reads TRITON_INTERPRET when a
function is decorated (its own standard library at `import triton`, our kernels when their module
is imported), not per launch, so the variable is set here: pytest imports this conftest before any
test module of this folder, and the test modules import `qworker_kernels.*` after that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch


def _rewrap_triton_stdlib_for_interpreter() -> None:
    """If triton was imported before TRITON_INTERPRET was set (another test's torch.compile can do
    that), its own @triton.jit helpers (tl.max, tl.sum, tl.cdiv, ...) are compiled-mode objects that
    interpreted kernels cannot call. Rewrap them as the decorator would have under the interpreter."""
    if "triton" not in sys.modules:
        return
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    rewrapped: dict[int, InterpretedFunction] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in rewrapped:
                    rewrapped[id(value)] = InterpretedFunction(value.fn)
                setattr(module, attr, rewrapped[id(value)])


if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    _rewrap_triton_stdlib_for_interpreter()
    # A kernel module imported before this point holds compiled-mode kernels: import it again.
    for _name in [name for name in sys.modules if name.startswith("qworker_kernels.triton_")]:
        del sys.modules[_name]

# Runs in a fresh interpreter: once `import triton` has happened under TRITON_INTERPRET=1, even
# tl.cdiv and tl.max are interpreter functions and the real compiler cannot be used in-process.
_COMPILE_SCRIPT = r"""
import importlib, json, re, subprocess, sys, tempfile, types
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

module_name, specs = sys.argv[1], json.loads(sys.stdin.read())
# The kernel modules import torch only for their launchers and dtype tables; a stub saves the
# ~5 s torch import.
class _TorchStub(types.ModuleType):
    def __getattr__(self, name):
        return name
sys.modules["torch"] = _TorchStub("torch")
module = importlib.import_module(f"qworker_kernels.{module_name}")
cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
results = []
for s in specs:
    fn = getattr(module, s["kernel"])
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in s["pointer_types"]:
            signature[arg] = s["pointer_types"][arg]
        elif arg in s["constexprs"]:
            signature[arg] = "constexpr"
        else:
            signature[arg] = "fp32" if arg in s["float_args"] else "i32"
        # Triton's JIT marks aligned pointers and ints divisible by 16 the same way at run time.
        if arg in s["pointer_types"] or (arg.startswith("stride") and arg not in s["constexprs"]):
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(
        ASTSource(fn, signature, s["constexprs"], attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": s["num_warps"]},
    )
    result = {"shared": kernel.metadata.shared, "ptx_has_mma": "mma" in kernel.asm["ptx"],
              "regs": None, "stack_bytes": None}
    if cuobjdump.exists():
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "kernel.cubin"
            cubin.write_bytes(kernel.asm["cubin"])
            usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True)
        match = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
        if match:
            result["regs"], result["stack_bytes"] = int(match.group(1)), int(match.group(2))
    results.append(result)
print(json.dumps(results))
"""


@pytest.fixture(scope="session")
def compile_for_sm90() -> Callable[[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """Compile kernels ahead of time for sm_90 (H100/H200) with Triton's bundled CUDA toolchain.

    The interpreter runs kernels as numpy code and skips the compiler, so type errors in loops,
    tl.dot shape rules and register spills only show up here when no GPU is present.
    Call it as compile_for_sm90(module_name, [spec, ...]) with each spec a dict of kernel,
    pointer_types ({arg: "*bf16"}), constexprs, and optionally float_args and num_warps; every
    other argument is an i32. Each result holds regs, stack_bytes (kernels make no calls, so
    non-zero means register spills; None without cuobjdump), shared and ptx_has_mma.
    """
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the other tests compile and run the kernels for real")
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the triton build
        pytest.skip(f"triton has no CUDA backend here: {exc}")

    def compile_kernels(module_name: str, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        full_specs = [{"float_args": [], "num_warps": 4, **spec} for spec in specs]
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a triton 3.9 warning
        proc = subprocess.run(
            [sys.executable, "-c", _COMPILE_SCRIPT, module_name],
            input=json.dumps(full_specs),
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
        )
        assert proc.returncode == 0, f"sm_90 compile failed:\n{proc.stderr[-6000:]}"
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return compile_kernels


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """torch's (and the C kernels' OpenMP) thread count for the test, 1 then 2; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
