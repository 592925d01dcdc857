"""OpenAI's Files API for fine-tuning data: ``POST /v1/files`` (multipart ``file`` and
``purpose="fine-tune"``), ``GET /v1/files``, ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``
and ``DELETE /v1/files/{id}`` (409 while a job that is being set up, trained, queued or paused reads it).

An upload is kept only if the dataset loader of ``--finetune-data`` reads at least one usable
row from it (run in a worker thread, never on the event loop); malformed rows are counted in
the file object's ``coserve`` field, as ``coserve finetune`` skips them. Files live in
``DIR/files`` (``<id>.jsonl`` or ``.json`` and the file object as ``<id>.meta.json``), so a
restarted server lists them again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, BinaryIO

from fastapi import FastAPI, File, Form, HTTPException, Response, UploadFile

from coserve.core.finetune import DatasetError, FTDataset

logger = logging.getLogger(__name__)

DEFAULT_MAX_UPLOAD = 1 << 30
"""The largest upload a server takes by default (``--max-upload-mb``: 1,024)."""

NO_FILES = "the Files API needs a directory for uploads: start the server with --finetune-jobs DIR"


class FileStore:
    """The uploaded fine-tuning files of ``root`` (``DIR/files``), by id; an upload of more than
    ``max_bytes`` is refused (413)."""

    def __init__(self, root: Path, load: Callable[[Path], FTDataset], max_bytes: int = DEFAULT_MAX_UPLOAD) -> None:
        self.root = root
        self.load = load  # the dataset loader jobs use (the engine's tokenizer, the server's --max-seq-len)
        self.max_bytes = max_bytes
        root.mkdir(parents=True, exist_ok=True)
        self.files: dict[str, dict[str, Any]] = {}
        for meta in sorted(root.glob("*.meta.json"), key=lambda p: p.stat().st_mtime):
            try:
                obj = json.loads(meta.read_text())
                self.files[obj["id"]] = obj
            except (OSError, ValueError, KeyError) as e:
                logger.warning("%s: not a file object, skipped: %s", meta, e)

    def path(self, file_id: str) -> Path:
        """The data of file ``file_id``; KeyError when there is none."""
        return self.root / self.files[file_id]["coserve"]["stored_as"]

    def get(self, file_id: str) -> dict[str, Any]:
        obj = self.files.get(file_id)
        if obj is None:
            raise HTTPException(404, f"no file {file_id!r} on this server (POST /v1/files uploads one; "
                                     "GET /v1/files lists them)")
        return obj

    def add(self, filename: str, source: BinaryIO) -> dict[str, Any]:
        """Store the file ``source`` (read in chunks) if it holds a usable row (blocking: call it
        off the event loop); ValueError (DatasetError) saying why not: the first malformed rows'
        lines and reasons; HTTPException 413 past ``max_bytes``."""
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        suffix = ".json" if filename.lower().endswith(".json") else ".jsonl"
        path = self.root / f"{file_id}{suffix}"
        size = 0
        with path.open("wb") as out:
            while chunk := source.read(1 << 20):
                size += len(chunk)
                if size > self.max_bytes:
                    out.close()
                    path.unlink()
                    raise HTTPException(413, f"{filename}: larger than this server takes ({self.max_bytes} bytes, "
                                             "--max-upload-mb)")
                out.write(chunk)
        try:
            dataset = self.load(path)
        except DatasetError as e:
            path.unlink()
            raise ValueError(f"{filename}: {str(e).removeprefix(f'{path}: ')}") from e
        except BaseException:
            path.unlink()
            raise
        stats = dataset.stats
        skipped = dataset.skipped
        obj = {
            "id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
            "filename": filename, "purpose": "fine-tune", "status": "processed", "status_details": None,
            "coserve": {
                "stored_as": path.name, "rows": stats.num_rows, "samples": stats.num_samples,
                "malformed_rows": stats.num_skipped, "tokens": stats.num_tokens,
                "first_malformed": {"line": skipped[0].line, "reason": skipped[0].reason} if skipped else None,
            },
        }
        (self.root / f"{file_id}.meta.json").write_text(json.dumps(obj))
        self.files[file_id] = obj
        return obj

    def delete(self, file_id: str) -> None:
        """Forget ``file_id`` and remove its data (404 if there is none)."""
        self.get(file_id)
        path = self.path(file_id)
        del self.files[file_id]
        (self.root / f"{file_id}.meta.json").unlink(missing_ok=True)
        path.unlink(missing_ok=True)


def add_file_routes(app: FastAPI, store: FileStore | None, user: Callable[[str], str | None] = lambda _: None) -> None:
    """The Files API over ``store`` (None: a server without --finetune-jobs answers 404 saying so);
    ``user(file_id)``: the job that is being set up or trained on the file, if any."""

    def files() -> FileStore:
        if store is None:
            raise HTTPException(404, NO_FILES)
        return store

    @app.post("/v1/files")
    async def upload(file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]) -> dict[str, Any]:
        s = files()
        if purpose != "fine-tune":
            raise HTTPException(400, f"purpose: this server takes fine-tuning data only ('fine-tune'), got {purpose!r}")
        # (the upload is spooled to a temporary file; copied and read in chunks, and the loader
        # tokenizes every row: seconds for a large file)
        return await asyncio.to_thread(s.add, file.filename or "upload.jsonl", file.file)

    @app.get("/v1/files")
    async def list_files() -> dict[str, Any]:
        data = sorted(files().files.values(), key=lambda f: f["created_at"], reverse=True)
        return {"object": "list", "data": data, "has_more": False}

    @app.get("/v1/files/{file_id}")
    async def retrieve(file_id: str) -> dict[str, Any]:
        return files().get(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def content(file_id: str) -> Response:
        s = files()
        s.get(file_id)
        try:
            data = await asyncio.to_thread(s.path(file_id).read_bytes)
        except OSError as e:
            raise HTTPException(404, f"file {file_id!r}: its data cannot be read: {e}") from e
        return Response(data, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete(file_id: str) -> dict[str, Any]:
        s = files()
        s.get(file_id)
        job = user(file_id)
        if job is not None:
            raise HTTPException(409, f"file {file_id!r} is in use by fine-tuning job {job!r}: delete it once the "
                                     "job has ended, or cancel the job")
        await asyncio.to_thread(s.delete, file_id)
        return {"id": file_id, "object": "file", "deleted": True}
