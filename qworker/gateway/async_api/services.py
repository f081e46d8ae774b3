"""What the Files, Batches and async-jobs routes share: the records (Redis), the file store, the
idempotency keys, the leases, and the two background services (the batch driver and the webhook
dispatcher), kept on `app.state.async_api`. `create_app` opens it; the lifespan starts and stops
the services.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from qworker.gateway.async_api.batch_driver import BatchDriver
from qworker.gateway.async_api.file_store import FileStore, open_file_store
from qworker.gateway.async_api.idempotency import Idempotency
from qworker.gateway.async_api.leases import Leases
from qworker.gateway.async_api.objects import owner_of
from qworker.gateway.async_api.records import Records, RecordsUnavailableError
from qworker.gateway.async_api.webhook_targets import WebhookPolicy
from qworker.gateway.async_api.webhooks import WebhookDispatcher, load_secret
from qworker.gateway.auth import bearer_token
from qworker.gateway.settings import GatewaySettings
from qworker.jobs.client import Client

logger = logging.getLogger(__name__)


@dataclass
class AsyncApi:
    settings: GatewaySettings
    client: Client
    files: FileStore
    records: Records | None
    webhook_policy: WebhookPolicy
    webhook_secret: bytes | None
    driver: BatchDriver | None = None
    webhooks: WebhookDispatcher | None = None

    @classmethod
    def open(cls, settings: GatewaySettings, client: Client, work_dir: Path | None = None) -> AsyncApi:
        from qworker.openai.batches.files import cache_dir

        files = open_file_store(settings.files_url or str(cache_dir() / "gateway-files"))
        records = Records.of_sink(client.sink)
        secret = load_secret(settings.webhook_secret_file) if settings.webhook_secret_file else None
        api = cls(settings, client, files, records, WebhookPolicy(settings.webhook_allow), secret)
        if records is not None:
            leases = Leases(records, settings.batch_lease_s)
            api.driver = BatchDriver(
                settings, client, records, files, leases, work_dir or cache_dir() / "gateway-batches"
            )
            if secret is not None:
                from qworker.gateway.async_api.jobs import final_status

                api.webhooks = WebhookDispatcher(
                    settings,
                    records,
                    leases,
                    secret,
                    final_status=lambda job_id: final_status(records, client.sink, job_id),
                    has_ended=client.sink.has_result,
                )
        else:
            logger.warning("the result store is not Redis: /v1/files, /v1/batches and /v1/jobs answer 501")
        return api

    def require_records(self) -> Records:
        if self.records is None:
            raise RecordsUnavailableError()
        return self.records

    def idempotency(self) -> Idempotency:
        return Idempotency(self.require_records())

    def start(self) -> None:
        if self.driver is not None:
            self.driver.start()
        if self.webhooks is not None:
            self.webhooks.start()

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()
        if self.webhooks is not None:
            self.webhooks.close()


def async_api(request: Request) -> AsyncApi:
    api: AsyncApi = request.app.state.async_api
    return api


def request_owner(request: Request) -> str:
    """Who owns what this request creates, and what it may see: its API key's digest."""
    return owner_of(bearer_token(request.scope))
