"""Print relayrl's requirements (one per line) from pyproject.toml, with the given extras: the Dockerfile installs
them in a layer of their own, before the code is copied, so a code change does not reinstall every dependency.

    python scripts/image_requirements.py [EXTRA[,EXTRA...]] < pyproject.toml
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


if __name__ == "__main__":
    wanted = [e for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e.strip()]
    print("\n".join(requirements(tomllib.loads(sys.stdin.read()), [e.strip() for e in wanted])))
