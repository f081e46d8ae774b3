"""qworker's kernels, imported as `qworker_kernels` (the folder is kernels/).

Hugging Face's PyPI package `kernels` is probed by transformers; this package deliberately has
no `__version__` and imports nothing at load, so a probe that finds this folder by its folder name
sees no usable `kernels` package.
"""
