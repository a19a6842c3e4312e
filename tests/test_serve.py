"""`curvalign serve`: HTTP against a live server on the loopback, and the page in headless
Chromium (issue 14, part 4)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from _live_server import live_server
from _search_world import build_world, needs_open_clip

pytestmark = [
    needs_open_clip,
    pytest.mark.skipif(
        importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("httpx") is None,
        reason="optional extra not installed: pip install 'curvalign[serve]' httpx",
    ),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    torch.set_num_threads(1)
    return build_world(tmp_path_factory.mktemp("serve_world"))


@pytest.fixture(scope="module")
def server(world):
    from curvalign.index.searcher import Searcher
    from curvalign.index.serve import make_app

    searcher = Searcher.open(world.runs["meru"], world.indexes["meru"])
    with live_server(make_app(searcher, max_upload_bytes=64 * 1024)) as url:
        yield url, searcher


def test_health_and_text_search_match_the_python_api(server) -> None:
    import httpx

    url, searcher = server
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["recipe"] == "meru"
    assert health["query_modality"] == "text" and health["hyperbolic"] is True
    reply = httpx.post(f"{url}/search", json={"text": "a dog on grass", "k": 3})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    want = searcher.search_text("a dog on grass", 3)
    assert [h["id"] for h in body["hits"]] == [h.id for h in want.hits]
    assert [h["item"]["caption"] for h in body["hits"]] == [h.item.caption for h in want.hits]
    thumb = httpx.get(url + body["hits"][0]["image_url"])
    assert thumb.status_code == 200
    assert thumb.content == (Path(searcher.images_root) / want.hits[0].item.path).read_bytes()


def test_bad_requests_are_refused(server, world) -> None:
    import httpx

    url, _ = server
    assert httpx.post(f"{url}/search", json={"text": ""}).status_code == 400
    assert httpx.post(f"{url}/search", json={"text": "x", "k": 100000}).status_code == 400
    assert (
        httpx.post(
            f"{url}/search", content=b"not json", headers={"content-type": "application/json"}
        ).status_code
        == 400
    )
    big = httpx.post(f"{url}/search", json={"text": "x" * 100_000})
    assert big.status_code == 413
    # an image against an index of images: the wrong modality, said in one line
    image = (world.images / world.files[0]).read_bytes()
    wrong = httpx.post(f"{url}/search", files={"image": ("a.jpg", image)}, data={"k": "2"})
    assert (
        wrong.status_code == 400
        and "holds images, ranked for text queries" in wrong.json()["detail"]
    )


def test_paths_outside_the_images_root_are_refused(server, world) -> None:
    import httpx

    url, _ = server
    secret = world.root / "store" / "meta.json"
    assert secret.is_file()
    for path in (
        "/images/%2e%2e/store/meta.json",
        "/images/..%2fstore%2fmeta.json",
        f"/images/{secret}",
        "/images//etc/passwd",
    ):
        reply = httpx.get(url + path)
        assert reply.status_code in (403, 404), path
        assert b"curvalign.feature_store" not in reply.content
    (world.images / "escape").symlink_to(world.root / "store")
    assert httpx.get(f"{url}/images/escape/meta.json").status_code == 403
    assert httpx.get(f"{url}/images/no/such.png").status_code == 404


def test_concurrent_requests_are_safe(server) -> None:
    import httpx

    url, searcher = server
    queries = [
        f"caption {i % 2} about picture {'dog' if i % 3 else 'cat'}/img{i % 6}" for i in range(24)
    ]
    want = {q: [h.id for h in searcher.search_text(q, 4).hits] for q in set(queries)}

    def ask(q):
        with httpx.Client() as client:
            return q, [
                h["id"]
                for h in client.post(f"{url}/search", json={"text": q, "k": 4}).json()["hits"]
            ]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, queries))
    assert all(ids == want[q] for q, ids in answers)


def test_image_upload_on_an_index_of_texts(world, tmp_path) -> None:
    import httpx

    from curvalign.index.embed import build_from_embeddings, load_embeddings
    from curvalign.index.searcher import Searcher
    from curvalign.index.serve import make_app

    idx = build_from_embeddings(
        load_embeddings(world.embeddings["meru"]), tmp_path / "t", side="texts"
    )
    searcher = Searcher.open(world.runs["meru"], idx)
    path = world.images / world.files[1]
    with live_server(make_app(searcher)) as url:
        reply = httpx.post(
            f"{url}/search", files={"image": ("x.png", path.read_bytes())}, data={"k": "3"}
        )
        assert reply.status_code == 200, reply.text
        assert [h["id"] for h in reply.json()["hits"]] == [
            h.id for h in searcher.search_image(path, 3).hits
        ]
        bad = httpx.post(f"{url}/search", files={"image": ("x.png", b"garbage")})
        assert bad.status_code == 400 and "cannot read it as an image" in bad.json()["detail"]


CHROMIUM = (
    shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
)


def _chromium(args, tmp_path, timeout=120):
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=15000",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HOME": str(tmp_path)},
    )


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium chromium-driver)"
)
def test_page_renders_results_in_headless_chromium(server, tmp_path) -> None:
    from PIL import Image

    url, searcher = server
    want = searcher.search_text("a dog on grass", 4)
    page = f"{url}/?q=a%20dog%20on%20grass&k=4"
    dom = _chromium(["--dump-dom", page], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert html.count('class="hit"') == 4
    for hit in want.hits:
        assert hit.item.caption in html and hit.item.path in html
    assert 'class="querydot"' in html and html.count('class="hitdot"') == 4  # the Poincaré disk
    shot = tmp_path / "page.png"
    result = _chromium([f"--screenshot={shot}", "--window-size=1100,800", page], tmp_path)
    assert result.returncode == 0 and shot.is_file(), result.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert pixels.shape[:2] == (800, 1100)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # not blank: text, thumbnails, disk
    # the query dot's red (#d1342a) is drawn
    red = (np.abs(pixels.astype(int) - [0xD1, 0x34, 0x2A]).sum(axis=2) < 40).sum()
    assert red > 20


def _serve(world, port: int, run=None) -> subprocess.Popen:
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "curvalign",
            "serve",
            str(run or world.runs["meru"]),
            "--index",
            str(world.indexes["meru"]),
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


#: only a hang reaches this: readiness is the process's own "serving" line, not a clock
HANG = 900


def _await_serving(proc: subprocess.Popen) -> str:
    """The "serving ..." line the process prints once it listens (or its failure)."""
    from concurrent.futures import ThreadPoolExecutor, TimeoutError

    with ThreadPoolExecutor(1) as pool:
        try:
            line = pool.submit(proc.stdout.readline).result(timeout=HANG)
        except TimeoutError:
            proc.kill()
            raise AssertionError(
                f"curvalign serve neither listened nor failed in {HANG} s"
            ) from None
    assert line.startswith("serving "), (line, proc.communicate()[1][-2000:])
    return line


def test_cli_serve_answers_on_the_loopback(world) -> None:
    import httpx

    from _live_server import free_port

    port = free_port()
    proc = _serve(world, port)
    try:
        line = _await_serving(proc)
        assert f"http://127.0.0.1:{port}/" in line
        # "serving" is printed once the server listens: the first request is answered
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=HANG).json()
        assert health["status"] == "ok" and health["encoder"] == world.encoder
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=HANG)
        assert page.status_code == 200 and "curvalign search" in page.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
