"""``curvalign serve``: a small local HTTP service and page over a ``Searcher``.

Routes (FastAPI, served by uvicorn; ``pip install 'curvalign[serve]'``, imported only here)::

    GET  /                 the search page (plain HTML + JS, no build step)
    GET  /health           {"status": "ok", recipe, step, indexed, query_modality, count, ...}
    POST /search           JSON {"text": "...", "k": 10}  or  multipart form: image=<file>, k=10
                           -> {query, modality, ranked_by, hits: [{rank, id, score, distance,
                              item: {caption, path, class_name, synset}, image_url}], disk}
    GET  /images/{path}    a file under the store's images root (thumbnails of the hits)

Safety: binds to 127.0.0.1 unless told otherwise; ``/images`` resolves the path and refuses
anything outside the images root (``..``, absolute paths, symlinks that leave it); a request body
over ``max_upload_bytes`` is refused with 413 before it is parsed, a text query over
``MAX_QUERY_CHARS`` before it is tokenised; ``k`` is bounded; searches
run in worker threads and the ``Searcher`` serialises encoder, head and index behind one lock,
so concurrent requests are safe.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route signatures' types at
# definition time, and ``Request`` is imported inside ``make_app`` (FastAPI is an optional extra).
import json
import socket
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from curvalign._net import bind_port
from curvalign.index.searcher import Searcher, SearchError, SearchResults

if TYPE_CHECKING:
    from fastapi import FastAPI, Request

DEFAULT_MAX_UPLOAD = 8 * 1024 * 1024
DEFAULT_MAX_K = 100
#: the longest text query served: text encoders read a few dozen tokens (CLIP: 77), and
#: tokenising megabytes first would hold a worker for many seconds
MAX_QUERY_CHARS = 2000


def _page() -> str:
    return resources.files("curvalign.index").joinpath("static/search.html").read_text("utf-8")


def _image_url(path: str | None) -> str | None:
    return None if path is None else "/images/" + quote(path)


def _parse_k(value: Any, max_k: int) -> int:
    """The request's ``k`` as an integer in ``[1, max_k]``; 400 otherwise."""
    from fastapi import HTTPException

    try:
        k = int(value)
    except (TypeError, ValueError):
        raise HTTPException(400, f"k must be an integer, got {value!r}") from None
    if not 1 <= k <= max_k:
        raise HTTPException(400, f"k must lie in [1, {max_k}], got {k}")
    return k


async def _bounded_body(request: "Request", max_upload_bytes: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``max_upload_bytes``."""
    from fastapi import HTTPException

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_upload_bytes:
        raise HTTPException(413, f"request body over {max_upload_bytes} bytes")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_upload_bytes:  # a body without (or lying about) its length
            raise HTTPException(413, f"request body over {max_upload_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _image_query(request: "Request", body: bytes, max_k: int) -> tuple[bytes, int]:
    """``(image bytes, k)`` from a multipart form body already read (and bounded)."""
    from fastapi import HTTPException
    from starlette.datastructures import Headers
    from starlette.formparsers import MultiPartParser

    async def replay():
        yield body
        yield b""

    # parse the bytes already read with Starlette's own parser
    form = await MultiPartParser(
        Headers(raw=request.headers.raw), replay(), max_files=1, max_fields=4
    ).parse()
    upload = form.get("image")
    if upload is None or isinstance(upload, str):
        raise HTTPException(400, "a multipart search needs a file field 'image'")
    data = await upload.read()
    return data, _parse_k(form.get("k", 10), max_k)


def _text_query(body: bytes, max_k: int) -> tuple[str, int]:
    """``(text, k)`` from a JSON body ``{"text": "...", "k": 10}``."""
    from fastapi import HTTPException

    try:
        payload = json.loads(body or b"{}")
    except ValueError:
        raise HTTPException(400, "the body is not valid JSON") from None
    text = payload.get("text") if isinstance(payload, dict) else None
    if not isinstance(text, str) or not text.strip():
        raise HTTPException(
            400, 'a JSON search needs {"text": "...", "k": 10} with a non-empty text'
        )
    if len(text) > MAX_QUERY_CHARS:
        raise HTTPException(
            413,
            f"a text query is at most {MAX_QUERY_CHARS} characters, got {len(text)} (the text "
            "encoder reads only its first few dozen tokens)",
        )
    return text, _parse_k(payload.get("k", 10), max_k)


def _image_file(root: Path | None, path: str) -> Path:
    """The file ``path`` names under the images root; 404/403 when absent or outside it."""
    from fastapi import HTTPException

    if root is None:
        raise HTTPException(404, "this index's store records no images root")
    if "\x00" in path:  # the OS refuses such a name (ValueError), which would be a 500
        raise HTTPException(400, "an image path cannot contain a NUL byte")
    try:
        target = (root / path).resolve()
        if not target.is_relative_to(root):
            raise HTTPException(403, "path outside the images root")
        if not target.is_file():
            raise HTTPException(404, f"no image {path!r} under the images root")
    except (OSError, ValueError):  # a name too long, or otherwise not a path on this system
        raise HTTPException(404, f"no image {path!r} under the images root") from None
    return target


def make_app(
    searcher: Searcher,
    *,
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD,
    max_k: int = DEFAULT_MAX_K,
) -> "FastAPI":
    """The FastAPI application serving ``searcher`` (see the module docstring)."""
    try:
        from fastapi import FastAPI, HTTPException, Request
        from fastapi.concurrency import run_in_threadpool
        from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
    except ImportError:
        raise SearchError(
            "curvalign serve needs FastAPI and uvicorn: pip install 'curvalign[serve]'"
        ) from None

    app = FastAPI(title="curvalign search", docs_url=None, redoc_url=None)
    root = Path(searcher.images_root).resolve() if searcher.images_root else None
    page = _page()

    def results_json(result: SearchResults) -> dict[str, Any]:
        out = result.to_dict()
        for hit in out["hits"]:
            hit["image_url"] = _image_url(hit["item"]["path"]) if root else None
        return out

    @app.get("/", response_class=HTMLResponse)
    def index_page() -> str:
        return page

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", **searcher.info(), "images": root is not None}

    @app.post("/search")
    async def search(request: Request) -> JSONResponse:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        body = await _bounded_body(request, max_upload_bytes)
        try:
            if kind == "multipart/form-data":
                data, k = await _image_query(request, body, max_k)
                result = await run_in_threadpool(searcher.search_images, [data], k)
            elif kind in ("application/json", ""):
                text, k = _text_query(body, max_k)
                result = await run_in_threadpool(searcher.search_texts, [text], k)
            else:
                raise HTTPException(
                    415, "send JSON {text, k} or a multipart form with an 'image' file"
                )
        except SearchError as exc:
            raise HTTPException(400, str(exc)) from None
        return JSONResponse(results_json(result[0]))

    @app.get("/images/{path:path}")
    def image(path: str) -> FileResponse:
        return FileResponse(_image_file(root, path))

    return app


def serve(
    searcher: Searcher,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD,
    log_level: str = "warning",
    sock: socket.socket | None = None,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Run the service until interrupted (uvicorn, one process, worker threads).

    ``sock``: a socket already bound (``curvalign._net.bind_port``, so that a busy port fails
    before the searcher is loaded); default: ``host:port`` is bound here. ``on_ready()`` is
    called once the server listens (the CLI prints its "serving" line there)."""
    try:
        import uvicorn
    except ImportError:
        raise SearchError(
            "curvalign serve needs FastAPI and uvicorn: pip install 'curvalign[serve]'"
        ) from None
    sock = sock if sock is not None else bind_port(host, port)
    app = make_app(searcher, max_upload_bytes=max_upload_bytes)

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and on_ready is not None:
                on_ready()

    server = _Server(uvicorn.Config(app, log_level=log_level))
    server.run(sockets=[sock])


__all__ = ["DEFAULT_MAX_K", "DEFAULT_MAX_UPLOAD", "MAX_QUERY_CHARS", "make_app", "serve"]
