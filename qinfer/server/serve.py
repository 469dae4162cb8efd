"""Run the app on uvicorn beside the engine: bind first (a port in use is one clear error); the engine steps on this
(the main) thread, the HTTP server on another (``qinfer.server.runner`` says why). SIGTERM or Ctrl-C stops accepting
connections, lets requests in flight finish for a grace period, cancels the rest, and returns."""

import signal
import socket
import threading

import uvicorn

from qinfer.errors import QinferError
from qinfer.server.runner import EngineRunner


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
    return sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(app, sock: socket.socket, runner: EngineRunner, grace: float) -> bool:
    """Serve ``app`` on ``sock`` with ``runner`` stepping the engine here, until SIGTERM or Ctrl-C (a second Ctrl-C
    cancels the grace period); False if the server could not start."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=grace,
                            lifespan="on")
    server = uvicorn.Server(config)  # (off the main thread it leaves the signals alone)

    def http():
        try:
            server.run(sockets=[sock])
        finally:  # ended by a signal, or failed to start: the engine's loop ends too
            runner.stop()

    def on_signal(signum, frame):
        if server.should_exit and signum == signal.SIGINT:
            server.force_exit = True
        server.should_exit = True

    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, on_signal) for sig in handled}
    thread = threading.Thread(target=http, name="qinfer-http")
    try:
        thread.start()
        runner.run()
        server.should_exit = True  # (the engine failed: nothing more can be served)
        thread.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return server.started
