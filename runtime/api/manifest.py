"""Reading InferenceModel manifests from YAML files, within bounds.

- `load_manifest(path)`: the InferenceModel document of a YAML file (`read_manifest(path)`:
  all its documents), read through `ManifestLoader` within bounds: a regular file of at
  most MAX_MANIFEST_BYTES, no duplicate keys, aliases expanding to at most MAX_YAML_NODES
  nodes and MAX_YAML_DEPTH levels. Every problem is a one-line ManifestError.

What a document then means (defaults, validation) is spec.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kiln.runtime.api.contract import KIND
from kiln.runtime.api.fielderrors import go_format

# Bounds on a manifest file. An InferenceModel is a few KiB; the bounds keep a hostile or
# broken file (a YAML "billion laughs" alias bomb, a FIFO, /dev/zero) from hanging kiln.
MAX_MANIFEST_BYTES = 1 << 20
MAX_YAML_NODES = 100_000  # per document, every alias counted at its full expansion
MAX_YAML_DEPTH = 100  # nesting levels per document


class ManifestError(ValueError):
    """A manifest file that cannot be read or parsed; the message is one line, path first."""


class ManifestLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses duplicate mapping keys (the API server's strict decoding
    does; PyYAML would keep the last) and documents whose aliases expand past
    MAX_YAML_NODES nodes or MAX_YAML_DEPTH levels (PyYAML shares aliased nodes, but every
    consumer of the data walks them expanded)."""

    def construct_document(self, node):
        _check_expansion(node)
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` keys may be overridden, as YAML intends
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.setdefault(key, key_node)
                except TypeError:
                    continue  # an unhashable key: SafeConstructor refuses it below
                if seen is not key_node:
                    raise yaml.constructor.ConstructorError(
                        problem=f"duplicate key {go_format(key)} (first at line {seen.start_mark.line + 1})",
                        problem_mark=key_node.start_mark)
        return super().construct_mapping(node, deep)


def _check_expansion(root: yaml.Node) -> None:
    """Walk the document as its consumers will (aliases expanded), stopping at the bounds."""
    count = 0

    def visit(node: yaml.Node, depth: int) -> None:
        nonlocal count
        count += 1
        if count > MAX_YAML_NODES:
            raise yaml.constructor.ConstructorError(
                problem=f"the document expands to more than {MAX_YAML_NODES} YAML nodes "
                        f"(aliases counted at their expansion); refusing it",
                problem_mark=root.start_mark)
        if depth > MAX_YAML_DEPTH:  # also where an alias refers to its own ancestor
            raise yaml.constructor.ConstructorError(
                problem=f"the document nests deeper than {MAX_YAML_DEPTH} levels; refusing it",
                problem_mark=node.start_mark)
        if isinstance(node, yaml.SequenceNode):
            for item in node.value:
                visit(item, depth + 1)
        elif isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                visit(key, depth + 1)
                visit(value, depth + 1)

    visit(root, 0)


def read_manifest(path: str | Path) -> list:
    """Every non-empty document of a YAML file, within the bounds above; ManifestError otherwise."""
    from kiln.runtime.api.localfile import NotARegularFile, open_regular

    try:
        with open_regular(path) as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such file") from None
    except NotARegularFile as e:
        raise ManifestError(f"{e}; a manifest is read only from a regular file") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot read it: {e.strerror or e}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path}: larger than {MAX_MANIFEST_BYTES} bytes "
                            f"({MAX_MANIFEST_BYTES / (1 << 20):g} MiB), the limit for a manifest; "
                            f"refusing it")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        return [d for d in yaml.load_all(text, Loader=ManifestLoader) if d is not None]
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        context = f"{e.context}: " if e.context and e.problem else ""
        raise ManifestError(f"{path}{where}: {context}{e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ManifestError(f"{path}: invalid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:  # PyYAML composes recursively: hundreds of levels end here
        raise ManifestError(f"{path}: the YAML nests deeper than {MAX_YAML_DEPTH} levels; "
                            f"refusing it") from None


def load_manifest(path: str | Path) -> dict:
    """The one InferenceModel document in a YAML file (other kinds in the file are skipped).

    Raises ManifestError (a ValueError) when the file cannot be read within the bounds, is
    not YAML, or holds no InferenceModel or more than one.
    """
    docs = read_manifest(path)
    found = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(found) != 1:
        kinds = sorted({go_format(d.get("kind")) for d in docs if isinstance(d, dict)})
        seen = f" (the file has kind: {', '.join(kinds)})" if not found and kinds else ""
        raise ManifestError(f"{path}: expected one {KIND} document, found {len(found)}{seen}")
    return found[0]
