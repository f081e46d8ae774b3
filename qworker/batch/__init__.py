"""`qworker batch`: OpenAI batch files (`vllm run-batch`'s format) run locally or across the pool.

format.py (the line and body models), rows.py (a row as a request), bodies.py (responses),
files.py (local and S3 locations), validate.py (the whole-file check), output.py (the resumable
output), local.py and pool.py (the two ways to run), progress.py, command.py (the command).
"""
