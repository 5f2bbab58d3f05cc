"""relayrl's built-in verifiers, each a reward function ``fn(inp, **params)`` (registered as entry points).

- ``math`` (:func:`maths.math_reward`): the completion's final answer against the reference with math-verify.
- ``exact_match``, ``regex``, ``format`` (:mod:`match`): exact or normalised match, regular expressions, and
  an answer inside a required tag.
- ``code`` (:func:`code.code_reward`): a Python program run against test cases in the sandbox.
"""
