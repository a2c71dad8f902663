"""Reading a file a user named (a study file, a model's config.json, a landscape): the one way.

Every such file is read through :func:`read_user_file` and parsed through :func:`load_yaml` or
:func:`load_json`, which hold for any input:

- only a regular file is read (a FIFO, ``/dev/zero``, a directory or a socket is refused before
  a byte is read: ``stat()``'s size of a device is 0, so a size check alone reads forever);
- at most ``max_bytes`` are read, whatever the file grows to meanwhile;
- every failure (missing, unreadable, not UTF-8, not YAML/JSON, nested too deeply, an alias
  bomb, an alias that contains itself) is one :class:`UserFileError` with a one-line message.

It lives in ``launchers/`` because that is the lowest package that reads a user file (the
simulator reads its landscape in the probe process); ``search/`` uses it for the study file and
``model.config_json``. It imports nothing of ours.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

#: a study file, a config.json or a landscape is a few KB; 1 MB leaves a wide margin
MAX_BYTES = 1_000_000
#: nesting deeper than this is no configuration a person wrote
MAX_DEPTH = 32
#: values after aliases are expanded: a few-KB "billion laughs" file expands to 10^9
MAX_VALUES = 200_000


class UserFileError(ValueError):
    """A user file that cannot be read or parsed; the message is one line that names it."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_user_file(path: Path | str, *, what: str, max_bytes: int = MAX_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (``what`` names it in messages: "study file")."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO with no writer would otherwise wait forever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise UserFileError(f"{path}: no such {what}. Check the path.") from None
    except OSError as e:
        if e.errno == errno.EISDIR:
            raise UserFileError(f"{path}: a {what} must be a regular file, but it is a directory.") from None
        raise UserFileError(f"{path}: cannot read the {what} ({e.strerror or e}).") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UserFileError(f"{path}: a {what} must be a regular file, but it is {_kind(mode)}.")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise UserFileError(f"{path}: cannot read the {what} ({e.strerror or e}).") from None
    finally:
        os.close(fd)
    if size > max_bytes:
        raise UserFileError(f"{path}: a {what} must be at most {max_bytes:,} bytes, but it is larger.")
    return b"".join(chunks)


def read_user_text(path: Path | str, *, what: str, max_bytes: int = MAX_BYTES) -> str:
    """:func:`read_user_file` decoded as UTF-8."""
    data = read_user_file(path, what=what, max_bytes=max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserFileError(f"{path}: a {what} must be UTF-8 text, but byte {e.start} is not "
                            f"(0x{data[e.start]:02x}). Save it as UTF-8.") from None


# -- YAML ------------------------------------------------------------------------------------


def _yaml_loader() -> Any:
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """SafeLoader (no Python tags) that also refuses duplicate keys instead of keeping the
        last. The pure-Python loader on purpose: its composer's recursion ends in a
        RecursionError, where the C one's could overflow the C stack."""

    def construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key ({[1]: x}): the constructor's own error follows
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        return loader.construct_mapping(node, deep=deep)

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return UniqueKeyLoader


def _check_shape(root: Any, *, max_depth: int, max_values: int) -> str | None:
    """Why the composed YAML graph is unsafe to construct and walk, or None. Iterative: a
    graph with aliases is a DAG (or, with a self-reference, has a cycle), and its expanded
    size is counted with memoisation, so a bomb is measured without being expanded."""
    import yaml

    expanded: dict[int, int] = {}
    depth_of: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            children = _children(node)
            expanded[key] = 1 + sum(expanded[id(c)] for c in children)
            if expanded[key] > max_values:
                return f"it expands to more than {max_values:,} values (an alias repeats what it points to)"
            continue
        if key in on_path:
            return "an alias refers to a value that contains it"
        if key in expanded and depth_of.get(key, 0) >= depth:
            continue
        if depth > max_depth:
            return f"it is nested more than {max_depth} levels deep"
        depth_of[key] = max(depth, depth_of.get(key, 0))
        if not isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
            expanded[key] = 1
            continue
        on_path.add(key)
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in _children(node))
    return None


def _children(node: Any) -> list[Any]:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def parse_yaml(text: str, *, source: str, what: str, max_depth: int = MAX_DEPTH,
               max_values: int = MAX_VALUES) -> Any:
    """YAML ``text`` → Python data (safe tags only, no duplicate keys, bounded shape)."""
    import yaml

    loader = None
    try:
        loader = _yaml_loader()(text)  # its reader refuses control characters here already
        node = loader.get_single_node()
        if node is None:
            return None
        problem = _check_shape(node, max_depth=max_depth, max_values=max_values)
        if problem:
            raise UserFileError(f"{source}: a {what} must be plain YAML, but {problem}.")
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
        problem = " ".join(str(problem).split())
        raise UserFileError(f"{source}: not valid YAML{where}: {problem}.") from None
    except RecursionError:
        raise UserFileError(f"{source}: a {what} must be plain YAML, but it is nested too deeply.") from None
    except (TypeError, ValueError, OverflowError) as e:  # e.g. an unhashable key, a date out of range
        if isinstance(e, UserFileError):
            raise
        raise UserFileError(f"{source}: not valid YAML: {' '.join(str(e).split())[:200]}.") from None
    finally:
        if loader is not None:
            loader.dispose()


def load_yaml(path: Path | str, *, what: str, max_bytes: int = MAX_BYTES) -> Any:
    """Read (:func:`read_user_text`) and parse (:func:`parse_yaml`) a YAML user file."""
    return parse_yaml(read_user_text(path, what=what, max_bytes=max_bytes), source=str(path), what=what)


# -- JSON ------------------------------------------------------------------------------------


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def load_json(path: Path | str, *, what: str, max_bytes: int = MAX_BYTES) -> Any:
    """Read and parse a JSON user file (no NaN or Infinity; bounded nesting)."""
    text = read_user_text(path, what=what, max_bytes=max_bytes)

    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    try:
        data = json.loads(text, parse_constant=refuse_constant)
    except RecursionError:
        raise UserFileError(f"{path}: a {what} must be plain JSON, but it is nested too deeply.") from None
    except ValueError as e:  # JSONDecodeError is a ValueError
        raise UserFileError(f"{path}: not valid JSON: {' '.join(str(e).split())[:200]}.") from None
    if _depth(data) > MAX_DEPTH:
        raise UserFileError(f"{path}: a {what} must be plain JSON, but it is nested more than {MAX_DEPTH} levels deep.")
    return data
