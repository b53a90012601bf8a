"""Hub upload of HF exports (`trainer.upload.HubDestination`, saver.upload_hf) through huggingface_hub's own client
against a real HTTP server on 127.0.0.1 that answers the Hub's repository and commit API (the routes
`HfApi.whoami`, `create_repo`, `create_branch` and `upload_folder` call: /api/whoami-v2, /api/repos/create,
/api/models/{repo}/branch/{b}, /api/models/{repo}/preupload/{rev}, /api/models/{repo}/commit/{rev} with its
NDJSON body). huggingface.co is not reachable here; the server keeps what each commit carried, byte for byte."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rlstream.common.config import ConfigError, HubUploadConfig
from rlstream.trainer.checkpoint import Checkpointer
from rlstream.trainer.parallel import Parallel
from rlstream.trainer.upload import HubDestination, make_uploader

TOKEN = "hf_rlstream_test_token"


class HubState:
    def __init__(self) -> None:
        self.repos: dict[str, bool] = {}  # repo id -> private
        self.branches: set[tuple[str, str]] = set()
        self.commits: list[dict] = []  # {repo, revision, message, files: {path: bytes}}
        self.auth: set[str] = set()
        self.fail_commits = False


def _handler(state: HubState):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def do_GET(self) -> None:
            state.auth.add(self.headers.get("Authorization", ""))
            if self.path.startswith("/api/whoami-v2"):
                return self._reply(200, {"type": "user", "name": "tester", "auth": {}})
            self._reply(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            state.auth.add(self.headers.get("Authorization", ""))
            body, path = self._body(), self.path.split("?")[0]
            if path == "/api/repos/create":
                req = json.loads(body)
                repo = f"{req.get('organization') or 'tester'}/{req['name']}"
                if repo in state.repos:
                    return self._reply(409, {"error": "You already created this model repo",
                                             "url": f"http://{self.headers['Host']}/{repo}"})
                state.repos[repo] = bool(req.get("private"))
                return self._reply(200, {"url": f"http://{self.headers['Host']}/{repo}"})
            parts = path.split("/")  # ['', 'api', 'models', ns, name, route, rev]
            if len(parts) < 7 or parts[:3] != ["", "api", "models"]:
                return self._reply(404, {"error": f"no route {path}"})
            repo, route, rev = f"{parts[3]}/{parts[4]}", parts[5], "/".join(parts[6:])
            if repo not in state.repos:
                return self._reply(404, {"error": f"Repository {repo} not found"})
            if route == "branch":
                state.branches.add((repo, rev))
                return self._reply(200, {})
            if route == "preupload":  # every file as a regular git blob: its bytes come in the commit body
                files = json.loads(body)["files"]
                return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                   for f in files]})
            if route == "commit":
                if state.fail_commits:
                    return self._reply(500, {"error": "storage unavailable"})
                lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                header = next(x["value"] for x in lines if x["key"] == "header")
                files = {x["value"]["path"]: base64.b64decode(x["value"]["content"])
                         for x in lines if x["key"] == "file"}
                state.commits.append({"repo": repo, "revision": rev, "message": header["summary"], "files": files})
                oid = hashlib.sha1(str(len(state.commits)).encode()).hexdigest()
                return self._reply(200, {"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/{oid}",
                                         "commitOid": oid, "pullRequestUrl": None})
            self._reply(404, {"error": f"no route {path}"})

    return Handler


@pytest.fixture
def hub(monkeypatch):
    """(url, state) of a Hub API server on a free port; HF_TOKEN set for huggingface_hub to send. huggingface_hub's
    process-wide offline flag and endpoint, which a HubDestination sets, are restored afterwards."""
    from huggingface_hub import constants
    from huggingface_hub.utils import reset_sessions

    state = HubState()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)
    monkeypatch.setattr(constants, "ENDPOINT", constants.ENDPOINT)
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    server.server_close()
    monkeypatch.undo()
    reset_sessions()


@pytest.fixture
def upload_log():
    """The log lines of rlstream.trainer.upload (its loggers do not propagate to caplog), INFO and up."""
    records: list[logging.LogRecord] = []
    keep = logging.Handler(logging.INFO)
    keep.emit = records.append
    logger = logging.getLogger("rlstream.trainer.upload")
    level, logger.level = logger.level, logging.INFO
    logger.addHandler(keep)
    yield records
    logger.removeHandler(keep)
    logger.setLevel(level)


def _exports(tmp_path: Path, tiny_model_path: Path, uploader, names=("step-1", "step-2", "final")) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ckpt = Checkpointer(tmp_path, Parallel(), str(tiny_model_path), keep_hf=1, uploader=uploader)
    for name in names:
        ckpt.save_hf(model, model, name)
    ckpt.close()
    return tmp_path / "checkpoints"


def _local_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_final_export_lands_at_the_root_of_a_private_repo_under_the_tokens_user(hub, upload_log, tmp_path,
                                                                                    tiny_model_path):
    url, state = hub
    cfg = HubUploadConfig(repo_id="tiny-rl", endpoint=url)  # a bare name: cosmos-rl's whoami()/name
    saved = _exports(tmp_path, tiny_model_path, make_uploader(None, cfg, "exp/trial0"))
    assert state.repos == {"tester/tiny-rl": True}
    (commit,) = state.commits  # exports: final — the periodic ones stay local
    assert commit["repo"] == "tester/tiny-rl" and commit["revision"] == "main"
    assert commit["message"] == "rlstream exp/trial0: final"
    assert commit["files"] == _local_files(saved / "final")  # every file, byte for byte, at the repo root
    assert "model.safetensors" in commit["files"] and "config.json" in commit["files"]
    assert state.auth == {f"Bearer {TOKEN}"}  # the token from the environment, never from the config
    assert not list(saved.glob(".upload-*"))
    assert [r.getMessage() for r in upload_log if r.levelno >= logging.WARNING] == []
    assert any(r.getMessage().startswith("uploaded final to hf://tester/tiny-rl@main/ (commit ") for r in upload_log)


def test_every_export_in_its_own_folder_on_a_branch_one_commit_each(hub, upload_log, tmp_path, tiny_model_path):
    url, state = hub
    cfg = HubUploadConfig(repo_id="team/run-a", endpoint=url, exports="all", path_in_repo="ckpts/", revision="rl",
                          private=False)
    saved = _exports(tmp_path, tiny_model_path, make_uploader(None, cfg, "exp/t"))
    assert state.repos == {"team/run-a": False} and state.branches == {("team/run-a", "rl")}
    assert [(c["revision"], c["message"]) for c in state.commits] == [
        ("rl", f"rlstream exp/t: {n}") for n in ("step-1", "step-2", "final")]
    final = _local_files(saved / "final")
    for commit, name in zip(state.commits, ("step-1", "step-2", "final")):
        assert sorted(commit["files"]) == sorted(f"ckpts/{name}/{f}" for f in final), name
    # step-1 was pruned (max_keep 1) right after step-2 was written: its upload, queued before, still sent it whole
    assert not (saved / "step-1").exists()
    assert {k.rsplit("/", 1)[1]: v for k, v in state.commits[2]["files"].items()} == final
    assert [r.getMessage().split(" (commit")[0] for r in upload_log if r.getMessage().startswith("uploaded")] == [
        f"uploaded {n} to hf://team/run-a@rl/ckpts/{n}" for n in ("step-1", "step-2", "final")]


def test_a_failed_commit_is_one_error_line_and_the_export_stays(hub, upload_log, tmp_path, tiny_model_path):
    url, state = hub
    state.fail_commits = True
    saved = _exports(tmp_path, tiny_model_path, make_uploader(None, HubUploadConfig(repo_id="t/r", endpoint=url),
                                                              "exp/t"), names=("final",))
    errors = [r.getMessage() for r in upload_log if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("upload of checkpoint final to hf://t/r@main/ failed: "), errors
    assert (saved / "final" / "model.safetensors").is_file() and not list(saved.glob(".upload-*"))


@pytest.mark.parametrize("repo_id", ["", "a/b/c", "/"])
def test_a_repo_id_that_names_no_repository_is_refused(repo_id):
    with pytest.raises(ConfigError, match=r"^saver.upload_hf.repo_id=.*namespace/name"):
        HubDestination(HubUploadConfig(repo_id=repo_id), "exp/t")


@pytest.mark.slow
def test_rlstream_run_uploads_its_final_export_from_an_offline_process(hub, tmp_path):
    """As a user runs it: `rlstream run` starts the trainer with HF_HUB_OFFLINE=1 (launcher/procs.py, a fork of the
    preloaded fork server); saver.upload_hf still commits the final export, and the run ends after it."""
    import os
    import subprocess
    import sys

    url, state = hub
    root = Path(__file__).resolve().parents[2]
    small = ["launcher.demo.n_train=256", "launcher.demo.n_valid=16", "launcher.eval_n=0", "launcher.sft_steps=20",
             "rollout.consumer_batch_size=4", "gconfig.n_samples=4", "stats_logger.tensorboard.enabled=false",
             "total_train_steps=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_TOKEN": TOKEN}
    proc = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "run", "--config",
                           str(root / "configs" / "tiny-cpu.yaml"), f"cluster.fileroot={tmp_path / 'runs'}", *small,
                           "saver.upload_hf.repo_id=tiny-run", f"saver.upload_hf.endpoint={url}"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=420)
    run_dir = tmp_path / "runs" / "tiny-cpu" / "run0"
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (commit,) = state.commits
    assert commit["repo"] == "tester/tiny-run" and commit["message"] == "rlstream tiny-cpu/run0: final"
    assert commit["files"] == _local_files(run_dir / "checkpoints" / "final")
    assert state.auth == {f"Bearer {TOKEN}"}
    assert "uploaded final to hf://tester/tiny-run@main/ (commit " in (run_dir / "logs" / "trainer.log").read_text()
