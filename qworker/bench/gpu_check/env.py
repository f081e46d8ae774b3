"""Stage env: versions, the device, and that the engine and the bench import without the worker's
libraries (the GPU machine has only torch, triton, transformers and numpy)."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

from qworker.bench.gpu_check.sizes import Sizes

FORBIDDEN_MODULES = ("pydantic", "redis", "boto3")


def stage_env(sizes: Sizes) -> dict[str, Any]:
    import torch
    import transformers
    import triton

    # The imports themselves are the check: the engine, and the bench modules this script runs.
    import qworker
    import qworker.bench.hf_generate
    import qworker.bench.qworker_engine
    import qworker.engine.llm_engine

    loaded = [m for m in FORBIDDEN_MODULES if m in sys.modules]
    result: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if sizes.device == "cuda" else "cpu (TRITON_INTERPRET=1)",
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "qworker_from": str(Path(qworker.__file__).parent),
        "forbidden_modules_loaded": loaded,
    }
    if sizes.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        result.update(
            total_memory_gib=round(props.total_memory / 2**30, 1),
            num_sms=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
        )
    if loaded:
        result["failures"] = [f"importing the engine and the bench loaded {loaded}"]
    return result
