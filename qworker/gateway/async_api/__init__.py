"""The gateway's stored API: OpenAI's Files and Batches and RunPod-shaped async jobs with webhooks.

Everything it keeps outlives a replica and lives in the result store (records.py) or the file store
(file_store.py): file and batch objects (objects.py), job records (jobs.py), idempotency keys,
leases, webhook attempts. services.py bundles what the routes share and runs the two background
services, the batch driver (batch_driver.py, the pool runner of `qworker.openai.batches`) and the
webhook deliverer (webhooks.py). May import `qworker.openai`, `qworker.jobs`, `qworker.backends`
and the gateway's shared modules (errors, settings, pool); the gateway's generation routes do not
import this package.
"""
