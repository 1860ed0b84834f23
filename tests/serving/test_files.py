"""The Files API: the store (serving/files.py) and its HTTP routes, through the official SDKs.

The routes are served by the HTTP front end's ASGI app in process (Starlette's TestClient is an httpx
client, which both SDKs accept), so no model or engine is needed: uploads, listing, content, deletion,
per-identity isolation, type and size limits, TTLs and leases.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import anthropic
import openai
import pytest
from starlette.testclient import TestClient

from serving.config import ServeConfig
from serving.files import FileError, FilesConfig, FileStore, sniff_image_type
from serving.http.app import HttpFrontEnd
from serving.tenants import ApiKeys

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tiny-v"
PNG = (GOLDEN / "image1.png").read_bytes()
PNG2 = (GOLDEN / "image2.png").read_bytes()
ALICE, BOB = "sk-alice-0123456789", "sk-bob-0123456789"


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---- the store -----------------------------------------------------------------------------------------


def test_sniff_recognises_image_types_by_content():
    assert sniff_image_type(PNG) == "image/png"
    assert sniff_image_type(b"\xff\xd8\xff\xe0" + bytes(16)) == "image/jpeg"
    assert sniff_image_type(b"GIF89a" + bytes(8)) == "image/gif"
    assert sniff_image_type(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "image/webp"
    assert sniff_image_type(b"%PDF-1.7") is None
    assert sniff_image_type(b"") is None


def test_identical_uploads_share_one_copy_and_the_hash_is_sha256():
    store = FileStore(FilesConfig())
    a = store.upload("alice", PNG, filename="a.png", purpose="vision")
    b = store.upload("bob", PNG, filename="b.png", purpose="vision")
    assert a.id != b.id
    assert a.sha256 == b.sha256 == hashlib.sha256(PNG).hexdigest()
    assert store.stored_bytes == len(PNG)  # one copy for two files
    store.upload("alice", PNG2, filename="c.png", purpose="vision")
    assert store.stored_bytes == len(PNG) + len(PNG2)


def test_files_are_per_identity():
    store = FileStore()
    f = store.upload("alice", PNG, filename="a.png", purpose="vision")
    assert store.get("alice", f.id).id == f.id
    with pytest.raises(FileError) as e:
        store.get("bob", f.id)
    assert e.value.status == 404 and f.id in e.value.message
    with pytest.raises(FileError):
        store.delete("bob", f.id)
    with pytest.raises(FileError):
        store.acquire("bob", f.id, "messages[0].content[0]")
    assert [x.id for x in store.list("alice")] == [f.id]
    assert store.list("bob") == []


def test_type_and_size_limits():
    store = FileStore(FilesConfig(max_file_bytes=len(PNG), max_total_bytes=len(PNG) + 10))
    with pytest.raises(FileError, match="not an image") as e:
        store.upload("alice", b"%PDF-1.7 not an image", filename="x.png", purpose="vision")
    assert e.value.status == 400
    with pytest.raises(FileError, match="up to") as e:
        store.upload("alice", PNG + b"\0", filename="a.png", purpose="vision")
    assert e.value.status == 413
    store.upload("alice", PNG, filename="a.png", purpose="vision")
    with pytest.raises(FileError, match="storage is full"):
        store.upload("bob", PNG2[: len(PNG)], filename="b.png", purpose="vision")
    # A duplicate of alice's file is charged as much (issue 33.5: that it fitted told bob what alice
    # had uploaded).
    with pytest.raises(FileError, match="storage is full"):
        store.upload("bob", PNG, filename="same.png", purpose="vision")


def test_each_identity_has_its_own_byte_quota():
    """Issue 33.5: with one global quota tenant B filled the store and tenant A got 413."""
    cfg = FilesConfig(
        max_file_bytes=len(PNG), max_total_bytes=10 * len(PNG), max_bytes_per_identity=2 * len(PNG)
    )
    store = FileStore(cfg)
    store.upload("bob", PNG, filename="1.png", purpose="vision")
    store.upload("bob", PNG2[: len(PNG)], filename="2.png", purpose="vision")
    with pytest.raises(FileError, match="quota") as e:
        store.upload("bob", PNG, filename="3.png", purpose="vision")  # deduplicated, still charged
    assert e.value.status == 413
    store.upload("alice", PNG, filename="a.png", purpose="vision")  # bob's files do not crowd alice out
    store.upload("alice", PNG2[: len(PNG)], filename="b.png", purpose="vision")
    assert store.stored_bytes == len(PNG) + len(PNG2[: len(PNG)])  # memory: each distinct blob once


def test_ttl_expiry_frees_the_bytes():
    clock = Clock()
    store = FileStore(FilesConfig(ttl_s=60), clock=clock)
    f = store.upload("alice", PNG, filename="a.png", purpose="vision")
    short = store.upload("alice", PNG2, filename="b.png", purpose="vision", expires_after_s=10)
    assert f.expires_at == f.created_at + 60 and short.expires_at == short.created_at + 10
    clock.t += 11
    with pytest.raises(FileError):
        store.get("alice", short.id)
    assert store.stored_bytes == len(PNG)
    clock.t += 50
    with pytest.raises(FileError):
        store.get("alice", f.id)
    assert store.list("alice") == []
    assert store.stored_bytes == 0 and store.record_count == 0


def test_a_lease_keeps_a_deleted_or_expired_file_until_released():
    clock = Clock()
    store = FileStore(FilesConfig(ttl_s=60), clock=clock)
    f = store.upload("alice", PNG, filename="a.png", purpose="vision")
    g = store.upload("alice", PNG2, filename="b.png", purpose="vision")
    lease_f = store.acquire("alice", f.id, "file_id")
    lease_g = store.acquire("alice", g.id, "file_id")
    store.delete("alice", f.id)
    with pytest.raises(FileError):  # gone for the API at once ...
        store.get("alice", f.id)
    assert lease_f.data == PNG  # ... but the running request keeps its bytes
    assert store.stored_bytes == len(PNG) + len(PNG2)
    clock.t += 61  # g expires while leased
    assert lease_g.data == PNG2 and store.record_count == 2
    lease_f.release()
    lease_f.release()  # idempotent: a double release must not free another holder's count
    assert store.stored_bytes == len(PNG2)
    lease_g.release()
    assert store.stored_bytes == 0 and store.record_count == 0


def test_a_duplicate_blob_survives_while_another_record_uses_it():
    store = FileStore()
    a = store.upload("alice", PNG, filename="a.png", purpose="vision")
    b = store.upload("alice", PNG, filename="b.png", purpose="vision")
    store.delete("alice", a.id)
    assert store.content("alice", b.id)[1] == PNG and store.stored_bytes == len(PNG)
    store.delete("alice", b.id)
    assert store.stored_bytes == 0


# ---- the routes, through the SDKs ------------------------------------------------------------------------


@pytest.fixture()
def front():
    config = ServeConfig(
        api_keys=ApiKeys.parse([f"{ALICE} alice", f"{BOB} bob"]),
        http_port=0,
        metrics_port=None,
    )
    fe = HttpFrontEnd(config)
    with TestClient(fe.app) as client:
        fe.client = client
        yield fe


def _oai(front, key=ALICE):
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=key, http_client=front.client, max_retries=0
    )


def test_openai_sdk_upload_list_retrieve_content_delete(front):
    oai = _oai(front)
    f = oai.files.create(file=("photo.png", io.BytesIO(PNG), "image/png"), purpose="vision")
    assert f.id.startswith("file-") and f.object == "file" and f.bytes == len(PNG)
    assert f.filename == "photo.png" and f.purpose == "vision"
    assert f.expires_at == f.created_at + int(FilesConfig().ttl_s)
    assert [x.id for x in oai.files.list()] == [f.id]
    assert oai.files.retrieve(f.id).bytes == len(PNG)
    assert oai.files.content(f.id).read() == PNG
    deleted = oai.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    with pytest.raises(openai.NotFoundError, match="no such file"):
        oai.files.retrieve(f.id)
    assert front.files.stored_bytes == 0


def test_openai_sdk_expires_after_shortens_the_ttl(front):
    f = _oai(front).files.create(
        file=("a.png", PNG), purpose="vision", expires_after={"anchor": "created_at", "seconds": 120}
    )
    assert f.expires_at == f.created_at + 120


def test_another_key_cannot_see_or_delete_a_file(front):
    f = _oai(front, ALICE).files.create(file=("a.png", PNG), purpose="vision")
    bob = _oai(front, BOB)
    assert list(bob.files.list()) == []
    for call in (bob.files.retrieve, bob.files.content, bob.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    assert _oai(front, ALICE).files.retrieve(f.id).id == f.id
    with pytest.raises(openai.AuthenticationError):
        _oai(front, "sk-wrong-key-000000").files.list()


def test_upload_refusals_name_the_field(front):
    oai = _oai(front)
    # A PDF named .png with an image content type: the content decides.
    with pytest.raises(openai.BadRequestError, match="not an image") as e:
        oai.files.create(file=("fake.png", b"%PDF-1.7 ...", "image/png"), purpose="vision")
    assert e.value.body["param"] == "file"
    with pytest.raises(openai.BadRequestError, match="purpose") as e:
        oai.files.create(file=("a.png", PNG), purpose="batch")
    assert e.value.body["param"] == "purpose"
    r = front.client.post(
        "/v1/files", headers={"Authorization": f"Bearer {ALICE}"}, json={"purpose": "vision"}
    )
    assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]


def test_upload_size_limit(front):
    front.files.config = FilesConfig(max_file_bytes=len(PNG) - 1, max_total_bytes=10 * len(PNG))
    with pytest.raises(openai.APIStatusError, match="up to") as e:
        _oai(front).files.create(file=("a.png", PNG), purpose="vision")
    assert e.value.status_code == 413
    assert front.files.stored_bytes == 0


def test_anthropic_sdk_files_share_the_store(front):
    claude = anthropic.Anthropic(
        base_url="http://testserver/anthropic", api_key=ALICE, http_client=front.client, max_retries=0
    )
    f = claude.beta.files.upload(file=("photo.png", PNG, "image/png"))
    assert f.id.startswith("file-") and f.type == "file"
    assert f.mime_type == "image/png" and f.size_bytes == len(PNG) and f.filename == "photo.png"
    assert [x.id for x in claude.beta.files.list()] == [f.id]
    assert claude.beta.files.retrieve_metadata(f.id).size_bytes == len(PNG)
    assert claude.beta.files.download(f.id).read() == PNG
    # The OpenAI SDK with the same key sees the same file (one store, one identity).
    assert _oai(front).files.retrieve(f.id).bytes == len(PNG)
    assert claude.beta.files.delete(f.id).id == f.id
    with pytest.raises(anthropic.NotFoundError):
        claude.beta.files.retrieve_metadata(f.id)
    assert front.files.stored_bytes == 0


def test_anthropic_sdk_at_the_root_path_gets_anthropic_objects(front):
    # base_url without /anthropic: the SDK calls /v1/files with its anthropic-version header.
    claude = anthropic.Anthropic(
        base_url="http://testserver", api_key=ALICE, http_client=front.client, max_retries=0
    )
    f = claude.beta.files.upload(file=("photo.png", PNG, "image/png"))
    assert f.type == "file" and f.size_bytes == len(PNG)
    page = claude.beta.files.list()
    assert [x.id for x in page.data] == [f.id] and page.has_more is False
    with pytest.raises(anthropic.BadRequestError, match="not an image"):
        claude.beta.files.upload(file=("notes.png", b"just text", "image/png"))


def test_a_chunked_upload_without_content_length_is_refused_at_the_limit(front):
    """Issue 33.5: without Content-Length the body was spooled whole before the size check."""
    front.files.config = FilesConfig(max_file_bytes=len(PNG), max_total_bytes=10 * len(PNG))
    boundary = "xyzzy"
    sent = []

    def body():
        yield (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.png"\r\n'
               "Content-Type: image/png\r\n\r\n").encode()  # fmt: skip
        for _ in range(64):  # 64 MiB of file, never all needed
            sent.append(1)
            yield b"\0" * (1 << 20)

    r = front.client.post(
        "/v1/files",
        content=body(),
        headers={
            "content-type": f"multipart/form-data; boundary={boundary}",
            "authorization": f"Bearer {ALICE}",
        },
    )
    assert r.status_code == 413 and "up to" in r.json()["error"]["message"]
    assert front.files.stored_bytes == 0
