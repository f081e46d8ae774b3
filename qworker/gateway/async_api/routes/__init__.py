"""The routers of the Files (files.py), Batches (batches.py) and async-jobs (jobs.py) API."""
