"""Runs inside the sandbox (``python -I -S``; standard library only): executes the program, then each test.

Reads ``program.py`` and ``tests.json`` beside this file; writes one JSON line per test to fd 3 as soon as it
finishes, so the tests completed before a kill still count. A test is either

- ``{"expr": "<expression>"}``: the left side of an ``assert <expression> == <literal>`` test; the harness
  reports the expression's value as ``repr`` and the verifier, outside the sandbox, compares it with the literal,
  which never enters the sandbox; or
- ``{"code": "<statements>"}``: any other test, run as is; it reports passed or the error.

The program's own module namespace is shared by the tests; its ``__name__`` is ``"solution"``, so a
``if __name__ == "__main__":`` block does not run.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__


def main() -> None:
    channel = os.fdopen(3, "w", buffering=1)
    with open(os.path.join(HERE, "program.py")) as f:
        program = f.read()
    with open(os.path.join(HERE, "tests.json")) as f:
        tests = json.load(f)
    namespace = {"__name__": "solution"}
    try:
        exec(compile(program, "program.py", "exec"), namespace)
    except BaseException as exc:  # whatever the program raises is its failure
        channel.write(json.dumps({"load_error": _error(exc)}) + "\n")
        return
    for i, test in enumerate(tests):
        row: dict[str, object] = {"test": i}
        try:
            if "expr" in test:
                row["value"] = repr(eval(compile(test["expr"], f"test_{i}", "eval"), namespace))[:100_000]
            else:
                exec(compile(test["code"], f"test_{i}", "exec"), namespace)
                row["passed"] = True
        except BaseException as exc:
            row["error"] = _error(exc)
        channel.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
