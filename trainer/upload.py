"""Uploading HF exports besides the run folder: S3 (`saver.upload_s3`; cosmos-rl train.ckpt.upload_s3) and a
Hugging Face Hub model repository (`saver.upload_hf`; cosmos-rl train.ckpt.upload_hf).

An export is hard-linked into a staging folder the moment it is renamed into place (no bytes copied), and a
single background thread sends the staged files to each destination, then removes the staging folder. The
training step never waits for the network, and pruning old `step-*` exports (saver.max_keep) cannot take files
from an upload under way. `close()` waits for what is queued: the run ends once `final` is uploaded. A failed
upload is one error line per destination; the export stays on disk.

A destination is a small interface (`Destination.send`); `make_uploader` picks them from the config.
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from rlstream.common.config import ConfigError, HubUploadConfig, S3UploadConfig

__all__ = ["Destination", "S3Destination", "HubDestination", "ExportUploader", "make_uploader", "object_prefix"]

log = logging.getLogger(__name__)


class Destination(Protocol):
    """Where staged exports go. `wants(name)`: whether export `name` (step-N or final) is sent here; `where(name)`:
    its address there, for the log lines; `send` uploads the folder's files and says what it did (raises on
    failure)."""

    def wants(self, name: str) -> bool: ...

    def where(self, name: str) -> str: ...

    def send(self, staged: Path, name: str) -> str: ...


def object_prefix(cfg: S3UploadConfig, run: str, name: str) -> str:
    """The key prefix of export `name` of `run` ({experiment}/{trial}): {prefix}/{run}/{name}."""
    return "/".join(p.strip("/") for p in (cfg.prefix, run, name) if p.strip("/"))


class S3Destination:
    """Every export to `cfg.bucket` under {prefix}/{run}/{name}/, with boto3's managed transfer (multipart for large
    files)."""

    def __init__(self, cfg: S3UploadConfig, run: str) -> None:
        if not cfg.bucket:
            raise ConfigError("saver.upload_s3.bucket is empty: name the bucket the exports go to")
        try:
            import boto3
        except ImportError:
            raise ConfigError("saver.upload_s3 needs boto3: pip install 'rlstream[s3]'") from None
        self.cfg, self.run = cfg, run
        self._client = boto3.client("s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region)

    def wants(self, name: str) -> bool:
        return True

    def where(self, name: str) -> str:
        return f"s3://{self.cfg.bucket}/{object_prefix(self.cfg, self.run, name)}"

    def send(self, staged: Path, name: str) -> str:
        prefix = object_prefix(self.cfg, self.run, name)
        files = sorted(p for p in staged.rglob("*") if p.is_file())
        for path in files:
            self._client.upload_file(str(path), self.cfg.bucket, f"{prefix}/{path.relative_to(staged).as_posix()}")
        return f"{len(files)} files"


class HubDestination:
    """The final export (or every one) to a Hub model repository, one commit per export (huggingface_hub's
    `upload_folder`: large files go through the Hub's LFS/Xet storage as the Hub asks). The repository and branch
    are created on the first upload."""

    def __init__(self, cfg: HubUploadConfig, run: str) -> None:
        if not cfg.repo_id.strip("/") or cfg.repo_id.count("/") > 1:
            raise ConfigError(f"saver.upload_hf.repo_id={cfg.repo_id!r}: give the model repository as "
                              "namespace/name (or a bare name, under the token's user)")
        from huggingface_hub import HfApi, constants
        from huggingface_hub.utils import reset_sessions

        if constants.HF_HUB_OFFLINE:
            # rlstream starts its processes offline (HF_HUB_OFFLINE=1, launcher/procs.py): models load from local
            # folders and nothing reaches a hub by accident. These uploads are the one hub access the config asks
            # for, so this process goes online (its datasets stay offline: common/hub_datasets.py).
            constants.HF_HUB_OFFLINE = False
            reset_sessions()
            log.info("saver.upload_hf: huggingface_hub online in this process for the uploads")
        if cfg.endpoint:
            # huggingface_hub reads the URLs a server answers (repo, commit) against its process-wide endpoint
            # ($HF_ENDPOINT at import), not the client's: a Hub-compatible server must be that endpoint.
            constants.ENDPOINT = cfg.endpoint.rstrip("/")
        self.cfg, self.run = cfg, run
        self._api = HfApi(endpoint=cfg.endpoint)  # token: HF_TOKEN or the saved login, as huggingface_hub finds it
        self._repo: str | None = None  # namespace/name once the repository exists

    def wants(self, name: str) -> bool:
        return self.cfg.exports == "all" or name == "final"

    def _ensure_repo(self) -> str:
        if self._repo is None:
            repo = self.cfg.repo_id if "/" in self.cfg.repo_id else f"{self._api.whoami()['name']}/{self.cfg.repo_id}"
            self._api.create_repo(repo, private=self.cfg.private, exist_ok=True, repo_type="model")
            if self.cfg.revision != "main":
                self._api.create_branch(repo, branch=self.cfg.revision, exist_ok=True)
            self._repo = repo
        return self._repo

    def _folder(self, name: str) -> str:
        folder = self.cfg.path_in_repo.strip("/")
        return f"{folder}/{name}".strip("/") if self.cfg.exports == "all" else folder

    def where(self, name: str) -> str:
        return f"hf://{self._repo or self.cfg.repo_id}@{self.cfg.revision}/{self._folder(name)}"

    def send(self, staged: Path, name: str) -> str:
        repo = self._ensure_repo()
        info = self._api.upload_folder(repo_id=repo, folder_path=staged, path_in_repo=self._folder(name) or None,
                                       revision=self.cfg.revision, commit_message=f"rlstream {self.run}: {name}")
        return f"commit {str(info.oid)[:10]}"


class ExportUploader:
    """Sends the export folders of one run to its destinations in the background, in the order they were written."""

    def __init__(self, destinations: list[Destination]) -> None:
        self.destinations = destinations
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="export-upload")
        self._pending: list[Future] = []

    def submit(self, folder: Path) -> None:
        """Queue `folder` (an export just renamed into place): its files are linked into a staging folder now."""
        targets = [d for d in self.destinations if d.wants(folder.name)]
        if not targets:
            return
        staged = folder.parent / f".upload-{folder.name}-{len(self._pending)}"
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(folder, staged, copy_function=os.link)
        self._pending.append(self._pool.submit(self._upload, staged, folder.name, targets))

    @staticmethod
    def _upload(staged: Path, name: str, targets: list[Destination]) -> None:
        try:
            for dest in targets:
                try:
                    done = dest.send(staged, name)
                    log.info("uploaded %s to %s (%s)", name, dest.where(name), done)
                except Exception as exc:  # noqa: BLE001 - reported; the export is on disk and the run goes on
                    log.error("upload of checkpoint %s to %s failed: %s", name, dest.where(name), exc)
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def close(self) -> None:
        """Wait for every queued upload (each logs its own outcome)."""
        for f in self._pending:
            f.result()
        self._pending = []
        self._pool.shutdown(wait=True)


def make_uploader(s3: S3UploadConfig | None, hub: HubUploadConfig | None, run: str) -> ExportUploader | None:
    """The uploader of the destinations the config names (`saver.upload_s3`, `saver.upload_hf`); None for none."""
    destinations: list[Destination] = []
    if s3 is not None:
        destinations.append(S3Destination(s3, run))
    if hub is not None:
        destinations.append(HubDestination(hub, run))
    return ExportUploader(destinations) if destinations else None
