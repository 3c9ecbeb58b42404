"""`python phi2_server.py`, with a gate on its decoder (tests/fakes.py), for the tests that
signal a real server process.

Every sequence is held after its first token, so a test knows its streams are still in flight
when it sends the signal, however fast this machine decodes. With GATE_RELEASE=shutdown they are
released as the server begins to shut down (the grace-period test); with GATE_RELEASE=open
nothing is held; otherwise they stay held, and the shutdown itself must end them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from fakes import Gate, GatedBackend  # noqa: E402

from phi2_server import Settings, configure_logging, create_app, model_loader, run  # noqa: E402


def main() -> int:
    settings = Settings.from_args()
    configure_logging()
    gate = Gate(after=1)
    load = model_loader(settings)
    app = create_app(settings, load=lambda: GatedBackend(load(), gate))
    if os.environ.get("GATE_RELEASE") == "open":  # nothing held: requests run to their end
        gate.release()
    if os.environ.get("GATE_RELEASE") == "shutdown":

        async def release(app) -> None:
            gate.release()

        app.on_shutdown.insert(0, release)  # before the drain, which waits for the streams
    return run(app)


if __name__ == "__main__":
    sys.exit(main())
