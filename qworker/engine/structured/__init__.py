"""Structured output: a grammar per request, a token bitmask per step, applied before sampling.

Importing this package imports no grammar backend; llguidance loads with the first constrained
request. See docs/structured_output.md.
"""

from qworker.engine.structured.spec import StructuredOutputError, StructuredOutputs

__all__ = ["StructuredOutputError", "StructuredOutputs"]
