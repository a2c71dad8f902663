"""The ``verl-sweep`` command. Exit codes: 0 success, 1 runtime failure, 2 bad input,
130 stopped by Ctrl-C/SIGTERM (its trials re-queued; ``resume`` continues)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import typer
import typer.core

from verl_sweep.search.spec.errors import BadInputError, Interrupted, SweepError
from verl_sweep.search.spec.masking import mask_url

class _UsageCommand(typer.core.TyperCommand):
    """A usage line as help texts write it, ``run [OPTIONS] STUDY_FILE``: Typer 0.29 prints a
    required argument as ``{study_file}``, which reads as a placeholder left unfilled."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [re.sub(r"^\{(.+)\}", lambda m: m[1].upper(), piece) for piece in super().collect_usage_pieces(ctx)]


class _App(typer.Typer):
    def command(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("cls", _UsageCommand)
        return super().command(*args, **kwargs)


app = _App(
    add_completion=False,
    no_args_is_help=True,
    help="Staged, noise-aware hyperparameter search for verl (GRPO/PPO) runs.",
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # joins a docstring's wrapped lines in the command list
)

StorageOption = typer.Option(None, "--storage", help="Study database URL (default: the study file's storage, else $VERL_SWEEP_STORAGE, else NAME.db beside the study file).")
#: for the commands that take a study name: default_storage_for's order
NamedStorageOption = typer.Option(None, "--storage", help="Study database URL (default: $VERL_SWEEP_STORAGE, else NAME.db here or in studies/).")
DebugOption = typer.Option(False, "--debug", help="Show tracebacks for errors.")

_debug = False
#: "NAME [--storage URL]" of the study this command works on, for the hints it prints
_study_args = ""
#: "--launcher KIND" where the study runs with another launcher than its file names
_launcher_args = ""


def _fail(error: BaseException) -> None:
    """Hydra's run_and_report: the message for expected errors, the traceback with --debug."""
    code = getattr(error, "exit_code", 1)
    if _debug or not isinstance(error, SweepError):
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    if isinstance(error, SweepError):
        for line in str(error).splitlines() or [type(error).__name__]:
            print(f"error: {line}", file=sys.stderr)
    raise typer.Exit(code)


def _guard(action: Callable[[], Any]) -> Any:
    from verl_sweep.launchers.base import LauncherError

    try:
        return action()
    except typer.Exit:
        raise
    except LauncherError as e:
        _fail(BadInputError(str(e)) if getattr(e, "bad_input", False) else SweepError(str(e)))
    except Interrupted as e:  # SIGTERM (and SIGINT's driver-side stop): as Ctrl-C
        _stopped(e.why)
    except SweepError as e:
        _fail(e)
    except KeyboardInterrupt:
        _stopped("Ctrl-C")
    except OSError as e:  # the machine, not the input: a full disk, a lost mount
        _fail(SweepError(f"{e.strerror or type(e).__name__}{f': {e.filename}' if e.filename else ''} "
                         "(a fault of this machine, not of the input; --debug shows where)."))
    except Exception as e:  # noqa: BLE001 - one line, never a traceback without --debug
        if _debug:
            raise
        text = " ".join(str(e).split())[:300]
        _fail(SweepError(f"unexpected {type(e).__name__}: {text} (a bug in verl-sweep: run again with --debug "
                         "and report the traceback)."))


def _stopped(why: str) -> None:
    """One message for every way a driver is stopped, with the command that continues it."""
    resume = " ".join(f"verl-sweep resume {_study_args} {_launcher_args}".split())
    print(f"stopped ({why}); running trials were queued again. Continue with `{resume}`.", file=sys.stderr)
    raise typer.Exit(130)


def _setup(debug: bool) -> None:
    global _debug
    _debug = debug
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _remember_study(name: str, url: str) -> None:
    """The study and, unless it is where ``resume NAME`` looks by itself, its storage (password
    masked), for the commands this one suggests."""
    from verl_sweep.search.database.storage import default_storage_for

    global _study_args
    _study_args = name if default_storage_for(name) == url else f"{name} --storage {mask_url(url)}"


def _url_of(name: str, storage: Optional[str]) -> str:
    from verl_sweep.search.database.storage import default_storage_for

    url = storage or default_storage_for(name)
    if url is None:
        raise BadInputError(
            f"no database found for study {name!r} (looked for {name}.db and studies/{name}.db). "
            "Pass --storage URL."
        )
    return url


def _open_study(name: str, storage: Optional[str], *, readonly: bool = False):  # type: ignore[no-untyped-def]
    """Study ``name`` and its storage; StudyNotFoundError (a worker may wait for it) where the
    database holds no study by that name, none at all included (a new empty file or server
    database), else BadInputError for a database that cannot be used."""
    from verl_sweep.search.engine.driver import load_spec
    from verl_sweep.search.spec.errors import StudyNotFoundError
    from verl_sweep.search.database.storage import holds_studies, is_new_sqlite_file, open_storage

    url = _url_of(name, storage)
    if not is_new_sqlite_file(url) and not holds_studies(url):  # no file at all: open_storage says where it looked
        raise StudyNotFoundError(f"no study named {name!r} in the database {mask_url(url)}: it holds no verl-sweep "
                                 "studies yet. Pass the --storage the study was run with.")
    opened = open_storage(url, create=False, readonly=readonly)
    spec = load_spec(opened, name)
    _remember_study(name, url)
    return opened, spec


def _make_launcher(spec, kind: Optional[str] = None):  # type: ignore[no-untyped-def]
    """The study's launcher, or ``kind``'s (``verl_sweep.search.commands.launch``); says which of the study's
    options another kind leaves out."""
    from verl_sweep.search.commands.launch import build_launcher

    return build_launcher(spec, kind, on_dropped=print)


def _check_study(spec) -> tuple[list[str], list[str]]:  # type: ignore[no-untyped-def]
    """``validate``'s checks, which ``run`` makes too before it stores anything: the rules and
    bounds, verl's compose and validation of the baseline and each stage's configs, the
    launcher's options. Returns (problems, report lines)."""
    from verl_sweep.search.commands.launch import launcher_problems
    from verl_sweep.search.database.storage import check_url
    from verl_sweep.search.commands.validate import validate_study

    early = launcher_problems(spec)
    if spec.storage:
        try:
            check_url(spec.storage)
        except BadInputError as e:
            early.append(f"storage: {e}")
    # verl's checks (seconds) only for a file that passes the others, as within validate_study
    problems, lines = validate_study(spec, with_verl=not early)
    return problems + early, lines


def _launcher_kind(storage, spec, kind: Optional[str]) -> str:  # type: ignore[no-untyped-def]
    """The launcher ``resume`` and ``worker`` use: ``--launcher``'s, else the one the study
    last ran with, else its file's."""
    from verl_sweep.search.database.study_root import stored_launcher

    return kind or stored_launcher(storage, spec.name) or spec.launcher.kind


def _drive(spec, storage, launcher, *, kind: str, joined: str, leave_at_end: bool = False) -> None:  # type: ignore[no-untyped-def]
    """What ``run``, ``resume`` and ``worker`` share once the study and its launcher
    (``kind``) are ready: the driver, run until the study is over (SIGTERM stops it cleanly),
    then what it found. ``joined``: the line that says how this process joined the study."""
    from verl_sweep.search.views.console import Console
    from verl_sweep.search.engine.driver import StudyRunner
    from verl_sweep.search.views.status import study_progress
    from verl_sweep.search.database.study_root import remember_launcher
    from verl_sweep.search.views.trackers import TrackerListener, asks_for_trackers

    global _launcher_args
    if not leave_at_end:  # the driver's launcher, not a worker's (each machine may have its own)
        remember_launcher(storage, spec.name, kind)
    _launcher_args = f"--launcher {kind}" if kind != spec.launcher.kind else ""
    progress = study_progress(storage, spec, simulated=not launcher.real_gpus)
    # Each trial's outcome goes to the probe's run in the user's tracker (W&B, TensorBoard).
    listeners = [TrackerListener()] if spec.probe.trackers and asks_for_trackers(spec.baseline_config()) else []
    runner = StudyRunner(spec, storage, launcher, console=Console(progress=progress), listeners=listeners,
                         leave_at_end=leave_at_end)
    print(f"{joined} (launcher {kind})")

    def on_stop(signum: int, frame: Any) -> None:
        # Ctrl-C stops as SIGTERM does, at the end of the current poll: a KeyboardInterrupt
        # raised anywhere could be swallowed (a cleanup callback) and the study run on. A
        # second Ctrl-C interrupts at once.
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        runner.request_stop("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, on_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        runner.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        runner.launcher.close()
    if runner.left:
        print(f"worker left study {spec.name}: nothing left for it; the other processes finish the last stage.")
        return
    print(f"study {spec.name} finished.")
    if not leave_at_end:
        _print_results(storage, spec)


def _print_results(storage, spec) -> None:  # type: ignore[no-untyped-def]
    from verl_sweep.search.database.records import StageResult
    from verl_sweep.search.views.status import cost_lines, study_status

    data = study_status(storage, spec)
    for r in (StageResult.of(stage["winner"]) for stage in data["stages"] if stage.get("winner")):
        print(f"  {r.stage}: {r.summary}")
    # the study's cost in GPU-hours and in R, the winner's payback (`status --run-steps N`: at a run's length)
    for line in cost_lines(data, give="`status --run-steps N` gives yours"):
        print(line)
    print(f"Export the winner: verl-sweep export {_study_args or spec.name} -o best.yaml")


def _finished_read_only(name: str, url: str) -> bool:
    """True, having said so, when study ``name`` is finished in a SQLite file this process
    cannot write: a finished study needs no write (``run`` and ``resume`` of it only report)."""
    from verl_sweep.search.engine.driver import load_spec
    from verl_sweep.search.views.status import finished_results
    from verl_sweep.search.database.storage import is_read_only_file, open_storage

    if not is_read_only_file(url):
        return False
    from verl_sweep.search.spec.errors import StudyNotFoundError

    opened = open_storage(url, create=False, readonly=True)
    try:
        spec = load_spec(opened, name)
    except StudyNotFoundError:
        return False  # a new study: opening the file for writing says it cannot be written
    if len(finished_results(opened, spec)) < len(spec.stages):
        return False  # not finished: the read-only error of opening it for writing says what to do
    _remember_study(name, url)
    print(f"study {name} is finished: nothing left to run (its database {mask_url(url)} is read-only here).")
    _print_results(opened, spec)
    return True


#: ``--launcher``'s help: the registered kinds (``launchers.LAUNCHERS``)
def _launcher_help() -> str:
    from verl_sweep.search.commands.launch import launcher_kinds

    return f"Override the study's launcher: {', '.join(launcher_kinds())}."


LauncherOption = typer.Option(None, "--launcher", help=_launcher_help())


@app.command()
def run(
    study_file: Path = typer.Argument(..., help="Study definition (studies/*.yaml)."),
    storage: Optional[str] = StorageOption,
    launcher: Optional[str] = LauncherOption,
    debug: bool = DebugOption,
) -> None:
    """Run a study from its YAML file (continues it if it already exists with the same definition;
    new launcher slots or options, other than the landscape, and new budgets of stages not
    finished are taken from the file)."""
    _setup(debug)

    def action() -> None:
        from verl_sweep.search.spec.study_file import load_study

        from verl_sweep.search.commands.validate import one_line

        try:
            spec = load_study(study_file)  # before any heavy import or database access
        except BadInputError as e:  # one line (validate lists every problem)
            raise BadInputError(one_line(str(e).splitlines(), study_file)) from None
        from verl_sweep.search.engine.driver import save_spec
        from verl_sweep.search.commands.launch import default_runs_dir
        from verl_sweep.search.database.storage import DriverLock, open_storage, preflight, removed_if_refused, sqlite_file

        url = storage or spec.storage_url()
        if _finished_read_only(spec.name, url):
            return
        holds = preflight(url)  # a server that does not answer is found here, before anything is made
        from verl_sweep.search.database.study_root import check_name_clash

        check_name_clash(url, spec, holds=holds)  # before verl's checks, which take seconds
        # Exactly validate's checks, before a database exists: a definition verl would refuse
        # must not be stored (its stored definition would then refuse the corrected file).
        problems, _ = _check_study(spec)
        if problems:
            raise BadInputError(one_line(problems, study_file))
        # What this command makes (the runs directory, a new database file) goes again if it is
        # refused before the study is stored: a refused command leaves nothing behind.
        with contextlib.ExitStack() as held:
            with removed_if_refused(default_runs_dir(spec), sqlite_file(url)):
                built = _make_launcher(spec, launcher)
                opened = open_storage(url)
                held.enter_context(DriverLock(url))
                updated = save_spec(opened, spec)
            if updated:
                print(f"study {spec.name}: took {', '.join(updated)} from the file (budgets of stages not finished, "
                      "where and how probes run; everything else as stored)")
            _remember_study(spec.name, url)
            _drive(spec, opened, built, kind=launcher or spec.launcher.kind,
                   joined=f"study {spec.name}: {len(spec.stages)} stages, database {mask_url(url)}")

    _guard(action)


@app.command()
def resume(
    name: str = typer.Argument(..., help="Study name."),
    storage: Optional[str] = NamedStorageOption,
    launcher: Optional[str] = LauncherOption,
    debug: bool = DebugOption,
) -> None:
    """Continue a study from its database: finished stages and trials are kept, trials a dead
    driver left running are queued again; it runs with the launcher the study ran with."""
    _setup(debug)

    def action() -> None:
        from verl_sweep.search.database.storage import DriverLock
        from verl_sweep.search.method.preflight import check_memory

        url = _url_of(name, storage)
        if _finished_read_only(name, url):
            return
        opened, spec = _open_study(name, storage)
        check_memory(spec)  # before anything is written or made
        with DriverLock(url):
            kind = _launcher_kind(opened, spec, launcher)
            _drive(spec, opened, _make_launcher(spec, kind), kind=kind, joined=f"resuming study {spec.name}")

    _guard(action)


@app.command()
def worker(
    name: str = typer.Argument(..., help="Study name."),
    storage: Optional[str] = NamedStorageOption,
    launcher: Optional[str] = LauncherOption,
    wait: float = typer.Option(0.0, "--wait", min=0.0, help="Seconds to wait for `verl-sweep run` to create the study "
                               "(a job array may start its workers first)."),
    debug: bool = DebugOption,
) -> None:
    """Join a running study as one more worker (any number, on any machines, sharing only the
    database): no trial runs twice, budgets count across all workers, the chain is the same."""
    _setup(debug)

    def action() -> None:
        from verl_sweep.search.spec.errors import StudyNotFoundError
        from verl_sweep.search.method.preflight import check_memory

        deadline = time.monotonic() + wait
        while True:
            try:
                opened, spec = _open_study(name, storage)
                break
            except StudyNotFoundError as e:
                if time.monotonic() >= deadline:
                    raise StudyNotFoundError(f"{e} Start `verl-sweep run` first, or give workers --wait SECONDS.") from None
                time.sleep(min(5.0, max(0.1, deadline - time.monotonic())))
        if str(opened.url).startswith("sqlite"):
            raise BadInputError(
                "worker: needs a PostgreSQL storage, but the study is in SQLite, which cannot lock a queued "
                "trial (two workers could take the same one). Put the study in PostgreSQL (README: cluster "
                "guide), or run one driver with a larger launcher.max_concurrent on this machine."
            )
        check_memory(spec)  # before anything is written or made
        kind = _launcher_kind(opened, spec, launcher)
        _drive(spec, opened, _make_launcher(spec, kind), kind=kind, joined=f"worker joined study {spec.name}",
               leave_at_end=True)

    _guard(action)


@app.command()
def status(
    name: str = typer.Argument(..., help="Study name."),
    storage: Optional[str] = NamedStorageOption,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    trials: bool = typer.Option(False, "--trials", help="List every trial (default: each stage's best few)."),
    run_steps: Optional[int] = typer.Option(None, "--run-steps", min=1, help="Steps of a full run (R), for the cost in R and "
                                            "the payback (default: the baseline's own length, else 2,000)."),
    debug: bool = DebugOption,
) -> None:
    """Where a study is: its stages, each stage's decision and best trials, the overall gain
    against the baseline and its payback (`--trials`: every trial; `--json`: everything)."""
    _setup(debug)

    def action() -> None:
        from verl_sweep.search.views.status import study_status

        opened, spec = _open_study(name, storage, readonly=True)
        data = study_status(opened, spec, run_steps=run_steps)
        if as_json:
            print(json.dumps(data, indent=2, default=str))
        else:
            from verl_sweep.search.views.console import print_status_table

            print_status_table(data, trials=trials)

    _guard(action)


@app.command()
def export(
    name: str = typer.Argument(..., help="Study name."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="File to write (default: stdout)."),
    fmt: str = typer.Option("yaml", "--format", help="yaml (a --config-name file), overrides, command or json."),
    storage: Optional[str] = NamedStorageOption,
    debug: bool = DebugOption,
) -> None:
    """Export the best config: YAML that verl composes, or an override list."""
    _setup(debug)

    def action() -> None:
        from verl_sweep.search.database.records import StageResult
        from verl_sweep.search.views import export as exporter
        from verl_sweep.search.views.status import study_status
        from verl_sweep.search.views.train import schedule as train_schedule, schedule_yaml

        if fmt not in exporter.FORMATS:
            raise BadInputError(f"--format must be one of {', '.join(exporter.FORMATS)}, but got {fmt!r}.")
        _check_output(output, export=True)
        opened, spec = _open_study(name, storage, readonly=True)
        data = study_status(opened, spec)
        results = [StageResult.of(stage["winner"]) for stage in data["stages"] if stage.get("winner")]
        if not results:
            raise BadInputError(f"study {name!r} has no finished stage yet; nothing to export.")
        if fmt == "yaml" and output is not None and output.suffix != ".yaml":
            raise BadInputError(f"-o {output}: Hydra finds a --config-name only in a .yaml file; "
                                f"use -o {output.with_suffix('.yaml')}.")
        if len(results) < len(spec.stages):
            print(f"warning: the study is not finished ({len(results)} of {len(spec.stages)} stages); "
                  "exporting the best config so far.", file=sys.stderr)
        config = results[-1].config
        schedule = train_schedule(data, config) if "train" in data else None  # train mode: steps by config
        text = exporter.render(spec, results, config, fmt, config_name=output.stem if output else "best",
                               overall=data["overall"], schedule=schedule)
        if output is None:
            sys.stdout.write(text)
            return
        _write_output(output, text)
        print(f"wrote {output}")  # and, in train mode, the schedule beside it
        if schedule is not None:
            _write_output(exporter.schedule_path(output), schedule_yaml(schedule, config_file=output.name))
            print(f"wrote {exporter.schedule_path(output)}: which config trained which steps, and "
                  + (f"the model ({schedule['model']})" if schedule["trained"] else "that the model is not trained yet"))

    _guard(action)


@app.command()
def report(
    name: str = typer.Argument(..., help="Study name."),
    output: Path = typer.Option(Path("report.html"), "-o", "--output", help="HTML file to write."),
    storage: Optional[str] = NamedStorageOption,
    run_steps: Optional[int] = typer.Option(None, "--run-steps", min=1, help="Steps of a full run (R), for the cost in R and "
                                            "the payback (default: the baseline's own length, else 2,000)."),
    debug: bool = DebugOption,
) -> None:
    """Write one self-contained HTML report (opens offline): η per trial, best-so-far against
    GPU-hours, reward curves, parameter importance, failures, GPU idle time, the export."""
    _setup(debug)

    def action() -> None:
        from verl_sweep.search.views.report import write_report

        _check_output(output)
        opened, spec = _open_study(name, storage, readonly=True)
        try:
            write_report(opened, spec, output, run_steps=run_steps)
        except OSError as e:
            raise BadInputError(f"-o {output}: cannot write it ({e.strerror or e}). Pick another path.") from None
        print(f"wrote {output}")

    _guard(action)


@app.command()
def validate(
    study_file: Path = typer.Argument(..., help="Study definition (studies/*.yaml)."),
    debug: bool = DebugOption,
) -> None:
    """Check a study file and the configs its spaces can produce, without launching anything."""
    _setup(debug)

    def action() -> None:
        from verl_sweep.search.spec.study_file import load_study

        spec = load_study(study_file)
        problems, lines = _check_study(spec)
        for line in lines:
            print(line)
        if problems:
            raise BadInputError("\n".join(problems))
        print(f"{study_file}: OK")

    _guard(action)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def init(
    ctx: typer.Context,
    output: Path = typer.Option(..., "-o", "--output", help="The study file to write (.yaml)."),
    gpu_memory_gb: Optional[float] = typer.Option(None, "--gpu-memory-gb", help="One GPU's memory in GB (default: read through NVML)."),
    model_config: Optional[Path] = typer.Option(None, "--model-config", help="The model's config.json, where model.path has none locally."),
    name: Optional[str] = typer.Option(None, "--name", help="The study's name (default: the file's)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing file."),
    debug: bool = DebugOption,
) -> None:
    """Write a study file from the verl run you have: `verl-sweep init -o study.yaml -- python3 -m
    verl.trainer.main_ppo k=v …`, or `verl-sweep init -o study.yaml run_qwen.sh` (the script runs
    through bash with none of its programs run). Then validates it and says what it will search."""
    _setup(debug)

    def action() -> None:
        from verl_sweep.search.commands.init import run_init

        code = run_init(list(ctx.args), output=output, name=name, gpu_memory_gb=gpu_memory_gb,
                        model_config=model_config, force=force, check=_check_study)
        if code:
            raise typer.Exit(code)

    _guard(action)


def _check_output(output: Optional[Path], *, export: bool = False) -> None:
    """``-o`` must name a file that can be written, checked before the database is opened."""
    if output is None:
        return
    if output.is_dir():
        raise BadInputError(f"-o {output}: must name a file, but it is a directory. Add a file name, "
                            f"e.g. -o {output / ('best.yaml' if export else 'report.html')}.")
    parent = output.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise BadInputError(f"-o {output}: cannot create it, {parent} is not a directory. Pick another path.")
    if not os.access(parent, os.W_OK | os.X_OK) or (output.exists() and not os.access(output, os.W_OK)):
        raise BadInputError(f"-o {output}: cannot write there (permission denied). Pick another path.")


def _write_output(output: Path, text: str) -> None:
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text, encoding="utf-8")
    except OSError as e:
        raise BadInputError(f"-o {output}: cannot write it ({e.strerror or e}). Pick another path.") from None


def _tolerant_streams() -> None:
    """A console that cannot show η or → (PYTHONIOENCODING=ascii, a C locale) gets an escape
    instead of a UnicodeEncodeError in the middle of a command."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # a stream that cannot change any more
                pass


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def main() -> None:
    # First: a SIGTERM while a command starts (imports, the database's first look) stops it as
    # one in the driver does, exit 130, never a bare kill; the driver installs its own.
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    _tolerant_streams()
    app()


if __name__ == "__main__":
    main()
