"""The wire between producers and workers: the job JSON (job.py), the stored result (result.py),
their JSON Schemas (json_schema.py), and `Client` (client.py), the producer and result reader that
the gateway, `qworker batch`, `qworker submit` and services use.

job.py and result.py import pydantic and the engine's torch-free `sampling_params`/`outputs` only.
client.py sits on top of the package: it opens queues and stores through `qworker.backends`, which
imports job.py and result.py. Nothing here imports `qworker.worker`, the gateway or torch.
"""
