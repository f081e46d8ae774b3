"""Which packages qworker installs; everything else is in pyproject.toml.

Discovery, so that a new package (qworker.batch was left out of a hand-written list, and a wheel
without it could not start the `qworker` command) is in every install: every folder under
qworker/ is a package (namespace packages included, so that qworker/bench/workloads, which holds
only data, is one and its files are package data). kernels/ is installed under the import name
qworker_kernels: Hugging Face publishes a package called `kernels` that transformers probes for,
and ours must not shadow it. pyproject.toml's `packages.find` cannot rename a folder, hence this
file.
"""

from setuptools import find_namespace_packages, setup

setup(
    packages=[
        *find_namespace_packages(include=["qworker", "qworker.*"], exclude=["*.__pycache__"]),
        "qworker_kernels",
    ],
    package_dir={"qworker_kernels": "kernels"},
)
