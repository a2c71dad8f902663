"""The verl command a user already has: read from a command line or from a launch script.

``read_command(argv)`` takes ``python3 -m verl.trainer.main_ppo k=v …`` (or ``bash run.sh``,
or ``uv run … python3 -m verl.trainer.main_ppo``, ``ray job submit -- …``); ``read_script(path)``
runs a launch script through bash with **no program of it run**: every external command
(``python3``, ``uv``, ``date``, ``mkdir``, …, also one named by a path) is replaced by a
stand-in that records its arguments, so bash itself resolves what a static reader cannot
(variables with defaults, arrays, ``if``/``case``, arithmetic, word splitting). The stand-in
for the verl call records the overrides exactly as verl would have received them; the script's
own ``"$@"`` gets the arguments given after the script (none by default: dropped).

What the stand-ins cannot do (a ``$(date …)`` stays empty, ``python3 -c 'import torch_npu'``
counts as failing, as on a machine without it) is listed in ``LaunchCommand.unresolved``.
Builtins run as bash runs them; output redirections of ``echo``/``printf`` into files are
dropped, existing files are never truncated (``noclobber``), and relative paths land in a
scratch directory. A redirection onto a new absolute path can leave an empty file behind.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from verl_sweep.search.spec.errors import BadInputError

#: what marks the verl call among a script's commands
ENTRY_POINTS = ("verl.trainer.main_ppo", "verl/trainer/main_ppo.py")
_SCRIPT_TIMEOUT_S = 30.0
_MAX_UNSET = 20
_UNBOUND = re.compile(r"([A-Za-z_][A-Za-z0-9_]*): unbound variable")
#: a verl override run as a program: cut off from the verl call (a dotted key is no shell name)
_OVERRIDE = re.compile(r"^\+{0,2}[A-Za-z_]\w*(\.\w+)+=")
_NO_FILE = re.compile(r": line \d+: (\S+): No such file or directory$", re.MULTILINE)

# Sourced before the script. The DEBUG trap (extdebug: a non-zero return skips the command)
# turns a program named by a path, literally or through a simple variable, into a function of
# that name (a function wins over the path); every other program is not found on the empty
# PATH and goes to command_not_found_handle. Both record and run nothing.
_PRELUDE = r"""
__vs_rec() { builtin printf '%s\0' "$@" >&3; }
__vs_cmd() {
  local a
  for a in "$@"; do
    case $a in
      verl.trainer.main_ppo|*/verl/trainer/main_ppo.py|verl/trainer/main_ppo.py)
        __vs_rec @CALL "$#" "$@"; return 0;;
    esac
  done
  __vs_rec @SKIP "$#" "$@"
  [[ -p /dev/stdin ]] && while IFS= read -r _; do :; done  # a pipe into it is read, as a program would
  local name=${1##*/}
  case $name in
    python|python3|python3.*|python2) [[ ${2-} == -c ]] && return 1;;
    which|nvidia-smi|npu-smi|rocm-smi) return 1;;
    dirname) local p=${2:-.}; p=${p%/}; if [[ $p == */* ]]; then p=${p%/*}; else p=.; fi
             builtin printf '%s\n' "${p:-/}";;
    basename) local p=${2%/}; builtin printf '%s\n' "${p##*/}";;
  esac
  return 0
}
command_not_found_handle() { __vs_cmd "$@"; }
__vs_run() {
  if [[ $1 == */* ]] || { ! declare -F -- "$1" >/dev/null && [[ $(type -t -- "$1") != builtin ]]; }; then
    __vs_cmd "$@"
  else
    "$@"
  fi
}
__vs_noredir() {
  local __vs_t=$1
  shift
  while [[ $__vs_t =~ ^(.*[[:space:]])([0-9]*|&)\>\>?(\&[0-9-]+|[[:space:]]*(\"[^\"]*\"|\'[^\']*\'|[^[:space:]|;&<>\"\'])+)(.*)$ ]]; do
    __vs_t="${BASH_REMATCH[1]} ${BASH_REMATCH[5]}"
  done
  eval "__vs_run $__vs_t"
}
__vs_trap() {
  # The verl call with its output redirected: run without the redirections, so that a log
  # file in a folder the script's (stand-in) mkdir never made does not stop it.
  if [[ ${FUNCNAME[1]-} != __vs_* && $BASH_COMMAND == *main_ppo* && $BASH_COMMAND =~ [[:space:]]([0-9]*|\&)\> &&
        $BASH_COMMAND != *'$('* && $BASH_COMMAND != *'`'* && $BASH_COMMAND != *'<('* ]]; then
    __vs_noredir "$BASH_COMMAND" "$@"; return 1
  fi
  local c=$BASH_COMMAND w
  [[ $c == __vs_* || $c == 'builtin '* && ! $c =~ ^builtin[[:space:]]+(exec|command|eval|source|\.|trap|enable|kill|hash)([[:space:]]|$) ]] && return 0
  [[ $c =~ ^builtin[[:space:]] ]] && { __vs_rec @BLOCK 1 "$c"; return 1; }
  while [[ $c =~ ^[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])?\+?=(\"[^\"]*\"|\'[^\']*\'|[^[:space:]\"\'])*[[:space:]]+(.*)$ ]]; do
    c=${BASH_REMATCH[3]}
  done
  [[ $c =~ ^[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])?\+?= ]] && return 0
  [[ $c =~ ^([^[:space:]]+) ]] || return 0
  w=${BASH_REMATCH[1]}
  [[ $w == *=* ]] && return 0  # an assignment (bash shows array elements with expansions this way)
  if [[ $w == *'$'* ]]; then
    if [[ $w == *'$('* || $w == *'`'* || $w == *'<('* || $w == *'>('* ]]; then return 0; fi
    local -a __vs_w=()
    eval "__vs_w=( $w )" 2>/dev/null || return 0
    w=${__vs_w[0]-}
  fi
  [[ $w == */* ]] || return 0
  if [[ $w =~ ^[A-Za-z0-9_./+~-]+$ ]]; then
    declare -F -- "$w" >/dev/null || eval "function $w { __vs_cmd '$w' \"\$@\"; }"
    return 0
  fi
  __vs_rec @BLOCK 1 "$w"
  return 1
}
exec() { (($#)) || return 0; __vs_run "$@"; exit $?; }
command() {
  case ${1-} in
    -v|-V) builtin command "$@";;
    -p) shift; __vs_run "$@";;
    *) __vs_run "$@";;
  esac
}
trap() { :; }
enable() { :; }
kill() { :; }
hash() { :; }
set() { builtin set "$@"; builtin set +ex -T; }
shopt() { builtin shopt "$@"; builtin shopt -s extdebug; }
echo() { [[ -f /dev/stdout ]] && return 0; builtin echo "$@"; }
printf() { [[ ${1-} != -v && -f /dev/stdout ]] && return 0; builtin printf "$@"; }
readonly PATH
builtin : &  # a background job's pid in $!, for a script that reads it of a call it skipped
builtin shopt -s extdebug
builtin set -T -o noclobber
builtin trap '__vs_trap "$@"' DEBUG
"""


@dataclasses.dataclass(frozen=True)
class LaunchCommand:
    """A verl launch as verl's Hydra would see it."""

    #: the override arguments, in order (``key=value``, ``+key=value``, ``~key``)
    overrides: tuple[str, ...]
    #: ``--config-name`` (None: verl's default, ppo_trainer)
    config_name: str | None = None
    #: ``--config-path`` as written (None: verl's own config directory)
    config_path: str | None = None
    #: what could not be known without running the script's programs, one short text each
    unresolved: tuple[str, ...] = ()
    #: other remarks (more than one verl call, Hydra options that were left out)
    notes: tuple[str, ...] = ()
    #: overrides whose value came out empty from a shell variable: (key, why, e.g. "$BASE_MODEL is not set")
    empty: tuple[tuple[str, str], ...] = ()

    def why_empty(self, key: str) -> str:
        """Why ``key=`` has no value, in words (a guess where the script does not say)."""
        return next((why for k, why in self.empty if k == key), "a shell variable nobody set?")


def read_command(argv: Sequence[str], *, script_args: Sequence[str] = ()) -> LaunchCommand:
    """A launch given as a command line. ``bash run.sh …`` / ``sh run.sh`` / a lone ``*.sh``
    reads the script. Raises BadInputError when no verl call is in it."""
    argv = list(argv)
    if not argv:
        raise BadInputError("init needs a verl command after `--` (python3 -m verl.trainer.main_ppo k=v …) or a "
                            "launch script, but got neither. Give one of those.")
    if Path(argv[0]).name in ("bash", "sh") and len(argv) >= 2 and not argv[1].startswith("-"):
        return read_script(Path(argv[1]), script_args=[*argv[2:], *script_args])
    if len(argv) == 1 and argv[0].endswith(".sh"):
        return read_script(Path(argv[0]), script_args=script_args)
    return _from_argv(argv, notes=[], unresolved=[])


def _entry_index(argv: Sequence[str]) -> int | None:
    for i, item in enumerate(argv):
        if item in ENTRY_POINTS or item.endswith("/" + ENTRY_POINTS[1]):
            return i
    return None


def _from_argv(argv: Sequence[str], *, notes: list[str], unresolved: list[str],
               empty: Sequence[tuple[str, str]] = ()) -> LaunchCommand:
    at = _entry_index(argv)
    if at is None:
        shown = " ".join(argv[:4]) + (" …" if len(argv) > 4 else "")
        raise BadInputError(f"the command must run verl.trainer.main_ppo (python3 -m verl.trainer.main_ppo k=v …), but got "
                            f"`{shown}`. verl-sweep tunes main_ppo runs; give that command.")
    overrides: list[str] = []
    config_name = config_path = None
    args = list(argv[at + 1:])
    i = 0
    while i < len(args):
        item = args[i]
        option, _, inline = item.partition("=")
        if option in ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd"):
            value = inline if _ else (args[i + 1] if i + 1 < len(args) else "")
            i += 1 if _ else 2
            value = value.strip("'\"")
            if option in ("--config-name", "-cn"):
                config_name = value
            elif option in ("--config-path", "-cp"):
                config_path = value
            else:
                notes.append(f"{option} {value} left out: verl-sweep composes against verl's own configs")
            continue
        if item in ("--multirun", "-m"):
            raise BadInputError("the verl command must be one run, but it has --multirun (a Hydra sweep). Remove it and "
                                "give the run verl-sweep should start from.")
        if item.startswith("-"):
            notes.append(f"Hydra option {item} left out")
            i += 1
            continue
        overrides.append(item)
        i += 1
    return LaunchCommand(tuple(overrides), config_name, config_path, tuple(unresolved), tuple(notes), tuple(empty))


def read_script(path: Path, *, script_args: Sequence[str] = ()) -> LaunchCommand:
    """Run a launch script through bash with stand-ins for all of its programs and return its
    verl call. Raises BadInputError when the file cannot be read, bash is missing, or the
    script never reaches a verl call (its last error line is quoted)."""
    from verl_sweep.launchers.user_files import UserFileError, read_user_text

    try:
        read_user_text(path, what="launch script")  # a regular, readable, small text file
    except UserFileError as e:
        raise BadInputError(str(e)) from None
    bash = shutil.which("bash") or ("/bin/bash" if os.path.exists("/bin/bash") else None)
    if bash is None:
        raise BadInputError("reading a launch script needs bash, but none was found. Give the verl command itself: "
                            "verl-sweep init -o study.yaml -- python3 -m verl.trainer.main_ppo k=v ….")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("BASH_FUNC_") and k not in ("BASH_ENV", "ENV", "CDPATH", "PROMPT_COMMAND")}
    unset: list[str] = []
    # A variable the script needs but nobody set stops it under `set -u`: it is set empty and
    # the script read again (one variable a pass), and reported.
    for _ in range(_MAX_UNSET + 1):
        returncode, stderr, data = _run_bash(bash, path, env, script_args)
        match = _UNBOUND.search(_last_error(stderr))
        if not match or match.group(1) in env or len(unset) >= _MAX_UNSET:
            break
        unset.append(match.group(1))
        env[match.group(1)] = ""
    calls, skipped, blocked = _parse_records(data)
    if not calls:
        last = _last_error(stderr)
        other = [c for c in skipped if _verl_module(c)]
        if other:
            module = _verl_module(other[0]) or ""
            where = "" if _module_exists(module) else f", which verl {_installed_verl()} does not have"
            raise BadInputError(f"{path}: the script must call verl.trainer.main_ppo, but it runs {module}{where} "
                                f"(`{_short_command(other[0])}`). verl-sweep tunes main_ppo runs: give that command.")
        positional = re.search(r"\$?(\d+): unbound variable", last)
        if positional:
            raise BadInputError(f"{path}: the script must reach its verl call, but it stops without argument "
                                f"${positional.group(1)} (`set -u`: {last}). Give its arguments after it: verl-sweep "
                                f"init -o study.yaml -- bash {path} ARG ….")
        programs = [c for c in skipped if _python_program(c)]
        if programs and not (last and returncode):  # it ran to its end, and ran its own trainer
            raise BadInputError(f"{path}: the script must call verl.trainer.main_ppo, but it runs "
                                f"{_python_program(programs[-1])} instead (`{_short_command(programs[-1])}`). verl-sweep "
                                "tunes main_ppo runs: give that command.")
        why = f" It stopped with: {last}." if last else f" It ended with status {returncode}."
        raise BadInputError(f"{path}: the script must reach a python3 -m verl.trainer.main_ppo call, but it did not "
                            f"(init runs none of its programs).{why} Set what it needs in the environment, or give the "
                            "verl command after `--`.")
    # an override cut off from the call runs as a program: found on no PATH, or (a value with
    # a "/") as a path bash cannot open
    cut = next((c for c in skipped if _OVERRIDE.match(c[0])), None)
    cut = cut or next(([m.group(1)] for m in _NO_FILE.finditer(stderr) if _OVERRIDE.match(m.group(1))), None)
    if cut is not None:
        raise BadInputError(f"{path}: the verl call must hold all its overrides, but those from `{cut[0][:60]}` on are "
                            "a command of their own: the line before them ends the call (a comment line between "
                            "continuation lines, or a line without `\\` at its end), so bash never passes them to verl. "
                            "Join them to the call.")
    unresolved = [f"`{_short_command(c)}` {_stand_in_effect(c)}" for c in _unique(skipped)]
    unresolved += [f"`{w[0]}` not run (a program name init cannot read)" for w in _unique([b[:1] for b in blocked])]
    unresolved += [f"${name} is not set: left empty" for name in unset]
    notes = []
    if len(calls) > 1:
        notes.append(f"the script calls verl {len(calls)} times; the first call is used")
    return _from_argv(calls[0], notes=notes, unresolved=unresolved, empty=_empty_values(path, calls[0], set(env) - set(unset)))


def _empty_values(path: Path, argv: list[str], known: set[str]) -> list[tuple[str, str]]:
    """Overrides of the call with an empty value, and the variable the script gave them
    (``key=$VAR`` in its text): not set anywhere, or set empty by the script."""
    text = path.read_text(encoding="utf-8", errors="replace")
    found = []
    for item in argv:
        key, equals, value = item.partition("=")
        if not equals or value:
            continue
        match = re.search(re.escape(key) + r"""=["']?\$\{?([A-Za-z_]\w*)""", text)
        if match:
            name = match.group(1)
            assigned = re.search(rf"^\s*(export\s+|local\s+|declare\s+\S+\s+)?{name}=", text, re.MULTILINE)
            found.append((key.lstrip("+"), f"${name} is empty" if assigned or name in known else f"${name} is not set"))
    return found


def _run_bash(bash: str, path: Path, env: dict[str, str], script_args: Sequence[str]) -> tuple[int, str, bytes]:
    """One pass of the script under the prelude: (exit status, stderr, the stand-ins' records)."""
    code = '__vs_prelude=$1; shift; eval "$__vs_prelude"; unset __vs_prelude; source "$0" "$@"'
    with tempfile.TemporaryDirectory(prefix="vs-init-") as tmp:
        empty = Path(tmp) / "no-programs"
        empty.mkdir()
        records = Path(tmp) / "records"
        try:
            with open(records, "wb") as out:
                result = subprocess.run(
                    [bash, "--noprofile", "--norc", "-c", code, str(path.resolve()), _PRELUDE, *script_args],
                    cwd=tmp, env={**env, "PATH": str(empty)}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE, pass_fds=(3,), timeout=_SCRIPT_TIMEOUT_S,
                    preexec_fn=_as_fd3(out.fileno()),
                )
        except subprocess.TimeoutExpired:
            raise BadInputError(f"{path}: reading the script must end within {_SCRIPT_TIMEOUT_S:g} s, but it did not (a "
                                "loop that waits for something?). Give the verl command itself after `--`.") from None
        return result.returncode, result.stderr.decode("utf-8", "replace")[-20_000:], records.read_bytes()


def _verl_module(argv: list[str]) -> str | None:
    for i, item in enumerate(argv[:-1]):
        if item == "-m" and argv[i + 1].startswith(("verl.", "recipe.")):
            return argv[i + 1]
    return None


def _python_program(argv: list[str]) -> str | None:
    """The .py file or ``-m`` module a Python launch runs (python, torchrun, accelerate, deepspeed,
    behind uv or ray), or None; not pip."""
    if not any(Path(a).name.startswith(("python", "torchrun", "accelerate", "deepspeed")) for a in argv[:6]):
        return None
    for i, item in enumerate(argv):
        if item == "-m" and i + 1 < len(argv) and argv[i + 1] != "pip":
            return argv[i + 1]
        if item.endswith(".py") and not item.startswith("-"):
            return item
    return None


def _module_exists(module: str) -> bool:
    """Whether ``module`` (``verl.trainer.x``) is a file of the installed verl, found without
    importing verl (seconds)."""
    import importlib.util

    spec = importlib.util.find_spec(module.split(".")[0]) if module else None
    if spec is None or not spec.submodule_search_locations:
        return True  # not verl's, or verl not here: no claim either way
    parts = module.split(".")[1:]
    base = Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _installed_verl() -> str:
    from verl_sweep.verl_knowledge import verl_version

    return verl_version() or "0.9.1"


def _as_fd3(fd: int) -> Callable[[], None]:
    """In the child: the records file as fd 3, where the stand-ins write."""
    def move() -> None:
        os.dup2(fd, 3)
    return move


def _parse_records(data: bytes) -> tuple[list[list[str]], list[list[str]], list[list[str]]]:
    items = data.decode("utf-8", "replace").split("\0")
    calls: list[list[str]] = []
    skipped: list[list[str]] = []
    blocked: list[list[str]] = []
    i = 0
    while i < len(items):
        kind = items[i]
        if kind not in ("@CALL", "@SKIP", "@BLOCK") or i + 1 >= len(items):
            i += 1
            continue
        try:
            n = int(items[i + 1])
        except ValueError:
            i += 1
            continue
        argv = items[i + 2:i + 2 + n]
        {"@CALL": calls, "@SKIP": skipped, "@BLOCK": blocked}[kind].append(argv)
        i += 2 + n
    return calls, skipped, blocked


def _unique(commands: list[list[str]]) -> list[list[str]]:
    seen: set[str] = set()
    out = []
    for command in commands:
        if not command:
            continue
        key = " ".join(command[:2])
        if key not in seen:
            seen.add(key)
            out.append(command)
    return out


def _short_command(argv: list[str]) -> str:
    text = " ".join(argv)
    return text if len(text) <= 50 else text[:47] + "…"


def _stand_in_effect(argv: list[str]) -> str:
    name = Path(argv[0]).name
    if name.startswith("python") and len(argv) > 1 and argv[1] == "-c":
        return "not run: taken as failing"
    if name in ("dirname", "basename"):
        return "computed without running it"
    return "not run: no output"


def _last_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not line.startswith("+")]
    if not lines:
        return ""
    line = lines[-1]
    return line if len(line) <= 160 else line[:157] + "…"
