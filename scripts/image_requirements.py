"""Print relayrl's requirements (one per line) from pyproject.toml, with the given extras: the Dockerfile installs
them in a layer of their own, before the code is copied, so a code change does not reinstall every dependency.

    python scripts/image_requirements.py [EXTRA[,EXTRA...]] [TORCH_VARIANT] < pyproject.toml

A CUDA 13 variant (``cu130``) adds the ``vllm-cuda`` extra: vLLM 0.32.0 from PyPI, built for CUDA 13 against the
pinned torch 2.13.0 (the pair resolves: checked with ``pip install --dry-run``). A CUDA 12 variant (``cu128``) gets
CUDA torch and no vLLM (PyPI has no CUDA 12 build of it; the native engine runs there). A CUDA variant refuses
``vllm``, the CPU build.
"""

from __future__ import annotations

import re
import sys
import tomllib


def requirements(pyproject: dict, extras: list[str]) -> list[str]:
    project = pyproject["project"]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise SystemExit(f"unknown extras {unknown}; relayrl has {sorted(optional)}")
    out: list[str] = []
    pending, seen = [*project["dependencies"], *(r for e in extras for r in optional[e])], set(extras)
    while pending:
        req = pending.pop(0)
        self_ref = re.fullmatch(r"relayrl\[([\w,\s-]+)\]", req.strip())
        if self_ref:  # an extra that names others: relayrl[a,b]
            for extra in (e.strip() for e in self_ref.group(1).split(",")):
                if extra not in seen:
                    seen.add(extra)
                    pending.extend(optional[extra])
        elif req not in out:
            out.append(req)
    return out


VLLM_CUDA = "cu13"  # the CUDA major version PyPI's vllm wheel is built for (its cu13 dependencies)


def for_variant(extras: list[str], variant: str) -> list[str]:
    """The extras an image of torch ``variant`` installs: a CUDA 13 one gets vLLM's CUDA build."""
    if variant == "cpu":
        return extras
    if "vllm" in extras:
        raise SystemExit(f"extra vllm is vLLM's CPU build; a {variant} image cannot use it")
    if not variant.startswith(VLLM_CUDA):
        if "vllm-cuda" in extras:
            raise SystemExit(f"vllm-cuda is built for CUDA 13 (TORCH_VARIANT=cu130), not {variant}")
        print(f"{variant}: no vLLM (PyPI's is built for CUDA 13: use TORCH_VARIANT=cu130)", file=sys.stderr)
        return extras
    return extras if "vllm-cuda" in extras else [*extras, "vllm-cuda"]


if __name__ == "__main__":
    wanted = [e.strip() for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e.strip()]
    variant = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    print("\n".join(requirements(tomllib.loads(sys.stdin.read()), for_variant(wanted, variant))))
