"""The devcontainer files guardfs ships are valid for the devcontainer tools that read them:
containers/devcontainer.json (the all-in-one image), the Feature's metadata
(features/src/guardfs/devcontainer-feature.json) and the README's copy-paste block.

The schemas are the Dev Container Specification's own (github.com/devcontainers/spec,
``schemas/``, commit c95ffeed1d059abfe9ffbe79762dc2fa4e7c2421, MIT: tests/fixtures/schemas/),
vendored because check-jsonschema has none built in. devcontainer.json is JSON with comments and
trailing commas (JSONC), read here as the CLI reads it. Each check is also shown a file it must
reject, so that a check that cannot fail is caught.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # a test extra; no stubs here
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = Path(__file__).resolve().parent / "fixtures/schemas"
FEATURE = ROOT / "features/src/guardfs/devcontainer-feature.json"

# A string, a // comment to the end of the line, a /* */ comment, or anything else.
_JSONC = re.compile(r'"(?:\\.|[^"\\])*"|//[^\n]*|/\*.*?\*/|.', re.DOTALL)


def load_jsonc(text: str) -> Any:
    """JSON with comments and trailing commas, as the devcontainer CLI reads devcontainer.json."""
    kept = "".join(m.group() for m in _JSONC.finditer(text) if not m.group().startswith(("//", "/*")))
    return json.loads(re.sub(r'("(?:\\.|[^"\\])*")|,(\s*[\]}])', lambda m: m.group(1) or m.group(2), kept))


def _errors(schema_name: str, document: Any) -> list[str]:
    schema = json.loads((SCHEMAS / schema_name).read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document))


def _readme_block() -> Any:
    readme = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"```jsonc\n(.*?)```", readme, re.DOTALL)
    return load_jsonc(block)


def test_jsonc_reader_keeps_strings_and_drops_comments() -> None:
    text = '{\n  // a comment\n  "url": "http://x//y", /* block */ "a": [1, 2,],\n}\n'
    assert load_jsonc(text) == {"url": "http://x//y", "a": [1, 2]}


@pytest.mark.parametrize("document", ["containers/devcontainer.json", "README.md"])
def test_devcontainer_json_matches_the_spec(document: str) -> None:
    config = _readme_block() if document == "README.md" else load_jsonc((ROOT / document).read_text())
    assert _errors("devContainer.base.schema.json", config) == []


def test_the_feature_metadata_matches_the_spec() -> None:
    metadata = json.loads(FEATURE.read_text())
    assert _errors("devContainerFeature.schema.json", metadata) == []
    assert metadata["id"] == FEATURE.parent.name  # the spec: the id is the folder's name


def test_the_readme_block_adds_the_feature_and_the_device() -> None:
    config = _readme_block()
    assert any(ref.endswith("guardfs:0") for ref in config["features"]), config
    assert "--device=/dev/fuse" in config["runArgs"]


@pytest.mark.parametrize(("schema_name", "broken"), [
    ("devContainer.base.schema.json", {"image": "debian", "runArgs": "--device=/dev/fuse"}),  # not a list
    ("devContainer.base.schema.json", {"image": "debian", "forwardPorts": [{"port": 1}]}),
    ("devContainerFeature.schema.json", {"id": "guardfs", "version": "1.0.0", "devices": ["/dev/fuse"]}),
    ("devContainerFeature.schema.json", {"version": "1.0.0"}),  # no id
])
def test_each_schema_rejects_a_broken_file(schema_name: str, broken: dict[str, Any]) -> None:
    assert _errors(schema_name, broken) != []
