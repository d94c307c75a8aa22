"""`python -m proxy`: serve specgate on SPECGATE_HOST:SPECGATE_PORT."""

from __future__ import annotations

import math
import signal
import sys

import uvicorn
from prometheus_client import disable_created_metrics
from pydantic import ValidationError

from .app import create_app
from .config import Settings, describe_error
from .logs import configure


def main() -> int:
    try:
        settings = Settings()
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
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_config=None,
        server_header=False,
        # Nothing reads the client's address, so X-Forwarded-For need not be parsed per request.
        proxy_headers=False,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s),
        backlog=4096,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
