"""Which addresses a job's webhook may call, checked twice: when the job is submitted (the URL's
host, and what it resolves to then), and again at connect time on the address the connection
actually uses (resolved once more, and connected to by that address), so that a name that
resolves to a public address at submission and to 10.0.0.1 later (DNS rebinding) is refused.

The operator's allow-list (`--webhook-allow`) holds host names and networks (CIDR or single
addresses). An address is allowed when it is inside an allowed network, or when it is a public
(globally routable) address and the host is allowed: any host when the list names no host, else
only the hosts it names. Private, loopback, link-local (169.254.0.0/16, the cloud metadata
address) and other reserved ranges are refused unless a network in the list covers them.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from qworker.gateway.errors import GatewayError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class WebhookTargetError(GatewayError):
    def __init__(self, message: str) -> None:
        super().__init__(400, message, code="invalid_webhook", param="webhook")


@dataclass(frozen=True)
class Target:
    """A webhook URL taken apart: scheme, host, port, path with query."""

    url: str
    scheme: str
    host: str
    port: int
    path: str


def parse_target(url: object) -> Target:
    if not isinstance(url, str) or len(url) > 2048:
        raise WebhookTargetError("webhook must be an http(s) URL of at most 2048 characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookTargetError(f"webhook must be an http:// or https:// URL with a host, got {url!r}")
    if parts.username or parts.password:
        raise WebhookTargetError("webhook URLs may not carry credentials")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise WebhookTargetError(f"webhook URL {url!r} has a bad port") from None
    path = parts.path or "/"
    if parts.query:
        path += f"?{parts.query}"
    return Target(url, parts.scheme, parts.hostname.lower(), port, path)


class WebhookPolicy:
    def __init__(self, allow: str) -> None:
        self.networks: list[IPNetwork] = []
        self.hosts: set[str] = set()
        for item in (part.strip() for part in allow.split(",")):
            if not item:
                continue
            try:
                self.networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                self.hosts.add(item.lower().rstrip("."))

    def is_allowed(self, host: str, address: IPAddress) -> bool:
        if any(address in network for network in self.networks):
            return True
        if not address.is_global:
            return False
        return not self.hosts or host in self.hosts

    def resolve(self, target: Target) -> list[IPAddress]:
        """The target's addresses, each of which is allowed; WebhookTargetError otherwise."""
        try:
            infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise WebhookTargetError(f"the webhook host {target.host!r} does not resolve: {exc}") from None
        addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
        refused = [str(a) for a in addresses if not self.is_allowed(target.host, a)]
        if refused or not addresses:
            raise WebhookTargetError(
                f"the webhook host {target.host!r} resolves to {', '.join(refused) or 'nothing'}, which "
                "the gateway's webhook allow-list does not allow (private and link-local ranges are "
                "refused unless --webhook-allow names them)"
            )
        return addresses

    def check(self, url: object) -> Target:
        """Submission-time check of a webhook URL (blocking: it resolves the host)."""
        target = parse_target(url)
        self.resolve(target)
        return target
