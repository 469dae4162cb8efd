"""Run the app on uvicorn: bind first (a port in use is one clear error), and on SIGTERM or Ctrl-C stop accepting,
let requests in flight finish for a grace period, cancel the rest, and return."""

import contextlib
import signal
import socket
import sys

import uvicorn

from qinfer.errors import QinferError


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """SIGTERM and SIGINT begin the graceful shutdown. Unlike uvicorn's own, the signal is not raised again
        afterwards: a shutdown asked for is a clean exit."""
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one), or a one-line error."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise QinferError(f"--host {host}: not an address this machine has ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise QinferError(f"cannot listen on {host}:{port} ({e.strerror}): pick another --port, or stop what "
                          "uses it") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(app, sock: socket.socket, grace: float) -> None:
    """Serve ``app`` on ``sock`` until SIGTERM or Ctrl-C; exits 1 if the app's startup failed."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=grace,
                            lifespan="on")
    server = _Server(config)
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(1)
