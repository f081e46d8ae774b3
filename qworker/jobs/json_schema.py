"""Export the job and result JSON Schemas: `python -m qworker.jobs.json_schema [docs_dir]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from qworker.jobs.job import Job, JobResult
from qworker.jobs.pooling_job import PoolingJob


def schemas() -> dict[str, dict]:
    return {
        "job.schema.json": Job.model_json_schema(),
        # A body with a `task` field (embed, classify, score): docs/pooling.md.
        "pooling_job.schema.json": PoolingJob.model_json_schema(),
        "result.schema.json": JobResult.model_json_schema(),
    }


def render(schema: dict) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main(docs_dir: str = "docs") -> None:
    for name, schema in schemas().items():
        path = Path(docs_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(schema))
        print(f"wrote {path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
