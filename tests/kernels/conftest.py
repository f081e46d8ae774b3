"""Shared setup for the Triton kernel tests.

Without a GPU the kernels run under Triton's interpreter. Triton reads TRITON_INTERPRET when a
kernel is decorated (module import), not per launch, so the variable is set here: pytest imports
this conftest before any test module of this folder, and the test modules load the kernel files
afresh by path after that. Each test module repeats the assignment so that it also holds when run
on its own.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"


def _load_uninterpreted(name: str) -> ModuleType:
    """A copy of kernels/<name>.py whose kernels are real JITFunctions, even under the interpreter."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        spec = importlib.util.spec_from_file_location(f"_sm90_{name}", KERNELS_DIR / f"{name}.py")
        assert spec is not None and spec.loader is not None, name
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.fixture(scope="session")
def compile_for_sm90(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[str, Any]]:
    """Compile a kernel ahead of time for sm_90 (H100/H200) with Triton's bundled CUDA toolchain.

    The interpreter runs kernels as numpy code and skips the compiler, so type errors in loops,
    tl.dot shape rules and register spills only show up here when no GPU is present. Arguments
    named stride* and all pointers are marked divisible by 16, as Triton's JIT does for aligned
    shapes at run time. Returns {"regs", "stack_bytes", "shared", "ptx"}; kernels make no calls, so
    a non-zero stack means register spills (None when cuobjdump is missing).
    """
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the other tests compile and run the kernels for real")
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import ASTSource
    except ImportError as exc:  # pragma: no cover - depends on the triton build
        pytest.skip(f"triton has no CUDA backend here: {exc}")
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a triton 3.9 warning
    modules: dict[str, ModuleType] = {}
    cubin_dir = tmp_path_factory.mktemp("sm90")

    def compile_kernel(
        module_name: str,
        kernel_name: str,
        pointer_types: dict[str, str],
        constexprs: dict[str, Any],
        float_args: tuple[str, ...] = (),
        num_warps: int = 4,
    ) -> dict[str, Any]:
        if module_name not in modules:
            modules[module_name] = _load_uninterpreted(module_name)
        fn = getattr(modules[module_name], kernel_name)
        signature: dict[str, str] = {}
        for arg in fn.arg_names:
            if arg in pointer_types:
                signature[arg] = pointer_types[arg]
            elif arg in constexprs:
                signature[arg] = "constexpr"
            else:
                signature[arg] = "fp32" if arg in float_args else "i32"
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, arg in enumerate(fn.arg_names)
            if arg in pointer_types or arg.startswith("stride")
        }
        kernel = triton.compile(
            ASTSource(fn, signature, constexprs, attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps},
        )
        result: dict[str, Any] = {"shared": kernel.metadata.shared, "ptx": kernel.asm["ptx"]}
        result["regs"] = result["stack_bytes"] = None
        if cuobjdump.exists():
            cubin = cubin_dir / f"{kernel_name}.cubin"
            cubin.write_bytes(kernel.asm["cubin"])
            usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True)
            match = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
            if match:
                result["regs"], result["stack_bytes"] = int(match.group(1)), int(match.group(2))
        return result

    return compile_kernel
