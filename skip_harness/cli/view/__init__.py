"""`skip-harness view [DUMP_DIR | NAMESPACE ...] [--host 127.0.0.1] [--port N] [--tokenizer NAME_OR_PATH] [--open]`:
a read-only web viewer of rollout caches (extra `[view]`: Starlette, uvicorn, Jinja2).

Serves on loopback unless another host is asked for, says its URL on stderr, stops on Ctrl-C. Modules:
`data` (what is read, and how: read-only scans, verified step reads), `samples` (a step's mini-batches
as trajectories and groups), `grpo` (dead groups, computed advantages, zero within rounding), `live` (who
records and replays a namespace now), `decode` (text, tokens, per-token values), `charts` (SVG), `pages` (what
each page holds, a module per page), `templates` and `style` (HTML, autoescaped), `app` (the routes and the JSON API).
"""
from __future__ import annotations

import gc
import ipaddress
import logging
import socket
import threading
import webbrowser
from pathlib import Path
from typing import List, Optional, Sequence

from skip_harness.store.api import is_pack
from skip_harness.cli._common import EXIT_OK, CliError, default_dump_dir, where_of

logger = logging.getLogger("skip_harness.cli.view")

DEFAULT_PORT = 8765
INSTALL_HINT = "pip install -e '.[view]'"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise CliError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc}); "
                       f"choose another --port (0 picks a free one)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def cmd_view(targets: Sequence[str], host: str, port: Optional[int], tokenizer: Optional[str],
             open_browser: bool) -> int:
    try:
        import uvicorn

        from skip_harness.cli.view.app import build_app
    except ImportError as exc:
        raise CliError(f"skip-harness view needs the [view] extra ({INSTALL_HINT}): {exc}") from None
    from skip_harness.cli.view.data import Cache
    from skip_harness.cli.view.decode import Decoder

    roots: List = []
    if not targets:
        where, how = default_dump_dir()
        roots.append(where)
        if isinstance(where, Path) and not where.exists():
            logger.info("no skip_harness cache at %s yet (%s)", where, how)
    for text in targets:
        root = where_of(text, "DUMP_DIR | NAMESPACE")
        if isinstance(root, Path) and not root.is_dir() and not is_pack(root):
            raise CliError(f"{root} {'does not exist' if not root.exists() else 'is not a directory or a pack file'}")
        roots.append(root)
    decoder = Decoder(tokenizer)           # a tokenizer that does not load stops here, naming --tokenizer
    cache = Cache(roots)
    sock = _listen(host, DEFAULT_PORT if port is None else port)
    bound = sock.getsockname()[1]
    shown_host = f"[{host.strip('[]')}]" if ":" in host else host
    url = f"http://{shown_host}:{bound}/"
    if _is_loopback(host):
        allowed = ["127.0.0.1", "localhost", "[::1]", "::1", shown_host]
    else:
        allowed = ["*"]
        logger.warning("serving on %s: anyone who can reach this machine on port %d can read these caches",
                       host, bound)
    app = build_app(cache, decoder, allowed)
    names = len(cache.namespaces())
    logger.info("serving %d namespace%s from %s at %s (read-only; Ctrl-C stops)", names, "" if names == 1 else "s",
                ", ".join(str(r) for r in roots), url)
    if open_browser:
        threading.Timer(0.5, webbrowser.open, args=(url,)).start()
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                                           lifespan="off", timeout_graceful_shutdown=2))
    gc.freeze()      # what was imported stays: collections then walk a page's objects, not all of torch's
    import torch

    # a page's tensor work is small (a mask's ends, a few rows): one thread each, no intra-op pool whose
    # threads contend with the server's (measured: 100 ms for a 64 x 3,072 mask with 2 threads on a loaded
    # 2-core machine, 1.5 ms with one)
    torch.set_num_threads(1)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:      # uvicorn shuts down on Ctrl-C, then raises it again: the stop asked for
        pass
    finally:
        sock.close()
    logger.info("stopped")
    return EXIT_OK
