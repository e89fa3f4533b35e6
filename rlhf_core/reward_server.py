"""``serve-rm``: a trained reward model behind HTTP, for ``reward_kind: http`` (``rlhf_core.rewards``).

Endpoints:

* ``POST /score`` with ``{"prompts": [...], "completions": [...], "labels": [...]}``
  (``labels`` optional and unused by a reward model) → ``{"rewards": [...]}``, normalised
  as :func:`rlhf_core.reward_model.score` returns them. A malformed body, a missing field
  or mismatched lengths get a 400 whose ``error`` names the field.
* ``GET /health`` → ``{"status": "ok", "model": PATH}``.

Run::

    python -m rlhf_core.reward_server --model outputs/reward_model --port 8123
    # port 0 picks a free port; --port-file writes the chosen one for a script to read

``alignflow serve-rm`` calls :func:`main` with the same arguments. It binds 127.0.0.1 by
default: there is no authentication, so exposing it (``--host 0.0.0.0``) is a choice to make
on a trusted network only.

Built on FastAPI + uvicorn rather than ``http.server``: both are already installed (fastapi
is a pinned dependency, uvicorn comes with Prefect) and are what vLLM's own server runs on;
uvicorn gives HTTP/1.1 keep-alive, so the trainer's client reuses a connection, and a clean
shutdown on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
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


class BadRequest(ValueError):
    """A /score body that cannot be scored; the message names the field."""


def parse_score_request(raw: bytes) -> tuple[list[str], list[str], list[str | None]]:
    """``(prompts, completions, labels)`` of a /score body, or :class:`BadRequest` naming the field."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body: malformed JSON ({exc})") from None
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


def build_app(scorer: Callable[[list[str], list[str], list[str | None]], list[float]], model_name: str) -> Any:
    """The FastAPI app around ``scorer`` (a :class:`rlhf_core.rewards.RewardSource`)."""
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
        try:
            prompts, completions, labels = parse_score_request(await request.body())
        except BadRequest as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        # The forward pass runs in a worker thread so the event loop keeps answering /health.
        rewards = await run_in_threadpool(score_locked, prompts, completions, labels)
        return JSONResponse({"rewards": rewards})

    return app


def _write_port_file(path: Path, port: int) -> None:
    """Write atomically, so a reader polling for the file never sees it half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Load the reward model, bind, announce the port, serve until interrupted."""
    parser = argparse.ArgumentParser(prog="alignflow serve-rm", description="Serve a reward model over HTTP.")
    parser.add_argument("--model", required=True, help="reward model directory (output of `alignflow reward`)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: localhost only)")
    parser.add_argument("--port", type=int, default=8123, help="port to bind; 0 picks a free one")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per forward pass")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    parser.add_argument("--port-file", default=None, help="write the bound port here once listening")
    args = parser.parse_args(argv)

    import uvicorn

    from rlhf_core.rewards import RewardModelSource

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
    print(f"serve-rm: {args.model} on http://{args.host}:{port} (POST /score, GET /health)", flush=True)
    config = uvicorn.Config(build_app(source, str(args.model)), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":  # `python -m` imports the rlhf_core package (offline switches) first
    sys.exit(main())
