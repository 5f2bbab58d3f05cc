"""Runs inside the sandbox (``python -I -S``; standard library only): executes the program, then each test.

Reads ``program.py`` and ``tests.json`` (a list of Python statements, e.g. asserts) beside this file; writes one
JSON line per test to fd 3 as soon as it finishes, so the tests completed before a kill still count. The
program's own module namespace is shared by the tests; its ``__name__`` is ``"solution"``, so a
``if __name__ == "__main__":`` block does not run.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


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
        channel.write(json.dumps({"load_error": f"{type(exc).__name__}: {exc}"[:300]}) + "\n")
        return
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"test_{i}", "exec"), namespace)
            error = ""
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__
        channel.write(json.dumps({"test": i, "passed": not error, "error": error}) + "\n")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
