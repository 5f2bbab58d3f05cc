"""Environment adapters for libraries on PyPI (extra ``envs``), registered as entry points of group
``relayrl.environments``: ``reasoning_gym`` (reasoning-gym's procedural tasks, one step) and ``textarena``
(TextArena's single-player text games, multi-turn). Each library is imported only when an environment is built."""
