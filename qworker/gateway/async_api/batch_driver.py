"""Runs batches created through POST /v1/batches on the pool, with the code `qworker batch --queue`
uses (validate.check_input, rows.prepare_rows, pool.PoolRunner): job ids come from the batch id
and each custom_id, and the record of sent rows is in the result store (openai/batches/submitted.py), so a
row is never enqueued twice, whichever replica drives the batch and however often it restarts.

Every replica runs one scanner thread. It looks at the store's set of active batches, takes a
lease on one it is not driving (leases.py), and drives it in a thread of its own while extending
the lease. A killed replica's lease expires and another replica (or its restart) carries the
batch on: output and error lines reach the file store in parts as rows finish (output_parts.py),
so the next driver skips every row in a stored part and collects the few that were finished but
only buffered from the result store. At the end the parts are joined into the output and error
files that the batch object names, and the batch completes.

A batch whose driver keeps failing (an exception, or a replica killed while driving it) is
started at most --max-batch-attempts times; then it ends `failed`, with the last error in its
`errors`, instead of being retried forever. A driver that stops cleanly (its replica shuts down,
or its lease moved to another replica) does not count.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from qworker.gateway.async_api.file_store import FileStore
from qworker.gateway.async_api.leases import Leases
from qworker.gateway.async_api.objects import (
    BATCH_KIND,
    BATCH_OPTIONS_KIND,
    FILE_KIND,
    BatchStatus,
    file_object,
    is_terminal,
    new_id,
    set_status,
)
from qworker.gateway.async_api.output_parts import OutputParts
from qworker.gateway.async_api.records import Records
from qworker.gateway.settings import GatewaySettings
from qworker.jobs.client import Client
from qworker.openai.batches.files import BatchLocationError, iter_rows
from qworker.openai.batches.invariance import INVARIANCE_WARNING_KEY, invariance_warning
from qworker.openai.batches.output import BatchOutput
from qworker.openai.batches.pool import DEFAULT_POOL_MAX_TOKENS, PoolRunner
from qworker.openai.batches.progress import BatchSummary, Progress, ProgressMode
from qworker.openai.batches.submitted import open_submitted
from qworker.openai.batches.validate import BatchFileError, check_input
from qworker.openai.pooling_rows import prepare_batch_rows
from qworker.pool.batch_board import BatchBoard

logger = logging.getLogger(__name__)

SCAN_INTERVAL_S = 0.5
# How often a driven batch extends its lease, checks for cancel and expiry, and stores its counts.
CHECK_INTERVAL_S = 0.5
# OpenAI's batch errors list at most this many entries.
MAX_ERRORS = 1000


def cancel_flag_key(records: Records, batch_id: str) -> str:
    return records.key("cancel", BATCH_KIND, batch_id)


def attempts_key(records: Records, batch_id: str) -> str:
    """Drivers started on the batch that did not end cleanly (a hash: count, last error)."""
    return records.key("attempts", BATCH_KIND, batch_id)


class _Stop(Exception):
    """The lease went to another replica: drop the batch without touching its record."""


class BatchDriver:
    def __init__(
        self,
        settings: GatewaySettings,
        client: Client,
        records: Records,
        files: FileStore,
        leases: Leases,
        work_dir: Path,
    ) -> None:
        self.settings = settings
        self.client = client
        self.records = records
        self.files = files
        self.leases = leases
        self.work_dir = work_dir
        self._driving: dict[str, threading.Thread] = {}
        self._closing = threading.Event()
        self._scanner: threading.Thread | None = None
        # The dashboard's record of each batch driven here (qworker/pool/batch_board.py).
        self._boards: dict[str, BatchBoard] = {}

    def start(self) -> None:
        self._scanner = threading.Thread(target=self._scan_loop, name="batch-scanner", daemon=True)
        self._scanner.start()

    def close(self) -> None:
        self._closing.set()
        if self._scanner is not None:
            self._scanner.join(timeout=5)
        for thread in list(self._driving.values()):
            thread.join(timeout=5)

    def _scan_loop(self) -> None:
        while not self._closing.wait(SCAN_INTERVAL_S):
            try:
                self._scan_once()
            except Exception:
                logger.exception("scanning for batches failed; retrying")

    def _scan_once(self) -> None:
        for batch_id, thread in list(self._driving.items()):
            if not thread.is_alive():
                del self._driving[batch_id]
        for batch_id in self.records.active_ids(BATCH_KIND):
            if len(self._driving) >= self.settings.max_driven_batches:
                return
            if batch_id in self._driving or not self.leases.take(BATCH_KIND, batch_id):
                continue
            thread = threading.Thread(
                target=self._drive, args=(batch_id,), name=f"batch-{batch_id[-8:]}", daemon=True
            )
            self._driving[batch_id] = thread
            thread.start()

    # -- one batch --

    def _load(self, batch_id: str) -> tuple[dict[str, Any], str] | None:
        record = self.records.get(BATCH_KIND, batch_id)
        if record is None:
            return None
        return record["batch"], record["owner"]

    def _save(self, batch: dict[str, Any], owner: str) -> None:
        self.records.put(BATCH_KIND, batch["id"], {"owner": owner, "batch": batch})
        self._sync_board(batch)

    def _board(self, batch: dict[str, Any]) -> BatchBoard:
        board = self._boards.get(batch["id"])
        if board is None:
            prefix = self.records.prefix.removesuffix(":gw")
            board = BatchBoard.open(self.records.redis, prefix, batch["id"], source="api")
            board.state["created_at"] = batch.get("created_at") or board.state["created_at"]
            self._boards[batch["id"]] = board
        return board

    def _sync_board(self, batch: dict[str, Any]) -> None:
        """The batch object's status and counts on its board (a failure only logs: the board is
        for operators, the batch object is what clients read)."""
        try:
            board = self._board(batch)
            counts = batch["request_counts"]
            board.set_counts(
                total=counts["total"] or None, completed=counts["completed"], failed=counts["failed"]
            )
            board.set_status(batch["status"], endpoint=batch.get("endpoint"))
            if is_terminal(batch):
                self._boards.pop(batch["id"], None)
        except Exception:
            logger.warning("batch %s: could not update its dashboard record", batch.get("id"), exc_info=True)

    def _drive(self, batch_id: str) -> None:
        with self.leases.held(BATCH_KIND, batch_id) as lost:
            key = attempts_key(self.records, batch_id)
            # Counted when it starts, so that a replica killed while driving counts too.
            attempt = int(self.records.redis.hincrby(key, "count", 1))
            self.records.redis.expire(key, self.records.ttl_s)
            if attempt > self.settings.max_batch_attempts:
                last = self.records.redis.hget(key, "last_error")
                self._fail_attempts(batch_id, attempt - 1, last.decode() if last else None)
                return
            try:
                self._drive_held(batch_id, lost)
            except _Stop:
                self.records.redis.hincrby(key, "count", -1)  # a clean stop is no failed attempt
                logger.info("batch %s: lease lost or shutting down; it is carried on", batch_id)
            except BatchLocationError as exc:
                # The input file is gone (deleted, or its store lost it): nothing can run it.
                self._fail_unreadable(batch_id, str(exc))
            except Exception as exc:
                self.records.redis.hset(key, "last_error", f"{type(exc).__name__}: {exc}"[:2000])
                logger.exception(
                    "batch %s: driving failed (attempt %d of %d)",
                    batch_id,
                    attempt,
                    self.settings.max_batch_attempts,
                )

    def _drive_held(self, batch_id: str, lost: threading.Event) -> None:
        loaded = self._load(batch_id)
        if loaded is None or is_terminal(loaded[0]):
            self.records.deactivate(BATCH_KIND, batch_id)
            return
        batch, owner = loaded
        logger.info("batch %s: driving it (%s)", batch_id, batch["status"])
        if batch["status"] == BatchStatus.CANCELLING.value and batch["in_progress_at"] is None:
            self._finish(batch, owner, BatchStatus.CANCELLED)  # cancelled before it was validated
            return
        if batch["status"] == BatchStatus.VALIDATING.value and not self._validate(batch, owner):
            return
        if lost.is_set():
            raise _Stop()
        self._run(batch, owner, lost)

    def _fail_attempts(self, batch_id: str, num_attempts: int, last_error: str | None) -> None:
        loaded = self._load(batch_id)
        if loaded is None or is_terminal(loaded[0]):
            self.records.deactivate(BATCH_KIND, batch_id)
            return
        batch, owner = loaded
        message = (
            f"driving the batch failed {num_attempts} times (--max-batch-attempts); the last "
            f"error: {last_error or 'none recorded (the replica driving it was killed)'}"
        )
        batch["errors"] = {
            "object": "list",
            "data": [{"code": "batch_driver_failed", "message": message, "param": None, "line": None}],
        }
        logger.warning("batch %s: %s", batch_id, message)
        # The rows that finished stay: their parts become the output and error files.
        self._publish_parts(batch, owner)
        self._finish(batch, owner, BatchStatus.FAILED)

    def _fail_unreadable(self, batch_id: str, message: str) -> None:
        loaded = self._load(batch_id)
        if loaded is None or is_terminal(loaded[0]):
            return
        batch, owner = loaded
        batch["errors"] = {
            "object": "list",
            "data": [
                {"code": "input_file_unreadable", "message": message, "param": "input_file_id", "line": None}
            ],
        }
        logger.warning("batch %s: %s", batch_id, message)
        self._finish(batch, owner, BatchStatus.FAILED)

    def _finish(self, batch: dict[str, Any], owner: str, status: BatchStatus) -> None:
        set_status(batch, status)
        self._save(batch, owner)
        self.records.deactivate(BATCH_KIND, batch["id"])
        self.records.redis.delete(cancel_flag_key(self.records, batch["id"]))
        self.records.redis.delete(attempts_key(self.records, batch["id"]))
        logger.info("batch %s: %s %s", batch["id"], status.value, batch["request_counts"])

    def _validate(self, batch: dict[str, Any], owner: str) -> bool:
        """The whole-file check of `qworker batch`, plus OpenAI's rule that every row names the
        batch's endpoint. False: the batch failed (or was cancelled while validating)."""
        location = self.files.location(batch["input_file_id"])
        problems: list[tuple[int | None, str]] = []
        try:
            checked = check_input(location)
        except BatchFileError as exc:
            problems = [(_line_of(p), p) for p in exc.problems]
        else:
            for row in iter_rows(location):
                if row.url != batch["endpoint"]:
                    problems.append(
                        (
                            row.line_no,
                            f"line {row.line_no}: url {row.url!r} is not the batch's endpoint "
                            f"{batch['endpoint']!r}",
                        )
                    )
            if checked.num_rows == 0:
                problems.append((None, "the input file has no rows"))
        if problems:
            batch["errors"] = {
                "object": "list",
                "data": [
                    {"code": "invalid_request", "message": message, "param": None, "line": line}
                    for line, message in problems[:MAX_ERRORS]
                ],
            }
            self._finish(batch, owner, BatchStatus.FAILED)
            return False
        if self.records.redis.exists(cancel_flag_key(self.records, batch["id"])):
            self._finish(batch, owner, BatchStatus.CANCELLED)
            return False
        batch["request_counts"]["total"] = checked.num_rows
        self._note_invariance(batch)
        set_status(batch, BatchStatus.IN_PROGRESS)
        self._save(batch, owner)
        return True

    def _note_invariance(self, batch: dict[str, Any]) -> None:
        """Say in the batch's metadata when the pool's workers run without --batch-invariant: its
        rows may then differ from a local `qworker batch` run of the same file."""
        try:
            warning = invariance_warning(self.client.sink)
        except Exception as exc:  # a warning's check must never fail the batch
            logger.debug("batch %s: could not read the workers' stats: %s", batch["id"], exc)
            return
        if warning is not None:
            logger.warning("batch %s: %s", batch["id"], warning)
            batch["metadata"] = {**(batch.get("metadata") or {}), INVARIANCE_WARNING_KEY: warning}

    def _run(self, batch: dict[str, Any], owner: str, lost: threading.Event) -> None:
        batch_id = batch["id"]
        output_file, errors_file = self._parts(batch_id)
        output = BatchOutput(output_file, errors_file)
        output.listeners.append(self._board(batch).observe_line)
        ok_ids = output_file.load(resume=True)
        failed_ids = errors_file.load(resume=True)
        done = ok_ids | failed_ids
        num_ok_before, num_failed_before = len(ok_ids), len(failed_ids)
        done_before = len(done)
        location = self.files.location(batch["input_file_id"])
        summary = BatchSummary(batch["request_counts"]["total"], done_before)
        progress = Progress(summary, ProgressMode.NONE)
        stop_reason: list[BatchStatus] = []
        last_check = 0.0

        def counts() -> dict[str, int]:
            failed = num_failed_before + summary.num_failed
            completed = num_ok_before + summary.num_run - summary.num_failed
            return {"total": batch["request_counts"]["total"], "completed": completed, "failed": failed}

        def should_stop() -> bool:
            nonlocal last_check
            if lost.is_set() or self._closing.is_set():
                raise _Stop()
            now = time.monotonic()
            if now - last_check < CHECK_INTERVAL_S:
                return False
            last_check = now
            output_file.flush_if_old()
            errors_file.flush_if_old()
            if self.records.redis.exists(cancel_flag_key(self.records, batch_id)):
                stop_reason.append(BatchStatus.CANCELLING)
                if batch["status"] != BatchStatus.CANCELLING.value:
                    set_status(batch, BatchStatus.CANCELLING)
                return True
            # The stored deadline, read again: an operator may move it (a test does).
            stored = self._load(batch_id)
            if stored is not None:
                batch["expires_at"] = stored[0]["expires_at"]
            if time.time() >= batch["expires_at"]:
                stop_reason.append(BatchStatus.EXPIRED)
                return True
            batch["request_counts"] = counts()
            self._save(batch, owner)
            return False

        rows = prepare_batch_rows(
            (row for row in iter_rows(location) if row.custom_id not in done),
            batch_id=batch_id,
            served_model_names=[self.settings.model],
            adapter_names=self.settings.adapter_names,
        )
        journal = open_submitted(self.client.sink, batch_id, self.work_dir / f"{batch_id}.submitted")
        runner = PoolRunner(
            self.client,
            output,
            progress,
            journal,
            default_max_tokens=self.settings.max_model_len or DEFAULT_POOL_MAX_TOKENS,
            should_stop=should_stop,
        )
        output.open()
        try:
            runner.run(rows)
        finally:
            output.close()
            progress.close()
        batch["request_counts"] = counts()
        if runner.is_stopped:
            # Cancel (or expiry): finished rows stay in the output; the rest are cancelled.
            for job_id in runner.pending_ids():
                self.client.cancel(job_id)
            final = BatchStatus.CANCELLED if stop_reason[0] is BatchStatus.CANCELLING else BatchStatus.EXPIRED
        else:
            final = BatchStatus.COMPLETED
        set_status(batch, BatchStatus.FINALIZING)
        self._save(batch, owner)
        self._publish_parts(batch, owner)
        self._finish(batch, owner, final)

    def _parts(self, batch_id: str) -> tuple[OutputParts, OutputParts]:
        return (
            OutputParts(self.files, self.records, batch_id, "output", self.settings.batch_part_max_age_s),
            OutputParts(self.files, self.records, batch_id, "errors", self.settings.batch_part_max_age_s),
        )

    def _publish_parts(self, batch: dict[str, Any], owner: str) -> None:
        """Join the stored parts into the batch's output and error files (none for a file with
        no line), then delete the parts."""
        options = self.records.get(BATCH_OPTIONS_KIND, batch["id"]) or {}
        expiry_s = options.get("output_expiry_s") or self.settings.file_expiry_s
        output_parts, error_parts = self._parts(batch["id"])
        batch["output_file_id"] = self._publish(output_parts, f"{batch['id']}_output.jsonl", owner, expiry_s)
        batch["error_file_id"] = self._publish(error_parts, f"{batch['id']}_error.jsonl", owner, expiry_s)
        # Summed over the output's lines, one per row whichever run or replica wrote it.
        batch["usage"] = output_parts.usage.to_dict()
        for parts in (output_parts, error_parts):
            parts.delete_parts()

    def _publish(self, parts: OutputParts, name: str, owner: str, expiry_s: int) -> str | None:
        """The parts as one `batch_output` file of the owner; None when they hold no line."""
        file_id = new_id("file")
        num_bytes = parts.join_into(file_id)
        if num_bytes == 0:
            return None
        obj = file_object(file_id, name, "batch_output", num_bytes, expiry_s)
        self.records.create(FILE_KIND, file_id, owner, {"owner": owner, "file": obj})
        return file_id


def _line_of(problem: str) -> int | None:
    head = problem.split(":", 1)[0]
    if head.startswith("line "):
        try:
            return int(head.removeprefix("line "))
        except ValueError:
            return None
    return None
