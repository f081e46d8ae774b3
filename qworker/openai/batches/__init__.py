"""The Batch API's run over a pool, shared by `qworker batch --queue` and the gateway's batch driver:
files.py (local and S3 locations), validate.py (the whole-file check), output.py (the resumable
output), progress.py, submitted.py (the rows a batch has enqueued) and pool.py (rows as jobs, results
as bodies)."""
