"""docs/deploy.md's Helm walk-through, checked where it can be offline: every values snippet and every
`helm install`'s --set values render (the model-fill snippet on top of the model-volume one it extends) and
validate against the Kubernetes schemas, and the cleanup commands select what the chart labels."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.conftest import REPO
from tests.deploy.chart import CRD_KINDS, KUBE_VERSIONS, merged, objects, render

DOC = (REPO / "docs" / "deploy.md").read_text()
HELM = DOC[DOC.index("## Helm, step by step") : DOC.index("## What is checked")]
BLOCKS = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", HELM, flags=re.S)]


def _with_run(values: dict[str, Any]) -> dict[str, Any]:
    return values if "run" in values else {**values, "run": {"id": "docs-run"}}


def _snippets() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for i, block in enumerate(BLOCKS):
        if "fill" in block.get("models", {}):  # extends the model-volume snippet before it
            block = merged(BLOCKS[i - 1], block)
        out.append((f"block{i}:{','.join(block)}", _with_run(block)))
    return out


def _validate(docs: list[dict[str, Any]]) -> None:
    for doc in (d for d in docs if d["kind"] not in CRD_KINDS):
        kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)


def _set_values(command: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, value in re.findall(r"--set ([\w.]+)=(\S+)", command):
        node = values
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return values


def test_the_walk_through_has_its_snippets() -> None:
    assert len(BLOCKS) >= 6 and any("fill" in b.get("models", {}) for b in BLOCKS)


@pytest.mark.parametrize(("name", "values"), _snippets(), ids=[n for n, _ in _snippets()])
def test_every_values_snippet_renders_and_validates(name: str, values: dict[str, Any]) -> None:
    docs = render(values)
    assert objects(docs, "StatefulSet"), name
    _validate(docs)


def test_every_helm_install_renders_with_its_set_values() -> None:
    commands = [c.replace("\\\n", " ") for c in re.findall(r"helm install (?:[^\n\\]|\\\n)*", HELM)]
    assert commands
    for command in commands:
        values = _set_values(command)
        assert values["run"]["id"], command  # the required value is in every documented install
        _validate(render(values))


def test_the_cleanup_selects_every_claim_the_chart_keeps() -> None:
    selector = dict(kv.split("=") for kv in re.search(r"delete pvc -l (\S+)", HELM).group(1).split(","))  # type: ignore[union-attr]
    docs = render({"run": {"id": "docs-run"}, "trainer": {"nodes": 2}})
    claims = [c["metadata"]["labels"] for c in objects(docs, "PersistentVolumeClaim")]
    claims += [
        t["metadata"]["labels"] for d in objects(docs, "StatefulSet") for t in d["spec"].get("volumeClaimTemplates", [])
    ]
    assert len(claims) == 3  # rollout's claim, the trainer's and Redis's claim templates
    assert all(labels[k] == v for labels in claims for k, v in selector.items())
