"""One router per concern; app.py mounts DEFAULT_ROUTERS (issue 23's Files, Batches and jobs add theirs)."""
