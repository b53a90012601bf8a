"""Uploading HF exports to S3 (`saver.upload_s3`; cosmos-rl train.ckpt.upload_s3).

An export is hard-linked into a staging folder the moment it is renamed into place (no bytes copied), and a
single background thread uploads the staged files with boto3's managed transfer (multipart for large
files), then removes the staging folder. The training step never waits for the network, and pruning old
`step-*` exports (saver.max_keep) cannot take files from an upload under way. `close()` waits for what is
queued: the run ends once `final` is uploaded. A failed upload is one error line; the export stays on disk.
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from rlstream.common.config import ConfigError, S3UploadConfig

__all__ = ["S3Uploader", "object_prefix"]

log = logging.getLogger(__name__)


def object_prefix(cfg: S3UploadConfig, run: str, name: str) -> str:
    """The key prefix of export `name` of `run` ({experiment}/{trial}): {prefix}/{run}/{name}."""
    return "/".join(p.strip("/") for p in (cfg.prefix, run, name) if p.strip("/"))


class S3Uploader:
    """Uploads the export folders of `run` ({experiment}/{trial}) to `cfg.bucket` in the background, in the order
    they were written."""

    def __init__(self, cfg: S3UploadConfig, run: str) -> None:
        if not cfg.bucket:
            raise ConfigError("saver.upload_s3.bucket is empty: name the bucket the exports go to")
        try:
            import boto3
        except ImportError:
            raise ConfigError("saver.upload_s3 needs boto3: pip install 'rlstream[s3]'") from None
        self.cfg, self.run = cfg, run
        self._client = boto3.client("s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s3-upload")
        self._pending: list[Future] = []

    def submit(self, folder: Path) -> None:
        """Queue `folder` (an export just renamed into place): its files are linked into a staging folder now."""
        staged = folder.parent / f".upload-{folder.name}-{len(self._pending)}"
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(folder, staged, copy_function=os.link)
        self._pending.append(self._pool.submit(self._upload, staged, folder.name))

    def _upload(self, staged: Path, name: str) -> None:
        prefix = object_prefix(self.cfg, self.run, name)
        try:
            files = sorted(p for p in staged.rglob("*") if p.is_file())
            for path in files:
                self._client.upload_file(str(path), self.cfg.bucket, f"{prefix}/{path.relative_to(staged).as_posix()}")
            log.info("uploaded %s to s3://%s/%s (%d files)", name, self.cfg.bucket, prefix, len(files))
        except Exception as exc:  # noqa: BLE001 - reported; the export is on disk and the run goes on
            log.error("upload of checkpoint %s to s3://%s/%s failed: %s", name, self.cfg.bucket, prefix, exc)
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def close(self) -> None:
        """Wait for every queued upload (each logs its own outcome)."""
        for f in self._pending:
            f.result()
        self._pending = []
        self._pool.shutdown(wait=True)
