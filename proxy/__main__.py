"""`python -m proxy`: serve specgate on SPECGATE_HOST:SPECGATE_PORT."""

from __future__ import annotations

import logging
import math
import resource
import signal
import sys

import uvicorn
from prometheus_client import disable_created_metrics
from pydantic import ValidationError

from .app import create_app
from .config import Settings, describe_error
from .edge.protocol import edge_protocol
from .observability.logs import configure


def main(env_file: str | None = ".env") -> int:
    """Serve until SIGTERM or SIGINT; `env_file` is read for settings the environment does not set."""
    try:
        settings = Settings(_env_file=env_file)
    except ValidationError as exc:
        print(f"specgate: invalid setting: {describe_error(exc)}", file=sys.stderr)
        return 2
    configure(settings)
    # `_created` samples double the exposition and no dashboard reads them.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal against the handler it found
    # installed. A no-op one turns the drained shutdown into exit status 0 instead of death by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    _check_file_limit(settings)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        # uvicorn's httptools protocol with a header timeout, a head size cap and a connection cap.
        http=edge_protocol(settings.header_timeout_s, settings.max_client_connections),
        timeout_keep_alive=settings.keepalive_timeout_s,
        access_log=False,
        log_config=None,
        server_header=False,
        # The peer address is the client's; X-Forwarded-For is judged by SPECGATE_TRUSTED_PROXIES
        # when the request goes upstream (proxy/transport/upstream.py), not by uvicorn.
        proxy_headers=False,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s),
        backlog=4096,
    )
    return 0


def _check_file_limit(settings: Settings) -> None:
    """Warn when the client cap and the upstream pools together could run out of descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = settings.max_client_connections + 2 * settings.max_connections_per_backend + 64
    if soft != resource.RLIM_INFINITY and soft < need:
        logging.getLogger("specgate").warning(
            "the open-file limit (%d) is below SPECGATE_MAX_CLIENT_CONNECTIONS + 2 x "
            "SPECGATE_MAX_CONNECTIONS_PER_BACKEND + 64 (%d): raise it (ulimit -n) or lower the cap",
            soft,
            need,
        )


if __name__ == "__main__":
    sys.exit(main())
