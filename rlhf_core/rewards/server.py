"""``serve-rm``: a trained reward model behind HTTP, for ``reward_kind: http`` (``rlhf_core.rewards.sources``).

Endpoints:

* ``POST /score`` with ``{"prompts": [...], "completions": [...], "labels": [...]}``
  (``labels`` optional and unused by a reward model) → ``{"rewards": [...]}``, normalised
  as :func:`rlhf_core.rewards.model.score` returns them. A malformed body, a missing field
  or mismatched lengths get a 400 whose ``error`` names the field.
* ``GET /health`` → ``{"status": "ok", "model": PATH}`` (no token needed: for liveness probes).

Run::

    python -m rlhf_core.rewards.server --model outputs/reward_model --port 8123
    # port 0 picks a free port; --port-file writes the chosen one for a script to read
    RM_TOKEN=$(openssl rand -hex 24) python -m rlhf_core.rewards.server --model ... --token-env RM_TOKEN

``alignflow serve-rm`` calls :func:`main` with the same arguments. It binds 127.0.0.1 by
default. ``--token-env NAME`` makes ``/score`` require ``Authorization: Bearer <token>`` with the
token read from environment variable ``NAME`` (a 401 otherwise; compared in constant time);
the trainer sends it from its own ``reward_token_env``. Without it there is no authentication,
so exposing the server (``--host 0.0.0.0``) is then a choice to make on a trusted network only.
Whatever the flags, a body over ``--max-body-bytes`` (default 8 MiB) or with more than
``--max-items`` samples (default 4096) gets a 413 before any scoring, so one request cannot
exhaust the server's memory; the defaults fit a 4096-sample rollout of about 2 KB of text each.

Built on FastAPI + uvicorn rather than ``http.server``: both are already installed (fastapi
is a pinned dependency, uvicorn comes with Prefect) and are what vLLM's own server runs on;
uvicorn gives HTTP/1.1 keep-alive, so the trainer's client reuses a connection, and a clean
shutdown on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import hmac
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

# Module level, not inside build_app: FastAPI resolves the (string, postponed) annotation
# ``request: Request`` against module globals, and would otherwise treat it as a query field.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from rlhf_core.common.atomic_io import write_text_atomic
from rlhf_core.common.bounded_http import loads_strict
from rlhf_core.common.redact import register_secret
from rlhf_core.rewards.sources import RewardModelSource

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_ITEMS = 4096


class BadRequest(ValueError):
    """A /score body that cannot be scored; the message names the field."""

    status = 400


class TooLarge(BadRequest):
    """A /score body over the server's byte or item limit."""

    status = 413


async def read_limited_body(request: Request, max_bytes: int) -> bytes:
    """The request body, or :class:`TooLarge` once it passes ``max_bytes``: a declared
    Content-Length is refused before reading, and a chunked body is counted as it arrives."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("header 'Content-Length': not a number")
        if int(declared) > max_bytes:
            raise TooLarge(f"body: {int(declared)} bytes, over this server's limit of {max_bytes} (--max-body-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise TooLarge(f"body: over this server's limit of {max_bytes} bytes (--max-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def bearer_ok(header: str | None, token: str | None) -> bool:
    """Whether ``header`` is ``Bearer <token>`` (always true without a token); constant-time, so the
    reply's timing does not reveal how much of a guess was right."""
    if token is None:
        return True
    # Starlette decodes header bytes as latin-1; encoding back gives the bytes the client sent.
    return hmac.compare_digest((header or "").encode("latin-1"), f"Bearer {token}".encode("utf-8"))


def parse_score_request(raw: bytes) -> tuple[list[str], list[str], list[str | None]]:
    """``(prompts, completions, labels)`` of a /score body, or :class:`BadRequest` naming the field."""
    try:
        body = loads_strict(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, deep nesting, an int of 5000 digits
        raise BadRequest(f"body: malformed JSON ({str(exc)[:200]})") from None
    if not isinstance(body, dict):
        raise BadRequest("body: expected a JSON object with 'prompts' and 'completions'")
    fields: dict[str, list] = {}
    for name in ("prompts", "completions"):
        if name not in body:
            raise BadRequest(f"field '{name}': missing")
        value = body[name]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise BadRequest(f"field '{name}': expected a list of strings")
        fields[name] = value
    labels = body.get("labels")
    if labels is None:
        labels = [None] * len(fields["prompts"])
    elif not isinstance(labels, list) or not all(v is None or isinstance(v, str) for v in labels):
        raise BadRequest("field 'labels': expected a list of strings or nulls")
    n = len(fields["prompts"])
    for name, value in (("completions", fields["completions"]), ("labels", labels)):
        if len(value) != n:
            raise BadRequest(f"field '{name}': {len(value)} items, but 'prompts' has {n}")
    return fields["prompts"], fields["completions"], labels


def build_app(scorer: Callable[[list[str], list[str], list[str | None]], list[float]], model_name: str,
              token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              max_items: int = DEFAULT_MAX_ITEMS) -> Any:
    """The FastAPI app around ``scorer`` (a :class:`rlhf_core.rewards.sources.RewardSource`); with ``token``,
    /score wants ``Authorization: Bearer <token>``; bodies and batches are capped either way."""
    app = FastAPI(title="alignflow reward model", docs_url=None, redoc_url=None)
    # One request on the model at a time: scoring is already batched, and parallel forward
    # passes would only contend for the same cores or GPU memory.
    lock = threading.Lock()

    def score_locked(prompts: list[str], completions: list[str], labels: list[str | None]) -> list[float]:
        with lock:
            return scorer(prompts, completions, labels)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "model": model_name}

    @app.post("/score")
    async def score(request: Request) -> JSONResponse:
        if not bearer_ok(request.headers.get("authorization"), token):  # before reading a byte of the body
            return JSONResponse({"error": "this server requires an 'Authorization: Bearer <token>' header with its "
                                          "token (serve-rm --token-env)"},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        try:
            prompts, completions, labels = parse_score_request(await read_limited_body(request, max_body_bytes))
            if len(prompts) > max_items:
                raise TooLarge(f"field 'prompts': {len(prompts)} items, over this server's limit of {max_items} "
                               f"per request (--max-items); send smaller batches")
        except BadRequest as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        # The forward pass runs in a worker thread so the event loop keeps answering /health.
        rewards = await run_in_threadpool(score_locked, prompts, completions, labels)
        return JSONResponse({"rewards": rewards})

    return app


def _write_port_file(path: Path, port: int) -> None:
    """Write atomically, so a reader polling for the file never sees it half-written."""
    write_text_atomic(path, f"{port}\n")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignflow serve-rm", description="Serve a reward model over HTTP.")
    parser.add_argument("--model", required=True, help="reward model directory (output of `alignflow reward`)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: localhost only)")
    parser.add_argument("--port", type=int, default=8123, help="port to bind; 0 picks a free one")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per forward pass")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    parser.add_argument("--port-file", default=None, help="write the bound port here once listening")
    parser.add_argument("--token-env", default=None, metavar="NAME",
                        help="require 'Authorization: Bearer <token>' on /score, the token read from environment "
                             "variable NAME (the name, never the token, goes on the command line)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help=f"largest /score body accepted; larger gets 413 (default {DEFAULT_MAX_BODY_BYTES})")
    parser.add_argument("--max-items", type=int, default=DEFAULT_MAX_ITEMS,
                        help=f"most samples per /score request; more gets 413 (default {DEFAULT_MAX_ITEMS})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Load the reward model, bind, announce the port, serve until interrupted."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.max_body_bytes <= 0 or args.max_items <= 0:
        parser.error("--max-body-bytes and --max-items must be > 0")
    token = None
    if args.token_env:
        token = os.environ.get(args.token_env, "")
        if not token:
            print(f"serve-rm: --token-env {args.token_env}: environment variable {args.token_env} is not set "
                  f"(or is empty)", file=sys.stderr)
            return 2
        register_secret(token)

    import uvicorn  # lazy: uvicorn (the reward server only)

    source = RewardModelSource(args.model, device=args.device, batch_size=args.batch_size)
    # Bind before announcing: with --port 0 only the bound socket knows its port, and a
    # client that reads the port file can connect at once (the backlog holds it until
    # uvicorn's loop accepts).
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    port = sock.getsockname()[1]
    if args.port_file:
        _write_port_file(Path(args.port_file), port)
    auth = f"bearer token from ${args.token_env}" if token else "no auth"
    print(f"serve-rm: {args.model} on http://{args.host}:{port} (POST /score, GET /health; {auth}; at most "
          f"{args.max_body_bytes} bytes and {args.max_items} items per request)", flush=True)
    app = build_app(source, str(args.model), token=token, max_body_bytes=args.max_body_bytes, max_items=args.max_items)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":  # `python -m` imports the rlhf_core package (offline switches) first
    sys.exit(main())
