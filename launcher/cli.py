"""The `rlstream` command line.

Every command that takes a config accepts `--config FILE` followed by dotted overrides
in AReaL's style: `rlstream train --config configs/x.yaml actor.optimizer.lr=1e-4`.
Bad configs and unreachable brokers are one clear line and a non-zero exit, never a
stack trace. Each command's body lives in the module that owns the concept; this file
only parses arguments and maps errors to exit codes.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from rlstream.common.memory import keep_freed_memory, pause_gc_until_started

OVERRIDES_HELP = ("Any config key can be overridden after the options as KEY=VALUE, dotted for nested keys: "
                  "`rlstream run --config configs/tiny-cpu.yaml total_train_steps=600 actor.optimizer.lr=1e-4`. "
                  "`rlstream config docs` lists every key with its default.")
app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help=f"rlstream: asynchronous RL post-training on Redis streams.\n\n{OVERRIDES_HELP}")
config_app = typer.Typer(no_args_is_help=True, help="Show and document configuration.")
launch_app = typer.Typer(no_args_is_help=True, help="Launch on a cluster scheduler (Slurm, Ray).")
model_app = typer.Typer(no_args_is_help=True, help="Prepare local model folders (no hub at run time).")
app.add_typer(config_app, name="config")
app.add_typer(launch_app, name="launch")
app.add_typer(model_app, name="model")
trace_app = typer.Typer(no_args_is_help=True, help="Perf-tracer files (perf_tracer.enabled=true) of a run.")
app.add_typer(trace_app, name="trace")

EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}
KV = "[OPTIONS] [KEY=VALUE]..."  # usage line of the commands that take config overrides
ConfigOpt = typer.Option(None, "--config", "-c", help="YAML config file; KEY=VALUE overrides may follow the options.")


def _fail(msg: str, code: int = 1) -> None:
    typer.echo(f"rlstream: error: {msg}", err=True)
    raise typer.Exit(code)


def load(config: Optional[str], overrides: list[str]):
    """Load the config or exit 2 with the one-line reason."""
    from rlstream.common.config import ConfigError, load_config

    try:
        return load_config(config, overrides)
    except ConfigError as exc:
        _fail(str(exc), 2)


def _guard(fn, *args, **kwargs):
    """Run a command body, turning known failures into one line."""
    from rlstream.broker.connection import BrokerError
    from rlstream.common.config import ConfigError

    try:
        return fn(*args, **kwargs)
    except ConfigError as exc:
        _fail(str(exc), 2)
    except BrokerError as exc:
        _fail(str(exc), 1)
    except KeyboardInterrupt:
        typer.echo("rlstream: interrupted", err=True)
        raise typer.Exit(130)


def _exit_after_clean_stop() -> None:
    """Exit 0 now, skipping Python's finalization: for `serve` and `train` once they stopped cleanly.

    By then everything the command owns is released and flushed (registrations, weight
    groups, checkpoints, stats files). But a gloo thread still blocked in a collective of
    a group whose peer died cannot be cancelled, and when it wakes during interpreter
    finalization it is unwound through C++ frames and the process aborts ("terminate
    called without an active exception", exit -6; seen in CI after an engine died mid-push).
    """
    import logging
    import os

    from rlstream.common.tracing import close_all

    close_all()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


@config_app.command("show", context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def config_show(ctx: typer.Context, config: Optional[str] = ConfigOpt,
                as_json: bool = typer.Option(False, "--json", help="JSON instead of YAML.")) -> None:
    """Print the resolved config (secrets masked)."""
    from omegaconf import OmegaConf

    from rlstream.common.config import masked_config_dict

    cfg = load(config, ctx.args)
    data = masked_config_dict(cfg)
    typer.echo(json.dumps(data, indent=2) if as_json else OmegaConf.to_yaml(OmegaConf.create(data)))


def _import(system: str, file: str) -> None:
    """Translate a config of another system: the rlstream YAML on stdout, the summary on stderr; exit 2 and
    nothing on stdout when the file cannot be imported."""
    import yaml

    from rlstream.common.config import ConfigError, load_config_dict
    from rlstream.common.importers.reader import NAMES, import_file

    try:
        t = import_file(system, file)
        load_config_dict(t.config)  # what we print must load
    except ConfigError as exc:
        msg = str(exc)
        _fail(msg if file in msg else f"{file}: {msg}", 2)
    header = [f"translated from {NAMES[system]} {file} by rlstream config import --from {system}", *t.summary().splitlines()]
    typer.echo("\n".join(f"# {line}" for line in header) + "\n" + yaml.safe_dump(t.config, sort_keys=False))
    typer.echo(t.summary(), err=True)


@config_app.command("import")
def config_import(file: str = typer.Argument(..., help="The config file to translate."),
                  from_: str = typer.Option(..., "--from", help="Its system: areal, roll, cosmos (TOML) or rlinf.")) -> None:
    """Translate an AReaL, ROLL, cosmos-rl or RLinf config: `rlstream config import --from roll FILE > mine.yaml`.
    Every key ends up same, translated or dropped with the reason (summary on stderr)."""
    _import(from_, file)


@config_app.command("import-areal")
def config_import_areal(file: str = typer.Argument(..., help="An AReaL experiment YAML (e.g. examples/math/gsm8k_grpo.yaml).")) -> None:
    """`rlstream config import --from areal FILE`: the rlstream YAML on stdout, the summary on stderr."""
    _import("areal", file)


@config_app.command("coverage")
def config_coverage(check: bool = typer.Option(False, "--check", help="Compare with the file instead of writing it; exit 1 with the differing rows when stale."),
                    out: Optional[str] = typer.Option(None, "--file", help="The table (default: docs/coverage.md of the repository)."),
                    seeds: Optional[str] = typer.Option(None, "--seeds", help="The configuration references (default: ../shared/seeds next to the repository).")) -> None:
    """The coverage table: every key of the AReaL, ROLL, cosmos-rl and RLinf references and what rlstream does with it."""
    from pathlib import Path

    from rlstream.common.importers.coverage import differences, render
    from rlstream.common.importers.seeds import SEED_FILES, SNAPSHOT, SeedError, seed_dir, write_snapshot

    root = Path(__file__).resolve().parents[1]
    path = Path(out) if out else root / "docs" / "coverage.md"
    folder = Path(seeds) if seeds else seed_dir(root)
    present = all((folder / name).is_file() for name in SEED_FILES.values())
    if not present:  # a clone without the references beside it: their keys as last parsed (the snapshot)
        typer.echo(f"the references are not at {folder}: using their keys in {SNAPSHOT}", err=True)
    try:
        text = render(folder)
        if present and not check:
            write_snapshot(folder)
    except SeedError as exc:
        _fail(str(exc), 2)
    if not check:
        path.write_text(text, encoding="utf-8")
        typer.echo(f"wrote {path}", err=True)
        return
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    diff = differences(text, old)
    if diff:
        typer.echo("\n".join(diff), err=True)
        _fail(f"{path} is stale ({len(diff)} rows differ); regenerate it with `rlstream config coverage`", 1)
    typer.echo(f"{path} is up to date", err=True)


@config_app.command("docs")
def config_docs(section: Optional[str] = typer.Argument(
        None, help="Only the keys of this section, e.g. actor.optimizer (default: every key).")) -> None:
    """Every config key, one line each: `key = default  # (type) description`, read from the schema's field
    docstrings (defaults as YAML/JSON; sections `(section)`)."""
    from rlstream.common.config import field_reference

    rows = field_reference()
    if section:
        rows = [r for r in rows if r.key == section or r.key.startswith(section + ".")]
        if not rows:
            sections = sorted({r.key.split(".")[0] for r in field_reference() if "." in r.key})
            _fail(f"no config key or section '{section}' (sections: {', '.join(sections)})", 2)
    for r in rows:
        typer.echo(f"{r.key} = {r.default}  # ({r.type}) {r.doc}")


@app.command(context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def inspect(ctx: typer.Context,
            redis: Optional[str] = typer.Option(None, "--redis", help="Redis URL (default: the config's redis.url)."),
            namespace: Optional[str] = typer.Option(None, "--namespace", "-n", help="rlstream:{experiment}:{trial} (default: from the config)."),
            config: Optional[str] = ConfigOpt,
            as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
            watch: Optional[float] = typer.Option(None, "--watch", "-w", help="Refresh every N seconds until Ctrl-C."),
            list_: bool = typer.Option(False, "--list", help="List the namespaces present."),
            show: Optional[str] = typer.Option(None, "--show", metavar="N|ID", help="Decode the newest N stream entries (or the entry ID) into the conversations they hold."),
            dead: bool = typer.Option(False, "--dead", help="With --show: dead letters instead of stream entries."),
            slowest: Optional[int] = typer.Option(None, "--slowest", metavar="N", help="The N slowest rollouts from the run's sessions.jsonl (perf_tracer.session_tracer.enabled)."),
            ) -> None:
    """Queue depth, lag, pending, versions, admission, staleness, dead letters, throughput."""
    from rlstream.launcher.inspect_view import inspect_main

    cfg = load(config, ctx.args)
    if show is not None or slowest is not None:
        from rlstream.launcher.inspect_show import show_main, slowest_main

        if show is not None:
            raise typer.Exit(_guard(show_main, cfg, show, redis_url=redis, namespace=namespace, as_json=as_json,
                                    dead=dead))
        raise typer.Exit(slowest_main(cfg, slowest, as_json=as_json))
    _guard(inspect_main, cfg, redis_url=redis, namespace=namespace, as_json=as_json, watch=watch, list_only=list_)


@app.command(context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def compose(ctx: typer.Context, config: Optional[str] = ConfigOpt,
            file: str = typer.Option("docker-compose.yml", "--file", "-f", help="The rlstream compose file whose policy engine the pools' services copy."),
            output: Optional[str] = typer.Option(None, "--output", "-o", help="Where to write (default: docker-compose.override.yml beside --file, which `docker compose up` merges; '-' = stdout).")) -> None:
    """Write the docker compose services of the config's scoring pools (reward model, judge, teachers)."""
    from rlstream.launcher.compose import load_compose_file, override_document, write_override

    cfg = load(config, ctx.args)
    made_from = " ".join(["from", f"--config {config}" if config else "the defaults", *ctx.args])
    if output == "-":
        typer.echo(_guard(lambda: override_document(cfg, load_compose_file(file), made_from)), nl=False)
    else:
        typer.echo(_guard(write_override, cfg, file, output, made_from))


@app.command(context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def serve(ctx: typer.Context, config: Optional[str] = ConfigOpt,
          simulate: bool = typer.Option(False, "--simulate", help="A simulated GPU engine (server.simulate.*): same protocol, modeled timing, no model."),
          pool: Optional[str] = typer.Option(None, "--pool", help="Serve this scoring pool's model instead of the policy (reward_model: /classify; judge: /generate; a distillation teacher: /generate prefill logprobs).")) -> None:
    """Run the local inference engine (SGLang-compatible HTTP subset), or an engine of a scoring pool (--pool)."""
    pause_gc_until_started()  # until the model is served (run_server, run_scoring_server)
    from rlstream.engine.server import serve as serve_main

    cfg = load(config, [*ctx.args, *(["server.simulate.enabled=true"] if simulate else [])])
    if pool is not None:
        from rlstream.engine.scoring import serve_scoring

        _guard(serve_scoring, cfg, pool)
        _exit_after_clean_stop()
        return
    make_engine = None
    if cfg.server.simulate.enabled:
        from rlstream.sim.serving import SimulatedServing

        make_engine = SimulatedServing.from_config
    _guard(serve_main, cfg, make_engine=make_engine)
    _exit_after_clean_stop()


@app.command(context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def produce(ctx: typer.Context, config: Optional[str] = ConfigOpt) -> None:
    """Run one rollout producer: dataset -> engines -> rewards -> Redis."""
    from rlstream.producer.main import produce as produce_main

    keep_freed_memory()
    code = _guard(produce_main, load(config, ctx.args))
    raise typer.Exit(code or 0)


@app.command(context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def gateway(ctx: typer.Context, config: Optional[str] = ConfigOpt) -> None:
    """Serve an OpenAI-compatible API that records agents' calls as training episodes (docs/agentic.md)."""
    from rlstream.producer.gateway import serve as gateway_main

    keep_freed_memory()
    _guard(gateway_main, load(config, ctx.args))


@app.command(context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def train(ctx: typer.Context, config: Optional[str] = ConfigOpt) -> None:
    """Run the trainer (one process, or each rank under torchrun)."""
    pause_gc_until_started()  # until the step loop starts (Trainer.train)
    from rlstream.trainer.main import train as train_main

    keep_freed_memory()
    _guard(train_main, load(config, ctx.args))
    _exit_after_clean_stop()


@app.command(context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def sft(ctx: typer.Context, config: Optional[str] = ConfigOpt) -> None:
    """Supervised warm start of actor.path on the training answers."""
    from rlstream.launcher.sft import sft as sft_main

    _guard(sft_main, load(config, ctx.args))


@app.command(context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def rw(ctx: typer.Context, config: Optional[str] = ConfigOpt) -> None:
    """Train a Bradley-Terry reward model on chosen/rejected pairs (rw.*); prints held-out pair accuracy."""
    from rlstream.launcher.rw import rw as rw_main

    _guard(rw_main, load(config, ctx.args))


@app.command(context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def run(ctx: typer.Context, config: Optional[str] = ConfigOpt,
        redis: Optional[str] = typer.Option(None, "--redis", help="Use this Redis instead of starting one."),
        web_page: bool = typer.Option(False, "--web", help="Serve the live web page too (launcher.web.*).")) -> None:
    """Run a whole job on this machine: Redis, engines, producers and the trainer."""
    from rlstream.launcher.local import run as run_main

    if config is None:
        _fail("rlstream run needs a config: --config FILE (e.g. --config configs/tiny-cpu.yaml), "
              "then any KEY=VALUE overrides", 2)
    code = _guard(run_main, load(config, [*ctx.args, *(["launcher.web.enabled=true"] if web_page else [])]),
                  redis_url=redis)
    raise typer.Exit(code or 0)


@app.command(context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def web(ctx: typer.Context, config: Optional[str] = ConfigOpt,
        redis: Optional[str] = typer.Option(None, "--redis", help="Redis URL (default: the config's redis.url)."),
        port: Optional[int] = typer.Option(None, "--port", help="Port (default: launcher.web.port; 0 = any free one)."),
        host: Optional[str] = typer.Option(None, "--host", help="Address (default: launcher.web.host).")) -> None:
    """Serve the live web page of the config's run (curves, queue, admission, staleness, engines) until Ctrl-C."""
    from rlstream.launcher.web import serve as web_main

    raise typer.Exit(_guard(web_main, load(config, ctx.args), redis_url=redis, port=port, host=host) or 0)


@app.command(context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def chaos(ctx: typer.Context, config: Optional[str] = ConfigOpt,
          duration: float = typer.Option(120.0, "--duration", help="Seconds of fault injection."),
          seed: int = typer.Option(0, "--seed", help="Seed of the fault schedule."),
          mean_gap: float = typer.Option(15.0, "--mean-gap", help="Mean seconds between two faults."),
          agent: bool = typer.Option(False, "--agent", help="Also run `rlstream gateway` and an openai-SDK agent "
                                     "driving it (killed too)."),
          ray_nodes: int = typer.Option(0, "--ray-nodes", help="Run on a Ray cluster of this machine with this many "
                                        "worker nodes (an engine and a producer each) and remove nodes: crashed or "
                                        "drained, then replaced.")) -> None:
    """`rlstream run` with its children and Redis killed/stopped/restarted at seeded moments; prints the ledger."""
    from rlstream.launcher.chaos import AGENT_OVERRIDES, CHAOS_OVERRIDES
    from rlstream.launcher.chaos import chaos as chaos_main

    if config is None:
        _fail("rlstream chaos needs a config: --config FILE (e.g. --config configs/tiny-cpu.yaml)", 2)
    overrides = [*CHAOS_OVERRIDES, *(AGENT_OVERRIDES if agent else [])]
    if ray_nodes:
        from rlstream.launcher.chaos_ray import RAY_OVERRIDES

        overrides += RAY_OVERRIDES
    result = _guard(chaos_main, load(config, [*overrides, *ctx.args]), duration, seed, mean_gap, agent, ray_nodes)
    bad = {k: result[k] for k in ("lost", "trained_twice", "unaccounted", "over_admissions", "in_two_states",
                                  "unscored_groups") if result[k]}
    if result["steps_after_faults"] < 1:
        bad["steps_after_faults"] = 0  # stalled: no step after the last fault
    raise typer.Exit(1 if bad else 0)


@app.command(context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def report(ctx: typer.Context, config: Optional[str] = ConfigOpt) -> None:
    """Follow a run until the trainer finishes, then write its plots and summary."""
    from rlstream.launcher.report import report as report_main

    raise typer.Exit(_guard(report_main, load(config, ctx.args)) or 0)


@launch_app.command("slurm", context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def launch_slurm(ctx: typer.Context, config: Optional[str] = ConfigOpt,
                 dry_run: bool = typer.Option(False, "--dry-run", help="Print the sbatch script only."),
                 redis: Optional[str] = typer.Option(None, "--redis", help="External Redis URL (default: start one on the first node).")) -> None:
    """Build and submit an sbatch script for engines, producers, trainer and Redis."""
    from rlstream.launcher.slurm import launch as slurm_main

    code = _guard(slurm_main, load(config, ctx.args), dry_run=dry_run, redis_url=redis)
    raise typer.Exit(code or 0)


@launch_app.command("ray", context_settings=EXTRA, options_metavar=KV, epilog=OVERRIDES_HELP)
def launch_ray(ctx: typer.Context, config: Optional[str] = ConfigOpt,
               address: Optional[str] = typer.Option(None, "--address", help="Ray cluster (GCS host:port, or auto); default: launcher.ray.address, $RAY_ADDRESS, else a one-node Ray."),
               redis: Optional[str] = typer.Option(None, "--redis", help="Use this Redis instead of starting one on this node."),
               submit: Optional[str] = typer.Option(None, "--submit", help="Submit the launch as a Ray job to this job server (http://HEAD:8265) and print its logs until it ends.")) -> None:
    """Run the job on a Ray cluster: engines, producers and trainer ranks as Ray actors (docs/launcher.md, Ray)."""
    from rlstream.launcher.ray import launch as ray_main

    if config is None:
        _fail("rlstream launch ray needs a config: --config FILE, then any KEY=VALUE overrides", 2)
    if submit:
        from rlstream.launcher.ray_submit import submit as submit_main

        if address:
            _fail(f"--address={address} with --submit: the job runs on the head and finds its cluster itself", 2)
        code = _guard(submit_main, load(config, ctx.args), config, list(ctx.args), submit, redis_url=redis)
        raise typer.Exit(code or 0)
    code = _guard(ray_main, load(config, ctx.args), address=address, redis_url=redis)
    raise typer.Exit(code or 0)


@model_app.command("get")
def model_get(name: str = typer.Argument(..., help="A known model (see `rlstream model list`)."),
              cache_dir: Optional[str] = typer.Option(None, "--cache-dir", help="Model cache (default: $RLSTREAM_MODEL_CACHE or ~/.cache/rlstream/models)."),
              dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
              force: bool = typer.Option(False, "--force", help="Convert again even if the folder is ready.")) -> None:
    """Fetch, convert and check a known model once; print its folder (instant when cached)."""
    from rlstream.launcher.models import ModelPrepError, get_model

    if dtype not in ("float32", "bfloat16", "float16"):
        _fail(f"--dtype {dtype!r}; allowed: float32, bfloat16, float16", 2)
    try:
        path = get_model(name, cache_dir=cache_dir, dtype=dtype, force=force,
                         progress=lambda msg: typer.echo(f"rlstream: {msg}", err=True))
    except ModelPrepError as exc:
        _fail(str(exc))
    typer.echo(str(path))


@model_app.command("list")
def model_list(cache_dir: Optional[str] = typer.Option(None, "--cache-dir", help="Model cache to look in.")) -> None:
    """Known models and the dtypes already prepared."""
    from rlstream.common.models import prepared_model_dir
    from rlstream.launcher.models import list_models

    for name, desc, ready in list_models(cache_dir):
        where = ", ".join(f"{d}: {prepared_model_dir(name, d, cache_dir)}" for d in ready) or "not prepared"
        typer.echo(f"{name}  {desc}  [{where}]")


@app.command(context_settings=EXTRA, add_help_option=False)
def sim(ctx: typer.Context) -> None:
    """Capacity planner: the real control plane against simulated engines (`rlstream sim --help`; CI: --quick)."""
    from rlstream.launcher.redis_child import RedisChild
    from rlstream.sim.main import main as sim_main, parser

    parser().parse_args(ctx.args)  # --help and bad options answer before a redis-server starts
    redis = RedisChild()
    try:
        code = sim_main(ctx.args, redis.url)
    finally:
        redis.stop()
    raise typer.Exit(code)


@trace_app.command("merge")
def trace_merge(run_dir: str = typer.Argument(..., help="The run folder ({cluster.fileroot}/{experiment}/{trial})."),
                out: Optional[str] = typer.Option(None, "--out", "-o", help="Output file (default: RUN_DIR/trace/merged.trace.json).")) -> None:
    """Merge every process's trace into one timeline for Perfetto or `rlstream trace view`."""
    from rlstream.launcher.trace_merge import coverage, merge_traces

    try:
        path = merge_traces(run_dir, out)
    except (FileNotFoundError, OSError) as exc:
        _fail(str(exc), 1)
    doc = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    for pid, frac in sorted(coverage(doc["traceEvents"]).items()):
        typer.echo(f"  {names.get(pid, pid)}: spans cover {100 * frac:.1f}% of its traced time")
    for src in doc["otherData"]["sources"]:
        if "error" in src:
            typer.echo(f"  skipped {src['file']}: {src['error']}", err=True)
    typer.echo(f"wrote {path} ({len(doc['traceEvents'])} events); open it in Perfetto (ui.perfetto.dev) or `rlstream trace view`")


@trace_app.command("view")
def trace_view(run_dir: str = typer.Argument(..., help="The run folder (its trace is merged first when not yet), or a trace file."),
               png: Optional[str] = typer.Option(None, "--png", help="Draw one track into this PNG (headless Chromium) instead of serving the page."),
               track: str = typer.Option("trainer", "--track", help="With --png: the first track whose title holds this text (process or thread name)."),
               port: int = typer.Option(0, "--port", help="Serve the viewer on this port of 127.0.0.1 (0: a free one).")) -> None:
    """Open the run's merged trace in speedscope (vendored, offline); Perfetto opens the same file."""
    from rlstream.launcher.trace_view import TraceServer, merged_trace, screenshot

    try:
        trace_file = merged_trace(run_dir)
        if png is not None:
            title = screenshot(trace_file, png, track)
            typer.echo(f"wrote {png}: {title} of {trace_file}")
            return
        server = TraceServer(trace_file, port)
    except (FileNotFoundError, OSError, RuntimeError, ValueError) as exc:
        _fail(f"trace view: {exc}", 1)
    typer.echo(f"speedscope on {trace_file}: {server.url}  (Ctrl-C stops; n / p switch tracks)")
    try:
        server.thread.join()
    except KeyboardInterrupt:
        server.close()


@app.command()
def bench(quick: bool = typer.Option(False, "--quick", help="Smaller sizes.")) -> None:
    """Run all benchmarks and print one table."""
    from rlstream.launcher.bench import bench_main

    raise typer.Exit(_guard(bench_main, quick=quick) or 0)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
